"""Offload tiers of idle sessions (kvkeeper.sessions.offload): host memory, disk, restore, crash safety."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from kvkeeper import LLMEngine, SamplingParams
from kvkeeper.errors import InvalidRequestError
from kvkeeper.kvcache.formats.base import FORMATS, PagedKV
from kvkeeper.kvcache.store import KVStore
from kvkeeper.kvcache.validate import check_engine
from kvkeeper.sessions import SessionManager
from kvkeeper.sessions.disk import MANIFEST, session_dir_name
from kvkeeper.sessions.offload import SessionStore
from tests.utils.engines import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0)
SHORT = SamplingParams(max_tokens=2, temperature=0)
SYSTEM = "You are terse."
KIVI_PARTS = {"k", "v", "k_scale", "k_min", "v_scale", "v_min", "fill", "open", "res_k", "res_v"}
TURNS = ["Name three colours.", "And three animals?", "Which of them is the largest?"]


@pytest.fixture(scope="module")
def eng():
    """SmolLM2 on 256 blocks, on the default weight format (GGUF blocks in place, bf16 KV)."""
    return make_engine(num_kv_blocks=256)


@pytest.fixture(scope="module")
def sessions(eng, tmp_path_factory):
    """The engine's sessions, with a disk tier."""
    return SessionManager(eng, data_dir=tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(eng, sessions):
    """The three turns of a session never offloaded (then closed, and the prefix cache emptied)."""
    s = sessions.open(system=SYSTEM)
    out = [s.send(t, GREEDY) for t in TURNS]
    s.close()
    eng.pool.reset_prefix_cache()
    return out


def _raw_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.itemsize == 1 and a.dtype != torch.int8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a, b)


def _scribble(eng) -> None:
    """Empty the prefix cache and overwrite every free block's KV, so only the tier can give it back."""
    eng.pool.reset_prefix_cache()
    free = torch.tensor([b.block_id for b in eng.pool.blocks if b.ref_count == 0], dtype=torch.int64)
    for c in eng.kv.store:
        for t in c._parts().values():
            c._raw(t).index_fill_(0, free, 7)


def _two_turns(eng, sessions):
    eng.pool.reset_prefix_cache()
    s = sessions.open(system=SYSTEM)
    return s, [s.send(t, GREEDY) for t in TURNS[:2]]


def _assert_same(got, ref):
    for g, r in zip(got, ref):
        assert g.prompt_token_ids == r.prompt_token_ids
        assert g.token_ids == r.token_ids, f"turn {g.turn}"
    assert got[-1].cached_tokens == ref[-1].cached_tokens, "the KV came back whole"


def test_paged_kv_blocks_round_trip_bit_exact_every_format():
    g = torch.Generator().manual_seed(0)
    for fmt in FORMATS.values():
        a = PagedKV(6, 4, 3, 8, fmt)
        x = torch.randn(24, 3, 8, generator=g) * 3
        a.write(x, -x, torch.arange(24))
        got = a.read_blocks([4, 1])
        assert set(got) == (KIVI_PARTS if fmt.kivi else {"k", "v", "k_scale", "v_scale"} if fmt.quantized
                            else {"k", "v"})
        b = PagedKV(6, 4, 3, 8, fmt)
        b.write_blocks([0, 5], got)
        back = b.read_blocks([0, 5])
        assert all(_raw_equal(got[k], back[k]) for k in got), fmt.name
        idx = torch.tensor([4, 1])
        ka, va = a.gather(idx, 8, torch.float32)
        kb, vb = b.gather(torch.tensor([0, 5]), 8, torch.float32)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        got["k"] = got["k"][:1]
        with pytest.raises(ValueError, match="needs"):
            b.write_blocks([0, 5], got)


