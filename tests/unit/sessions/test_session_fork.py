"""Forking a session copy-on-write (``SessionManager.fork``, :mod:`kvkeeper.sessions.fork`) on a tiny random Llama:
the fork shares the full blocks by refcount and copies the partial last one; each branch's next turn reuses the
whole KV and equals a recomputation; neither branch changes the other's KV; an offloaded source is restored first;
closing both frees every block."""

from __future__ import annotations

import pytest
import torch

from kvkeeper import SamplingParams
from kvkeeper.kvcache.validate import check_engine
from kvkeeper.sessions import SessionManager
from tests.utils.tiny_models import tiny_llama_folder
from tests.utils.engines import make_engine

P = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-fork"))


def _recompute(eng, ids):
    return eng.generate([ids], P, namespace=eng.isolated_namespace())[0].token_ids


def _kv(eng, seq) -> dict:
    return eng.kv.store.read_blocks(seq.block_table)


def test_fork_shares_full_blocks_copies_the_partial_one_and_branches_stay_apart(folder):
    eng = make_engine(str(folder), num_kv_blocks=96, block_size=4)
    mgr = SessionManager(eng)
    a = mgr.open(session_id="a")
    a.send("Hello there, how are you today?", P)
    st = a.kv
    assert st.num_computed % 4, "the test needs a partial last block"
    b = mgr.fork(a, "b")
    nfull = st.num_computed // 4
    assert b.kv.block_table[:nfull] == st.block_table[:nfull] and b.kv.num_computed == st.num_computed
    assert all(eng.pool.blocks[i].ref_count == 2 for i in st.block_table[:nfull])
    assert b.kv.block_table[nfull] != st.block_table[nfull] and eng.pool.blocks[b.kv.block_table[nfull]].ref_count == 1
    before = _kv(eng, st)
    for k, v in _kv(eng, b.kv).items():
        assert torch.equal(v, before[k]), k  # the partial block is a copy, bit for bit
    rb = b.send("Tell me about the sea.", P)
    assert rb.cached_tokens == st.num_computed and rb.token_ids == _recompute(eng, rb.prompt_token_ids)
    after = eng.kv.store.read_blocks(st.block_table)
    for k, v in after.items():
        assert torch.equal(v, before[k]), k  # branch b wrote nothing into a's blocks
    ra = a.send("Tell me about the mountains.", P)
    assert ra.cached_tokens == rb.cached_tokens and ra.token_ids == _recompute(eng, ra.prompt_token_ids)
    assert check_engine(eng) == []
    a.close()
    b.close()
    assert eng.pool.num_used == 0


def test_fork_of_an_offloaded_session_restores_it_first(folder):
    eng = make_engine(str(folder), num_kv_blocks=96, block_size=4)
    mgr = SessionManager(eng)
    a = mgr.open(session_id="a")
    a.send("Hello there, how are you today?", P)
    n = a.kv.num_computed
    a.offload("host")
    b = mgr.fork(a, "b")
    assert a.tier == "pool" and b.kv.num_computed == n
    r = b.send("And the weather?", P)
    assert r.cached_tokens == n and r.token_ids == _recompute(eng, r.prompt_token_ids)
    with pytest.raises(Exception, match="already open"):
        mgr.fork(a, "b")
