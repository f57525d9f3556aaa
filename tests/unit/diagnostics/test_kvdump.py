"""KV dump and diff: a session dumped twice diffs to zero; reuse vs recompute stays within fp32 rounding;
CLI round trip (exit codes, --json, clear errors); quantized caches dump exactly and audit cleanly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.utils.tiny_models import tiny_llama_folder
from kvkeeper import SamplingParams
from kvkeeper.diagnostics import faults
from kvkeeper.diagnostics.kvdiff import DumpMismatchError, diff_dumps, diff_files, load_dump
from kvkeeper.diagnostics.kvdump import dump_prompt, dump_session, dump_sequence, parse_layers, save_dump
from kvkeeper.diagnostics.audit import ReuseAuditor
from kvkeeper.errors import InvalidRequestError, SessionNotFoundError
from kvkeeper.sessions import SessionManager
from tests.utils.engines import make_engine

PROMPT = ("In the spring the river rose over its banks and the people of the valley moved their animals to the "
          "high pastures, where the grass was short but green, and waited for the water to go down again.")


@pytest.fixture(scope="module")
def eng():
    return make_engine(num_kv_blocks=256, quantization="none")  # float32 weights and KV: the fp32 dumps below


@pytest.fixture(scope="module")
def sessions(eng):
    return SessionManager(eng)


@pytest.fixture(scope="module")
def session(sessions):
    s = sessions.open(session_id="dump-1")
    s.send("Name three rivers in Europe.", SamplingParams(max_tokens=6))
    s.send("Which one is the longest?", SamplingParams(max_tokens=6))
    yield s
    s.close()


def test_session_dumped_twice_diffs_to_zero(eng, sessions, session, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_dump(a, *dump_session(sessions, "dump-1", "0,5,29"))
    save_dump(b, *dump_session(sessions, "dump-1", [0, 5, 29]))
    t, meta = load_dump(a)
    n = session.kv.num_computed
    assert sorted(t) == sorted(f"layers.{i}.{x}" for i in (0, 5, 29) for x in "kv")
    assert t["layers.5.k"].shape == (n, eng.model_config.num_kv_heads, eng.model_config.head_dim)
    assert (meta["token_start"], meta["token_end"], meta["kv_offset"]) == ("0", str(n), "0")
    assert meta["kv_dtype"] == "float32" and meta["bytes_per_token"] == str(eng.kv.bytes_per_token)
    assert meta["model_revision"] == eng.namespace.model_revision and meta["namespace"] == eng.namespace.key
    assert json.loads(meta["token_ids"]) == session.kv.token_ids[:n]
    # the dump is the cache itself: layer 5's K equals what attention gathers
    bt = torch.tensor(session.kv.block_table)
    assert torch.equal(t["layers.5.k"], eng.kv.store[5].gather(bt, n, torch.float32)[0])
    r = diff_files(a, b)
    assert r["max_abs"] == 0 and r["mean_abs"] == 0 and r["first_divergent"] is None and not r["warnings"]
    assert [x["layer"] for x in r["layers"]] == [0, 5, 29]


def test_reuse_vs_recompute_within_fp32_rounding(eng, sessions, session):
    ids = eng.tokenizer.encode(PROMPT)
    fresh = dump_prompt(eng, ids, namespace=eng.isolated_namespace("fresh"))
    reused = dump_prompt(eng, ids, warm_prefix=40, namespace=eng.isolated_namespace("warm"))
    assert fresh[1]["cached_tokens"] == "0" and reused[1]["cached_tokens"] == "32"
    r = diff_dumps(fresh, reused)  # fp32 rounding of GEMMs of other shapes: a few ulps of the largest |K|
    assert r["max_rel"] <= 1e-5 and r["max_abs"] <= 1e-4, r
    assert "namespace differs" in " ".join(r["warnings"])
    # a session's turn 2 reuses KV of decoded tokens (one-row products): compare with its prompt recomputed
    st = session.kv
    kept = dump_session(sessions, "dump-1")
    again = dump_prompt(eng, st.token_ids[: st.num_computed], namespace=eng.isolated_namespace("recompute"))
    r = diff_dumps(again, kept)
    assert r["max_rel"] <= 1e-5 and r["max_abs"] <= 1e-4, r
    # a wrong token is not within rounding: the diff names its layer and position
    ids2 = list(ids)
    ids2[17] = (ids2[17] + 1) % eng.model_config.vocab_size
    r = diff_dumps(fresh, dump_prompt(eng, ids2, namespace=eng.isolated_namespace("other")), atol=1e-4)
    assert r["first_divergent"] == {"layer": 0, "token": 17, "tensor": "k"}
    assert "token_ids differs" in r["warnings"]


def test_dump_errors_are_clear(sessions, session):
    with pytest.raises(SessionNotFoundError, match="no open session 'nope'") as e:
        dump_session(sessions, "nope")
    assert "dump-1" not in str(e.value)  # never lists the open sessions (another tenant's ids)
    with pytest.raises(InvalidRequestError, match="layer 30 does not exist"):
        dump_session(sessions, "dump-1", "0,30")
    with pytest.raises(InvalidRequestError, match="bad layer 'x'"):
        parse_layers("1,x", 30)
    n = session.kv.num_computed
    with pytest.raises(InvalidRequestError, match=f"outside the KV of session:dump-1: give 0 <= start < end <= {n}"):
        dump_session(sessions, "dump-1", start=5, end=n + 1)
    with pytest.raises(InvalidRequestError, match="outside"):
        dump_session(sessions, "dump-1", start=5, end=5)
    a = dump_session(sessions, "dump-1", "0,1")
    with pytest.raises(DumpMismatchError, match="different layers: '0,1' vs '0'"):
        diff_dumps(a, dump_session(sessions, "dump-1", "0"))
    with pytest.raises(DumpMismatchError, match="different first token position"):
        diff_dumps(a, dump_session(sessions, "dump-1", "0,1", start=1))


def test_dump_of_an_offloaded_session_says_where_its_kv_is(sessions):
    s = sessions.open(session_id="dump-off")
    s.send("Hi", SamplingParams(max_tokens=2))
    s.offload("host")
    with pytest.raises(InvalidRequestError, match="offloaded to the host tier.*next turn"):
        dump_session(sessions, "dump-off")
    s.close()


def test_cli_round_trip(eng, tmp_path, monkeypatch, capsys):
    import kvkeeper.cli as cli

    monkeypatch.setattr(cli.kv, "load_engine", lambda args: eng)  # one model load for the whole test
    p = {k: str(tmp_path / f"{k}.safetensors") for k in "abcd"}

    def dump(out, *extra):
        eng.pool.reset_prefix_cache()  # as in a fresh process: nothing cached
        return cli.main(["kv", "dump", "--prompt", PROMPT, "--layers", "0,5,29", "-o", out, *extra])

    assert dump(p["a"]) == 0 and dump(p["b"]) == 0
    capsys.readouterr()
    assert cli.main(["kv", "diff", p["a"], p["b"], "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["max_abs"] == 0 and r["first_divergent"] is None and len(r["layers"]) == 3
    assert dump(p["c"], "--warm-prefix", "40") == 0  # reused from the prefix cache
    assert load_dump(p["c"])[1]["cached_tokens"] == "32"
    capsys.readouterr()
    assert cli.main(["kv", "diff", p["a"], p["c"], "--json", "--atol", "1e-4"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["max_rel"] <= 1e-5 and r["first_divergent"] is None
    assert dump(p["d"], "--layers", "0") == 0
    capsys.readouterr()
    assert cli.main(["kv", "diff", p["a"], p["d"]]) == 2
    assert "different layers: '0,5,29' vs '0'" in capsys.readouterr().err
    assert cli.main(["kv", "dump", "--prompt", PROMPT, "--layers", "0,a", "-o", p["d"]]) == 2
    assert "bad layer 'a'" in capsys.readouterr().err
    assert cli.main(["kv", "dump", "--session", "x", "-o", p["d"]]) == 2
    assert "--session needs --server" in capsys.readouterr().err
    # a real process: no model load for a diff; exit 0 without divergence, 1 with, 2 for a file that is no dump
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvkeeper.cli", "kv", "diff", *a], capture_output=True,
                                    text=True, timeout=120)
    assert run(p["a"], p["b"]).returncode == 0
    (tmp_path / "x.safetensors").write_bytes(b"not a dump")
    q = run(p["a"], str(tmp_path / "x.safetensors"))
    assert q.returncode == 2 and "is not a safetensors file" in q.stderr and "Traceback" not in q.stderr


# ---- quantized and half-precision caches, on a tiny random Llama ----------------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-kvdump"), hidden_size=64, head_dim=16, num_layers=3)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_quantized_dump_is_exact_and_audit_is_clean(folder, kv_dtype):
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4, kv_dtype=kv_dtype,
                    max_num_batched_tokens=8)  # chunked prefill: chunks read the quantized cache
    eng.auditor = ReuseAuditor(1.0).attach(eng)
    s = SessionManager(eng).open()
    s.send("Hello there, how are you today?", SamplingParams(max_tokens=4, ignore_eos=True))
    s.send("And what about the weather?", SamplingParams(max_tokens=4, ignore_eos=True))
    st = s.kv
    t, meta = dump_sequence(eng, st, "0,2")
    bt = torch.tensor(st.block_table)
    k, v = eng.kv.store[2].gather(bt, st.num_computed, torch.float32)
    assert torch.equal(t["layers.2.k"].float(), k) and torch.equal(t["layers.2.v"].float(), v)
    assert meta["tensor_dtype"] == ("bfloat16" if kv_dtype == "bf16" else "float32")
    assert eng.auditor.total == 2 and eng.auditor.mismatches == 0, [r.summary() for r in eng.auditor.reports]
    assert eng.auditor.reports[-1].cached_tokens > 0
    seq = eng.add_request(list(range(100, 124)), SamplingParams(max_tokens=1), namespace=eng.isolated_namespace())
    faults.shift_positions(eng, seq, 9, 12)  # still caught with the looser quantized tolerance
    eng.run_until_done([seq])
    r = eng.auditor.reports[-1]
    assert (r.request_id, r.layer, r.token, r.tensor) == (seq.request_id, 0, 9, "k")
    s.close()


@pytest.mark.parametrize("num_layers", [30, None])
def test_huge_layer_range_is_refused_at_once(num_layers):
    # "0-99999999999" used to build a set of 1e11 ints on the engine thread (the server ran out of memory).  "At
    # once" is measured in memory, not in seconds (a loaded machine's seconds say nothing): the parse allocates
    # under 1 MB, where an expansion would hold tens of MB after its first million layers
    import tracemalloc

    tracemalloc.start()
    try:
        if num_layers is None:
            assert parse_layers("0-99999999999", None) is not None  # syntax only: valid, not expanded
        else:
            with pytest.raises(InvalidRequestError, match="layer 99999999999 does not exist.*0..29"):
                parse_layers("0-99999999999", num_layers)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert parse_layers("2-4,0", 30) == [0, 2, 3, 4]


def test_kv_dump_to_a_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    import kvkeeper.cli as cli

    def no_engine(args):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(cli.kv, "load_engine", no_engine)
    assert cli.main(["kv", "dump", "--prompt", "Hi", "-o", str(tmp_path)]) == 2


def test_parse_layers_takes_one_int_and_refuses_other_types_clearly():
    # dump_session(eng, "s", 3) raised AttributeError: 'int' object has no attribute 'split'
    assert parse_layers(3, 30) == [3]
    assert parse_layers((0, 2), 30) == [0, 2]
    for bad in (True, 1.5, {"a": 1}):
        with pytest.raises(InvalidRequestError, match="layers must be"):
            parse_layers(bad, 30)


def _dump(k0, v0):
    import torch

    meta = {"layers": "0", "token_start": "10", "token_end": str(10 + k0.shape[0]), "model_revision": "r",
            "namespace": "n", "kv_dtype": "float32", "token_ids": "[]"}
    return {"layers.0.k": k0, "layers.0.v": v0}, meta


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_kv_diff_reports_nan_or_inf_as_divergence(bad):
    # a dump with NaN KV was reported as "max |diff| 0; no divergence" (exit 0), and --json printed NaN
    import json

    import torch

    from kvkeeper.diagnostics.kvdiff import diff_dumps, format_report, to_json

    k = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(0))
    v = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(1))
    k2 = k.clone()
    k2[4, 1, 2] = bad
    for a, b in ((_dump(k, v), _dump(k2, v)), (_dump(k2, v), _dump(k, v))):
        r = diff_dumps(a, b, atol=1e-3)
        assert r["first_divergent"] == {"layer": 0, "token": 14, "tensor": "k"}, r
        assert any("NaN or infinite" in w for w in r["warnings"])
        json.loads(to_json(r), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        assert "no divergence" not in format_report(r)
    same = diff_dumps(_dump(k2, v), _dump(k2.clone(), v))  # the same bits on both sides: no divergence
    assert same["first_divergent"] is None and same["max_abs"] == 0.0
