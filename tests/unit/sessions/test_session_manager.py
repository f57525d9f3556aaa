"""The session manager and its sessions on a tiny random Llama: a saved session with a malformed namespace, turns
whose KV a session cannot hand over (policies that score every prompt query), aborted turns, a closed id reopened
while its last turn runs, a prompt larger than the pool, pinned blocks of a shared prefix."""

from __future__ import annotations

import json

import pytest

from kvkeeper import SamplingParams
from kvkeeper.kvcache.compression import KVCompression
from kvkeeper.kvcache.validate import check_engine
from kvkeeper.sessions import SessionManager
from kvkeeper.sessions.disk import MANIFEST, session_dir_name
from tests.utils.tiny_models import tiny_llama_folder
from tests.utils.engines import make_engine

P = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-edges"))


def _recompute(eng, ids, params=P):
    return eng.generate([ids], params, namespace=eng.isolated_namespace())[0].token_ids


def test_a_malformed_saved_namespace_recomputes_and_orphans_nothing(folder, tmp_path):
    """A manifest whose namespace is not Namespace's fields (edited after start): the turn recomputes its prompt;
    no request of the turn stays queued, and the next turns go on (it raised TypeError and left an orphan)."""
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4)
    s = SessionManager(eng, data_dir=tmp_path).open(session_id="orph")
    s.send("Hello there, how are you?", P)
    s.offload("disk")
    man_path = tmp_path / "sessions" / session_dir_name("orph") / MANIFEST
    man = json.loads(man_path.read_text())
    man_path.write_text(json.dumps({**man, "namespace": {**man["namespace"], "bogus": 1}}))
    eng.pool.reset_prefix_cache()  # only the disk tier could give the KV back
    r = s.send("And the weather?", P)
    assert r.cached_tokens == 0 and r.token_ids == _recompute(eng, r.prompt_token_ids)
    r3 = s.send("And tomorrow?", P)
    assert r3.cached_tokens > 0 and not eng.has_unfinished()
    s.close()
    assert eng.pool.num_used == 0 and check_engine(eng) == []


def test_a_turn_whose_policy_scores_every_prompt_query_gets_no_session_kv(folder):
    """h2o and snapkv observe every prompt query: as with the prefix cache, a session hands such a turn nothing."""
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4)
    s = SessionManager(eng).open()
    s.send("Hello there, how are you today?", P)
    seq = s.begin_turn(messages=s.messages + [{"role": "user", "content": "And the weather?"}], params=P,
                       compression=KVCompression("h2o", 0.5))
    assert seq.num_handed_over == 0 and seq.num_computed == 0
    eng.run_until_done([seq])
    knorm = s.begin_turn(messages=s.messages + [{"role": "user", "content": "Tomorrow?"}], params=P,
                         compression=KVCompression("knorm", 0.5))
    assert knorm.num_handed_over == 0  # the previous turn's KV is compressed: never handed over
    eng.run_until_done([knorm])
    s.close()
    assert eng.pool.num_used == 0 and check_engine(eng) == []


def test_an_aborted_turn_keeps_its_kv_but_records_nothing(folder):
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    s = SessionManager(eng).open()
    first = s.send("Hello there, how are you?", P)
    before = (list(s.messages), len(s.turns))
    msgs = s.messages + [{"role": "user", "content": "Tell me about the weather in spring."}]
    seq = s.begin_turn(messages=msgs, params=P)
    eng.step()  # part of its prefill
    eng.abort(seq.request_id)
    assert (s.messages, len(s.turns)) == before and s.turn is None
    r = s.send("Tell me about the weather in spring.", P)  # the client asks again: the aborted prefill is reused
    assert r.cached_tokens > len(first.prompt_token_ids) and r.token_ids == _recompute(eng, r.prompt_token_ids)
    assert [t.turn for t in s.turns] == [1, 2] and s.messages[-2]["content"].startswith("Tell me")
    s.close()
    assert eng.pool.num_used == 0 and check_engine(eng) == []


def test_a_closed_session_id_can_be_reopened_while_its_last_turn_runs(folder):
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4)
    sessions = SessionManager(eng)
    old = sessions.open(session_id="dup")
    seq = old.begin_turn(messages=[{"role": "user", "content": "Hi"}], params=P)
    eng.step()
    old.close()
    new = sessions.open(session_id="dup")
    r = new.send("Hello", P)  # its request id must not collide with the running dup-t1
    eng.run_until_done([seq])
    assert r.finish_reason == "length" and seq.finish_reason == "length"
    new.close()
    assert eng.pool.num_used == 0 and check_engine(eng) == []


def test_a_prompt_larger_than_the_pool_is_refused_before_any_work(folder):
    """It was prefilled in chunks, preempted, and pushed every idle session to the host tier before failing."""
    eng = make_engine(str(folder), num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    sessions = SessionManager(eng)
    idle = sessions.open()
    idle.send("Hello there, how are you?", P)
    steps = eng.num_steps
    out = eng.generate([list(range(100, 200))], P)[0]
    assert out.finish_reason == "error" and "the pool has only 24 blocks" in out.error
    assert eng.num_steps == steps  # no model step ran for it
    assert idle.tier == "pool" and idle.num_blocks > 0 and sessions.store.counters.offloads["host"] == 0
    idle.close()
    assert eng.pool.num_used == 0 and check_engine(eng) == []


def test_pinned_blocks_counts_a_shared_prefix_once(folder):
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4)
    sessions = SessionManager(eng)
    a, b = sessions.open(system="A long shared system prompt for both."), sessions.open(system="A long shared system prompt for both.")
    a.send("Hi", P)
    b.send("Hi", P)
    shared = set(a.kv.block_table) & set(b.kv.block_table)
    assert shared and sessions.stats()["pinned_blocks"] == eng.pool.num_used == len(set(a.kv.block_table) |
                                                                                        set(b.kv.block_table))
    a.close()
    b.close()