def _store(fmt, layers: int = 3, windowed=None) -> KVStore:
    g = torch.Generator().manual_seed(1)
    caches = [PagedKV(6, 4, 3, 8, fmt, layer_idx=i) for i in range(layers)]
    for c in caches:
        x = torch.randn(24, 3, 8, generator=g) * 3
        c.write(x, x.flip(0), torch.arange(24))
    return KVStore(caches, windowed)


def test_kv_store_blocks_round_trip_move_and_refuse_foreign_payloads():
    for fmt in FORMATS.values():
        a, b = _store(fmt), _store(FORMATS["float32"] if fmt.quantized else FORMATS["int8"])
        got = a.read_blocks([4, 1])
        parts = len(KIVI_PARTS) if fmt.kivi else 4 if fmt.quantized else 2
        assert len(got) == 3 * parts and all(k.split(".")[0] in "012" for k in got)
        if not fmt.kivi:  # (KIVI: the 16-bit window's pool is apart; tests/unit/kvcache/test_kivi.py)
            assert sum(t.nbytes for t in got.values()) == 2 * a.bytes_per_block
            assert a.nbytes == 6 * a.bytes_per_block == 6 * 4 * fmt.bytes_per_token(3, 3, 8)
        c = _store(fmt)
        c.write_blocks([0, 5], got)
        assert all(_raw_equal(got[k], t) for k, t in c.read_blocks([0, 5]).items()), fmt.name
        before = b.read_blocks(range(6))
        with pytest.raises(ValueError):  # another format: nothing of it is written, in any layer
            b.write_blocks([0, 5], got)
        assert all(_raw_equal(before[k], t) for k, t in b.read_blocks(range(6)).items())
        partial = {k: t for k, t in got.items() if not k.startswith("2.")}
        kept = c.read_blocks([2, 3])
        with pytest.raises(ValueError, match="layer 2"):  # a layer missing: layers 0 and 1 are not written either
            c.write_blocks([2, 3], partial)
        assert all(_raw_equal(kept[k], t) for k, t in c.read_blocks([2, 3]).items())
        with pytest.raises(ValueError, match="names no layer"):
            c.write_blocks([0, 5], {**got, "7.k": got["0.k"]})
        perm = c.read_blocks([1, 2, 0])
        c.move_blocks(torch.tensor([1, 2, 0]), torch.tensor([0, 1, 2]))  # overlapping: sources read first
        assert all(_raw_equal(perm[k], t) for k, t in c.read_blocks([0, 1, 2]).items())
        slots = torch.tensor([3, 17])
        k, v = c.gather(1, torch.tensor([0, 1, 2, 3, 4, 5]), 24, torch.float32)
        read = c.read_slots(1, slots)
        assert torch.equal(read["k"].float(), k[slots]) and torch.equal(read["v"].float(), v[slots])
    hybrid = _store(FORMATS["float32"], windowed=[False, True, False])
    assert not hybrid.uniform and _store(FORMATS["float32"]).uniform
    for op in (lambda: hybrid.read_blocks([0]), lambda: hybrid.move_blocks(torch.tensor([0]), torch.tensor([1]))):
        with pytest.raises(ValueError, match="hybrid"):
            op()


