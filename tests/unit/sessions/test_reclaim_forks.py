"""Reclaim and offload of forked sessions (issue 44 item 1) on a tiny random Llama and a small pool.

Forks share their full blocks with their source by refcount, so offloading one fork frees only its private blocks:
reclaim must count the blocks it really returned to the pool's free list (not the references it dropped), the
offload API must report those, and the host tier must hold a shared prefix once however many forks of it are
offloaded.  A hypothesis test builds any mix of plain sessions, forks and forks' own turns, then asks for a
request that fits the pool once the idle sessions are offloaded: it is never refused.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkeeper import SamplingParams
from kvkeeper.kvcache.validate import check_engine
from kvkeeper.sessions import SessionManager
from tests.utils.engines import make_engine
from tests.utils.tiny_models import tiny_llama_folder

BS, POOL = 4, 48
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
P = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    folder = tiny_llama_folder(tmp_path_factory.mktemp("tiny-reclaim"), vocab_size=512)
    return make_engine(str(folder), num_kv_blocks=POOL, block_size=BS)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _turn(eng, s, ids, params=P):
    seq = s.begin_turn(prompt=s.kv.token_ids + ids if s.kv is not None else ids, params=params)
    eng.run_until_done([seq])
    assert seq.finish_reason != "error", seq.error
    return seq


def _close_all(eng, mgr):
    for s in list(mgr):
        s.close()
    eng.pool.reset_prefix_cache()
    assert eng.pool.num_used == 0
    if mgr in eng.kv.holders:
        eng.kv.holders.remove(mgr)


def _used(eng) -> int:
    return eng.pool.num_used


def test_offloading_forks_reports_real_frees_and_keeps_the_shared_prefix_once(eng):
    mgr = SessionManager(eng)
    try:
        rng = random.Random(1)
        a = mgr.open(session_id="a")
        _turn(eng, a, _ids(rng, 88))  # 88 + 2 tokens computed: 22 full blocks and a partial one
        prefix, partial = divmod(a.kv.num_computed, BS)
        assert partial, "the test needs a partial last block"
        forks = [mgr.fork(a, f"f{i}") for i in range(5)]
        for f in [a, *forks]:
            before = _used(eng)
            got = f.offload("host")
            assert got == before - _used(eng), "offload reports the blocks it returned to the free list"
        assert _used(eng) == 0
        # one copy of the shared full blocks, plus each session's own partial last block
        assert mgr.store.num_blocks() == prefix + 6
        assert mgr.stats()["offload"]["offloaded_blocks"] == prefix + 6
        for f in forks[:2]:  # the deduplicated host copy restores bit for bit: the next turn equals a recomputation
            seq = _turn(eng, f, _ids(rng, 5))
            ref = eng.generate([seq.token_ids[:seq.num_prompt_tokens]], P, namespace=eng.isolated_namespace())[0]
            assert seq.num_cached_tokens >= a.kv.num_computed and list(seq.output_token_ids) == ref.token_ids
        assert check_engine(eng) == []
    finally:
        _close_all(eng, mgr)
    assert mgr.store.num_blocks() == 0 and mgr.store.bytes_in("host") == 0


def test_reclaim_counts_blocks_freed_not_references_dropped(eng):
    mgr = SessionManager(eng)
    try:
        rng = random.Random(2)
        a = mgr.open(session_id="a")
        _turn(eng, a, _ids(rng, 90))
        for i in range(4):
            _turn(eng, mgr.fork(a, f"f{i}"), _ids(rng, 6))
        before = _used(eng)
        got = mgr.reclaim(2)
        assert got == before - _used(eng) and got >= 2
    finally:
        _close_all(eng, mgr)


OPS = st.lists(st.one_of(
    st.tuples(st.just("open"), st.integers(8, 60)),
    st.tuples(st.just("fork"), st.integers(0, 20)),
    st.tuples(st.just("turn"), st.integers(0, 20), st.integers(1, 12)),
), min_size=1, max_size=10)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, seed=st.integers(0, 2**16), offload=st.booleans())
def test_any_mix_of_sessions_and_forks_never_refuses_a_request_that_fits(eng, ops, seed, offload):
    """Sessions, forks and forks' turns in any order on a 48-block pool, then a request needing 46 blocks: idle
    sessions are offloaded (host tier) or unpinned to make room, never is the request refused."""
    mgr = SessionManager(eng, host_offload_bytes=(1 << 30) if offload else 0)
    rng = random.Random(seed)
    try:
        live = []
        for op in ops:
            if op[0] == "open":
                s = mgr.open()
                _turn(eng, s, _ids(rng, op[1]))
                live.append(s)
            elif live and op[0] == "fork":
                src = live[op[1] % len(live)]
                live.append(mgr.fork(src))
            elif live and op[0] == "turn":
                s = live[op[1] % len(live)]
                if len(s.kv.token_ids) + op[2] + P.max_tokens < (POOL - 4) * BS:
                    _turn(eng, s, _ids(rng, op[2]))
        need = POOL - 2
        seq = eng.add_request(_ids(rng, need * BS - 1), ONE, namespace=eng.isolated_namespace())
        eng.run_until_done([seq])
        assert seq.finish_reason != "error", seq.error
        assert check_engine(eng) == []
    finally:
        _close_all(eng, mgr)
