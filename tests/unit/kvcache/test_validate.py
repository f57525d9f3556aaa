"""Integrity validators: clean runs pass, injected faults are caught and named (block, token)."""

from __future__ import annotations

import pytest
import torch

from tests.utils.tiny_models import tiny_llama_folder
from kvkeeper import SamplingParams
from kvkeeper.kvcache.validate import IntegrityError, assert_engine_ok, check_engine
from kvkeeper.sessions import SessionManager
from tests.utils.engines import make_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-validate"))


def _ids(n, seed):
    return torch.randint(0, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _running_pair(folder):
    """Two sequences mid-decode (prefilled, full blocks registered), in two namespaces."""
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4, validate_every=1)
    a = eng.add_request(_ids(18, 1), SamplingParams(max_tokens=20, ignore_eos=True))
    b = eng.add_request(_ids(18, 2), SamplingParams(max_tokens=20, ignore_eos=True), namespace=eng.isolated_namespace("b"))
    for _ in range(3):
        eng.step()
    assert check_engine(eng) == []
    return eng, a, b


def test_clean_runs_have_no_violations(folder):
    eng = make_engine(str(folder), num_kv_blocks=24, block_size=4, max_num_batched_tokens=8, validate_every=1)
    s = SessionManager(eng).open()
    s.send("Hello there, how are you?", SamplingParams(max_tokens=6))
    s.send("And the weather?", SamplingParams(max_tokens=6))
    eng.generate([_ids(30, s) for s in range(4)], SamplingParams(max_tokens=8, ignore_eos=True))  # preempts
    assert check_engine(eng) == []
    s.close()
    assert check_engine(eng) == [] and eng.pool.num_used == 0


def test_block_reused_across_namespaces_is_caught(folder):
    eng, a, b = _running_pair(folder)
    # fault: b's first block replaced by a's (a block from another namespace, with a proper reference)
    eng.pool.incref(a.block_table[0])
    eng.pool.free(b.block_table[0])
    b.block_table[0] = a.block_table[0]
    v = check_engine(eng)
    assert [x.kind for x in v] == ["prefix_key"]
    assert v[0].owner == b.request_id and v[0].block == a.block_table[0] and v[0].token == 0
    assert "another namespace" in v[0].detail
    with pytest.raises(IntegrityError, match="another namespace"):
        eng.step()  # validate_every=1: the next step refuses to run on a corrupt cache


def test_positions_shifted_by_one_are_caught(folder):
    eng, a, _ = _running_pair(folder)
    a.token_ids.insert(0, 7)  # fault: every token sits one position later than its KV
    a.num_prompt_tokens += 1
    a.num_computed += 1
    v = check_engine(eng)
    kinds = {x.kind for x in v if x.owner == a.request_id}
    assert "prefix_key" in kinds
    first = next(x for x in v if x.kind == "prefix_key")
    assert first.token == 0 and first.block == a.block_table[0]


def test_block_freed_while_referenced_is_caught(folder):
    eng, a, _ = _running_pair(folder)
    bid = a.block_table[1]
    eng.pool.free(bid)  # fault: freed although a's table still holds it
    v = check_engine(eng)
    assert any(x.kind == "refcount" and x.block == bid and "freed while referenced" in x.detail for x in v)
    with pytest.raises(IntegrityError):
        assert_engine_ok(eng)


def test_out_of_range_index_and_wrong_table_length_are_caught(folder):
    eng, a, b = _running_pair(folder)
    a.block_table.append(10_000)
    b.block_table.pop()
    v = check_engine(eng)
    assert any(x.kind == "index" and x.owner == a.request_id for x in v)
    assert any(x.kind == "positions" and x.owner == b.request_id for x in v)