def test_host_offload_then_next_turn_is_exact(eng, sessions, reference):
    base = eng.pool.num_used
    s, out = _two_turns(eng, sessions)
    pinned, nc = s.num_blocks, s.kv.num_computed
    assert sessions.offload_idle(1, tier="host") == pinned
    assert s.tier == "host" and s.num_blocks == 0 and eng.pool.num_used == base
    assert eng.kv.offloaded_blocks() == -(-nc // eng.block_size) > 0
    assert eng.kv.pool_stats().offloaded == eng.kv.offloaded_blocks()
    assert not check_engine(eng)
    _scribble(eng)
    restores = sessions.store.counters.restores["host"]
    out.append(s.send(TURNS[2], GREEDY))
    assert s.tier == "pool" and sessions.store.counters.restores["host"] == restores + 1
    assert eng.kv.offloaded_blocks() == 0
    _assert_same(out, reference)
    s.close()
    assert eng.pool.num_used == base and not check_engine(eng)


def test_disk_offload_writes_checksummed_files_and_next_turn_is_exact(eng, sessions, reference):
    base = eng.pool.num_used
    s, out = _two_turns(eng, sessions)
    assert s.offload("disk") > 0 and s.tier == "disk"
    d = sessions.store.sessions_dir / session_dir_name(s.id)
    man = json.loads((d / MANIFEST).read_text())
    assert man["session_id"] == s.id and man["num_computed"] == len(out[1].prompt_token_ids) + len(out[1].token_ids) - 1
    assert sorted(p.name for p in d.iterdir()) == sorted([MANIFEST, man["kv_file"]])  # no temp file left
    assert sessions.stats()["offload"]["offloaded_bytes"]["disk"] == man["nbytes"] > 0
    _scribble(eng)
    out.append(s.send(TURNS[2], GREEDY))
    assert s.tier == "pool" and not d.exists()
    _assert_same(out, reference)
    s.close()
    assert eng.pool.num_used == base and not check_engine(eng)


def test_host_budget_overflow_moves_least_recent_to_disk(eng, sessions, reference):
    base = eng.pool.num_used
    store = sessions.store
    a, out_a = _two_turns(eng, sessions)
    b, out_b = _two_turns(eng, sessions)
    old_budget = store.host_budget
    try:
        a.offload("host")
        store.host_budget = store.bytes_in("host")  # room for one session only
        b.offload("host")
        assert (a.tier, b.tier) == ("disk", "host")  # a was used less recently
        _scribble(eng)
        out_a.append(a.send(TURNS[2], GREEDY))
        out_b.append(b.send(TURNS[2], GREEDY))
    finally:
        store.host_budget = old_budget
    _assert_same(out_a, reference)
    _assert_same(out_b, reference)
    a.close()
    b.close()
    assert eng.pool.num_used == base and not check_engine(eng)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_round_trip_bit_exact(tmp_path, kv_dtype):
    """int8, and int4 (KIVI: packed blocks plus the open tail block's 16-bit tokens), host -> disk -> restore."""
    e = make_engine(num_kv_blocks=64, kv_dtype=kv_dtype)
    sessions = SessionManager(e, data_dir=tmp_path)
    ref = sessions.open(system=SYSTEM)
    want = [ref.send(t, GREEDY) for t in TURNS]
    ref.close()
    e.pool.reset_prefix_cache()
    s, out = _two_turns(e, sessions)
    nb = -(-s.kv.num_computed // e.block_size)
    before = [c.read_blocks(s.kv.block_table[:nb]) for c in e.kv.store]
    s.offload("host")
    s.offload("disk")  # host -> disk
    assert s.tier == "disk"
    _scribble(e)
    assert sessions.store.restore(s)
    after = [c.read_blocks(s.kv.block_table) for c in e.kv.store]
    for x, y in zip(before, after):
        assert set(x) == (KIVI_PARTS if kv_dtype == "int4" else {"k", "v", "k_scale", "v_scale"})
        assert all(_raw_equal(x[k], y[k]) for k in x)
    if kv_dtype == "int4":  # the session's last block is open: its 16-bit tokens came back too
        assert any(bool(x["open"].any()) and x["res_k"].shape[0] >= 1 for x in before)
    out.append(s.send(TURNS[2], GREEDY))
    _assert_same(out, want)
    s.close()
    assert e.pool.num_used == 0 and not check_engine(e)


def test_corrupt_file_falls_back_to_recompute(eng, sessions, reference, caplog):
    base = eng.pool.num_used
    s, out = _two_turns(eng, sessions)
    s.offload("disk")
    d = sessions.store.sessions_dir / session_dir_name(s.id)
    kv = d / json.loads((d / MANIFEST).read_text())["kv_file"]
    raw = bytearray(kv.read_bytes())
    raw[-5] ^= 0x40  # flip one bit of the KV
    kv.write_bytes(bytes(raw))
    _scribble(eng)
    fails = sessions.store.counters.restore_failures["disk"]
    with caplog.at_level(logging.WARNING, logger="kvkeeper.sessions.offload"):
        r = s.send(TURNS[2], GREEDY)
    assert "corrupt" in caplog.text and "sha256" in caplog.text
    assert sessions.store.counters.restore_failures["disk"] == fails + 1
    assert r.cached_tokens == 0 and r.prompt_token_ids == reference[2].prompt_token_ids  # recomputed
    full = eng.generate([r.prompt_token_ids], GREEDY, namespace=eng.isolated_namespace())[0]
    assert r.token_ids == full.token_ids
    s.close()
    assert eng.pool.num_used == base and not check_engine(eng)


def test_file_of_other_tokens_is_never_restored(eng, sessions, caplog):
    """Another server on the same --data-dir rewrote the session's files with a conversation of the
    same length but other tokens: the restore must refuse them (not hand out, nor prefix-cache, wrong KV)."""
    base = eng.pool.num_used
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    s, t = sessions.open(), sessions.open()
    s.send("Name three colours.", p)
    t.send("Name three animals.", p)
    assert s.kv.num_computed == t.kv.num_computed and s.kv.token_ids != t.kv.token_ids
    s.offload("disk")
    t.offload("disk")
    root = sessions.store.sessions_dir
    ds, dt = root / session_dir_name(s.id), root / session_dir_name(t.id)
    man = json.loads((dt / MANIFEST).read_text())
    for f in ds.iterdir():
        f.unlink()
    (ds / man["kv_file"]).write_bytes((dt / man["kv_file"]).read_bytes())
    (ds / MANIFEST).write_text(json.dumps({**man, "session_id": s.id}))
    _scribble(eng)
    with caplog.at_level(logging.WARNING, logger="kvkeeper.sessions.offload"):
        r = s.send("And three animals?", GREEDY)
    assert "token ids" in caplog.text and r.cached_tokens == 0
    full = eng.generate([r.prompt_token_ids], GREEDY, namespace=eng.isolated_namespace())[0]
    assert r.token_ids == full.token_ids
    s.close()
    t.close()
    assert eng.pool.num_used == base and not check_engine(eng)


def test_foreign_or_half_written_sessions_are_skipped_at_start(eng, sessions, caplog):
    s = sessions.open()
    s.send("Hi", SHORT)
    s.offload("disk")
    root = sessions.store.sessions_dir
    d = root / session_dir_name(s.id)
    man = json.loads((d / MANIFEST).read_text())
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / man["kv_file"]).write_bytes((d / man["kv_file"]).read_bytes())
    (foreign / MANIFEST).write_text(json.dumps({**man, "session_id": "foreign", "model_revision": "other-model"}))
    half = root / "half"
    half.mkdir()
    (half / ".kv-x.safetensors.tmp-1-abc").write_bytes(b"partial")
    s.close()  # its own files go
    assert not d.exists()
    store = SessionStore(eng, sessions.store.data_dir)
    with caplog.at_level(logging.WARNING, logger="kvkeeper.sessions.disk"):
        assert store.scan() == []
    assert "model_revision='other-model'" in caplog.text
    assert foreign.exists() and not half.exists()  # foreign data is left alone, a cut-short write is removed
    assert "foreign" not in sessions


def test_saved_session_with_malformed_fields_is_skipped_not_fatal(eng, sessions, caplog):
    """A manifest that is valid JSON with wrong-typed messages/text/turns must be skipped at start (a warning),
    never stop the engine (server) from starting, nor register a session that breaks its next turn."""
    s = sessions.open()
    s.send("Hi", SHORT)
    s.offload("disk")
    root = sessions.store.sessions_dir
    d = root / session_dir_name(s.id)
    man = json.loads((d / MANIFEST).read_text())
    bad = {"bad-msgs": {"messages": 5}, "bad-text": {"text": 7}, "bad-msg-item": {"messages": ["hi"]}}
    for sid, patch in bad.items():
        (root / sid).mkdir()
        (root / sid / man["kv_file"]).write_bytes((d / man["kv_file"]).read_bytes())
        (root / sid / MANIFEST).write_text(json.dumps({**man, "session_id": sid, **patch}))
    s.close()
    store = SessionStore(eng, sessions.store.data_dir)
    try:
        with caplog.at_level(logging.WARNING, logger="kvkeeper.sessions.disk"):
            assert store.scan() == []
        assert all(sid not in sessions for sid in bad) and all(f"{root / sid}: " in caplog.text for sid in bad)
    finally:
        for sid in bad:
            if sid in sessions:
                sessions.close(sid)
            shutil.rmtree(root / sid, ignore_errors=True)


def test_a_session_saved_by_other_kv_settings_is_never_overwritten(eng, sessions):
    """A saved session skipped at start (another KV dtype) is left in place; a new session that reuses its id
    must not overwrite (and delete) its files when offloaded to disk: that offload fails, the KV stays in the pool."""
    from kvkeeper.sessions.offload import OffloadError

    sid = "other-dtype"
    root = sessions.store.sessions_dir
    s = sessions.open(session_id=sid)
    s.send("Hi", SHORT)
    s.offload("disk")
    man = json.loads((root / sid / MANIFEST).read_text())
    s.close()
    (root / sid).mkdir()
    blob = b"int8 kv of another server"
    (root / sid / man["kv_file"]).write_bytes(blob)
    (root / sid / MANIFEST).write_text(json.dumps({**man, "kv_dtype": "int8"}))
    before = sorted(p.name for p in (root / sid).iterdir())
    s = sessions.open(session_id=sid)
    s.send("Hello", SHORT)
    n = s.num_blocks
    with pytest.raises(OffloadError, match="kv_dtype"):
        s.offload("disk")
    assert s.tier == "pool" and s.num_blocks == n > 0
    assert sorted(p.name for p in (root / sid).iterdir()) == before
    assert (root / sid / man["kv_file"]).read_bytes() == blob
    s.close()
    assert (root / sid / MANIFEST).exists()  # still left in place
    shutil.rmtree(root / sid)
    assert not check_engine(eng)


def test_offload_errors_and_idle_selection(eng, sessions):
    with pytest.raises(InvalidRequestError, match="unknown offload tier"):
        sessions.offload_idle(1, tier="tape")
    bare = LLMEngine.__new__(LLMEngine)  # no need to load a model to check the disabled disk tier
    store = SessionStore(bare)
    with pytest.raises(InvalidRequestError, match="--data-dir"):
        store.check_tier("disk")
    old, new = sessions.open(), sessions.open()
    old.send("Hi", SHORT)
    new.send("Hello", SHORT)
    busy = sessions.open()
    busy.send("Hey", SHORT)
    seq = busy.begin_turn(messages=busy.messages + [{"role": "user", "content": "Ho"}],
                          params=SamplingParams(max_tokens=2, temperature=0))
    assert seq.num_handed_over > 0  # busy's KV now belongs to a waiting request
    assert busy.offload("host") == 0  # nothing pinned while its request runs
    n_old, used = old.num_blocks, eng.pool.num_used  # old shares blocks with new (the same system prompt): held
    freed = sessions.offload_idle(1)  # the blocks really freed, not old's references
    assert 1 <= freed == used - eng.pool.num_used <= n_old
    assert (old.tier, new.tier) == ("host", "pool")
    eng.run_until_done([seq])
    for x in (old, new, busy):
        x.close()
    assert eng.kv.offloaded_blocks() == 0 and not check_engine(eng)
