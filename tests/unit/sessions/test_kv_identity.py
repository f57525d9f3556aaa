"""Saved KV is continued only by an engine whose K/V bytes would be the same (issue 44 item 2).

A session saved to the disk tier by one engine (tiny random Llama, float32) is reopened by an engine on the same
data directory with one setting changed that changes the bytes of a K/V entry: the weight format, the activation
dtype, the KV dtype, the block size, the attention backend, the kernels' invariant mode, RoPE's base (a config of
its own).  It is skipped with a warning naming the setting, and an export of it is refused on import with the
same difference named; an engine of the same settings reopens it and continues from the saved KV.
"""

from __future__ import annotations

import json
import logging

import pytest

from kvkeeper import SamplingParams
from kvkeeper.errors import InvalidRequestError
from kvkeeper.sessions import SessionManager
from kvkeeper.sessions.portable import export_session, import_session
from tests.utils.engines import make_engine
from tests.utils.tiny_models import tiny_llama_folder

P = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
BASE = dict(num_kv_blocks=64, block_size=4, quantization="none", kv_dtype="fp32")  # one KV dtype for all but its own case


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-identity"), vocab_size=512)


@pytest.fixture(scope="module")
def rope_folder(tmp_path_factory, folder):
    """The same weights with another RoPE base (config.json's rope_theta)."""
    out = tmp_path_factory.mktemp("tiny-identity-rope")
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_theta"] = 1234.5
    if isinstance(cfg.get("rope_parameters"), dict):  # transformers 5 writes it there
        cfg["rope_parameters"]["rope_theta"] = 1234.5
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def saved(folder, tmp_path_factory):
    """(data dir, export bytes, the saved engine's numerics) of one session saved by the base engine."""
    data = tmp_path_factory.mktemp("identity-data")
    eng = make_engine(str(folder), **BASE)
    mgr = SessionManager(eng, data_dir=data)
    s = mgr.open(session_id="keep")
    s.begin_turn(prompt=list(range(5, 40)), params=P)
    eng.run_until_done([s.turn.seq] if s.turn is not None else [])
    blob = export_session(mgr, s)
    assert mgr.save_all() == 1
    return data, blob, eng.kv.numerics()


def _other_backend(numerics) -> dict:
    return dict(attention_backend="torch" if numerics["attention_backend"] != "torch" else "cpu")


CHANGES = {
    "weight_format": dict(quantization="int8"),
    "activation_dtype": dict(dtype="bfloat16"),
    "kv_dtype": dict(kv_dtype="bf16"),
    "block_size": dict(block_size=8),
    "invariant_kernels": dict(invariant_kernels=False),
    "attention_backend": None,  # the other of cpu / torch
    "rope_theta": "rope",
}


@pytest.mark.parametrize("key", list(CHANGES))
def test_a_session_saved_under_other_numerics_is_skipped_and_its_import_refused(key, saved, folder, rope_folder,
                                                                                 caplog):
    data, blob, numerics = saved
    change = CHANGES[key]
    model = str(rope_folder if change == "rope" else folder)
    settings = {**BASE, **(_other_backend(numerics) if change is None else {} if change == "rope" else change)}
    try:
        eng = make_engine(model, **settings)
    except InvalidRequestError as e:
        pytest.skip(f"{key}: this machine cannot run {settings}: {e}")
    if key != "block_size":
        assert eng.kv.numerics()[key] != numerics[key] if key in numerics else True
    with caplog.at_level(logging.WARNING, logger="kvkeeper.sessions"):
        mgr = SessionManager(eng, data_dir=data)
    assert "keep" not in mgr, f"a session saved under other {key} was reopened"
    assert any("skipping the saved session" in r.getMessage() and f"{key}=" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    with pytest.raises(InvalidRequestError, match=f"{key}="):
        import_session(mgr, blob, session_id="imported")
    assert "imported" not in mgr


def test_the_same_settings_continue_the_saved_session_from_its_kv(saved, folder):
    data, blob, _ = saved
    eng = make_engine(str(folder), **BASE)
    mgr = SessionManager(eng, data_dir=data)
    assert "keep" in mgr and mgr.get("keep").tier == "disk"
    s = mgr.get("keep")
    n = s.kv.num_computed if s.kv.num_computed else len(s.kv.token_ids) - 1
    seq = s.begin_turn(prompt=s.kv.token_ids + [41, 42, 43], params=P)
    eng.run_until_done([seq])
    assert seq.finish_reason != "error" and seq.num_cached_tokens >= n > 0
    imported = import_session(mgr, blob, session_id="again")
    assert imported.kv is not None and imported.kv.num_computed > 0
