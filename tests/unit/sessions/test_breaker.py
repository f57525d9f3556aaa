"""Compaction (defragmentation) moves KV exactly; the circuit breaker's tiers trip in order and undo themselves;
conversation budgets trim the oldest turns without losing them."""

from __future__ import annotations

import pytest
import torch

from kvkeeper import SamplingParams
from kvkeeper.sessions.breaker import BreakerConfig, CircuitBreaker, OverloadedError
from kvkeeper.kvcache.validate import check_engine
from kvkeeper.sessions.context import split_turns, trim_oldest_turns
from tests.utils.engines import make_engine
from tests.utils.sessionutil import sessions_of
from tests.utils.tiny_models import tiny_llama_folder

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-breaker"))


def _session_kv(eng, s):
    st = s.kv
    bt = torch.tensor(st.block_table, dtype=torch.int64)
    return [c.gather(bt, st.num_computed, torch.float32) for c in eng.kv.store]


def _fragmented(folder, kv_dtype=None):
    """Four sessions, two turns each, then sessions 1 and 3 closed: holes between the survivors."""
    eng = make_engine(str(folder), num_kv_blocks=96, block_size=4, validate_every=1, kv_dtype=kv_dtype)
    ss = [sessions_of(eng).open(system=f"You are helper number {i}.") for i in range(4)]
    for turn in range(2):
        for i, s in enumerate(ss):
            s.send(f"Turn {turn}: tell me about the number {i * 7 + turn}.", GREEDY)
    eng.generate([f"an unrelated prompt {k} " * 3 for k in range(3)], GREEDY)  # cached free blocks too
    ss[1].close()
    ss[3].close()
    return eng, [ss[0], ss[2]]


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_compaction_moves_kv_bit_exactly_and_sessions_continue_identically(folder, kv_dtype):
    eng, live = _fragmented(folder, kv_dtype)
    twin, twin_live = _fragmented(folder, kv_dtype)  # the same history, never compacted
    before = eng.kv.pool_stats()
    assert before.pool_rate > 0 and before.cached > 0
    kv_before = [_session_kv(eng, s) for s in live]
    res = eng.kv.compact()
    after = eng.kv.pool_stats()
    assert res["evicted"] == 0 and res["moved"] > 0
    # the prefix cache is kept (its blocks are allocatable already: evicting them would only lose hits)
    assert after.cached == before.cached > 0 and after.pool_rate == 0.0 and after.external == 0.0
    assert after.owned == before.owned and after.used_slots == before.used_slots
    assert sorted({b for s in live for b in s.kv.block_table}) == list(range(after.owned))  # shared heads once
    assert check_engine(eng) == []
    for s, kv in zip(live, kv_before):
        for (k0, v0), (k1, v1) in zip(kv, _session_kv(eng, s)):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    for s, t in zip(live, twin_live):
        r, rt = s.send("And one more thing?", GREEDY), t.send("And one more thing?", GREEDY)
        assert r.token_ids == rt.token_ids and r.cached_tokens == rt.cached_tokens > 0
    # the cached blocks moved with their KV: the unrelated prompts hit them as on the twin, same tokens
    again = [f"an unrelated prompt {k} " * 3 for k in range(3)]
    outs, touts = eng.generate(again, GREEDY), twin.generate(again, GREEDY)
    assert [o.cached_tokens for o in outs] == [o.cached_tokens for o in touts] and outs[0].cached_tokens > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in touts]
    assert check_engine(eng) == []


def test_compaction_can_drop_the_prefix_cache_when_asked(folder):
    eng, live = _fragmented(folder)
    before = eng.kv.pool_stats()
    res = eng.kv.compact(evict_cache=True)
    after = eng.kv.pool_stats()
    assert res["evicted"] == before.cached > 0 and after.cached == 0 and after.pool_rate == 0.0
    assert check_engine(eng) == []


def test_defragment_rejects_an_incomplete_order(folder):
    eng, live = _fragmented(folder)
    order = [b for s in live for b in s.kv.block_table][1:]
    with pytest.raises(ValueError, match="missing"):
        eng.pool.defragment(order)
    assert check_engine(eng) == []  # nothing changed


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _scripted(stats, calls: list, moved: int = 0, on_offload=None):
    """A scripted engine and session manager for the breaker: ``stats()`` -> the PoolStats each check reads;
    compaction and offloads are recorded in ``calls`` ("compact", then ("offload", n) or "offload" without
    ``on_offload``); ``on_offload(n)`` applies an offload of n blocks to the script."""

    class ScriptedKV:  # engine.kv
        def pool_stats(self):
            return stats()

        def compact(self):
            calls.append("compact")
            return {"evicted": 0, "moved": moved}

    class Scripted:
        step_hooks: list = []
        kv = ScriptedKV()

    class ScriptedSessions:
        admission = None

        def offloaded_bytes(self):
            return {"host": 1}

        def lowest_priority_open(self):
            return None, []

        def offload_idle(self, n, tier="host"):
            if on_offload is None:
                calls.append("offload")
            else:
                calls.append(("offload", n))
                on_offload(n)
            return n

    return Scripted(), ScriptedSessions()


def test_tiers_trip_in_order_refuse_sessions_and_close_again(folder):
    eng = make_engine(str(folder), num_kv_blocks=40, block_size=4, validate_every=1, max_num_batched_tokens=64)
    low = sessions_of(eng).open(system="Low priority.")
    high = sessions_of(eng).open(system="High priority.")
    high.priority = 5
    for s in (low, high):
        for k in range(3):
            s.send(f"message {k} for the session, with a few more words to use some blocks", GREEDY)
    clock = Clock()
    br = CircuitBreaker(eng, sessions_of(eng), BreakerConfig(escalate_after_s=1.0, cooldown_s=2.0), clock=clock)
    eng.step_hooks.clear()  # the test drives evaluate() with its own clock
    # long running requests take most of the pool (they are never touched by the breaker)
    seqs = [eng.add_request([100 + i] * 30, SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(4)]
    while eng.pool.usage() < 0.95:
        eng.step()
    st = br.evaluate(force=True)
    assert st.usage >= 0.95 and br.tier == 1 and br.events[-1]["action"] == "compact"
    clock.t = 0.5
    br.evaluate(force=True)
    assert br.tier == 1  # the tier gets escalate_after_s to work
    clock.t = 1.0
    br.evaluate(force=True)
    assert br.tier == 2 and br.events[-1]["tier_name"] == "offload"
    while eng.pool.usage() < 0.95:  # the running requests grow back into what was freed
        eng.step()
    clock.t = 2.0
    br.evaluate(force=True)
    assert br.tier == 3 and br.degraded
    assert [e["tier"] for e in br.events][:3] == [1, 2, 3]
    assert br.trimmed_sessions == {low.id}  # the lowest priority only
    assert low.trim_budget == br.config.degrade_budget_tokens and high.trim_budget is None
    with pytest.raises(OverloadedError) as ei:
        sessions_of(eng).open()
    assert ei.value.retry_after_s == br.config.retry_after_s
    eng.run_until_done(seqs)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 60 for s in seqs)
    for t in (3.0, 4.0, 5.5):
        clock.t = t
        br.evaluate(force=True)
    assert br.tier == 0 and not br.degraded and low.trim_budget is None
    assert br.events[-1]["action"] == "close" and br.trips == 1
    sessions_of(eng).open().close()  # admitted again
    assert check_engine(eng) == []
    snap = br.snapshot()
    assert {(a["tier"], a["action"]) for a in snap["actions"]} >= {("compaction", "compact"), ("degrade", "trim_session")}


def test_budget_trims_oldest_turns_and_keeps_system_and_last():
    msgs = [{"role": "system", "content": "S"}]
    for k in range(4):
        msgs += [{"role": "user", "content": f"u{k}"}, {"role": "assistant", "content": f"a{k}"}]
    msgs.append({"role": "user", "content": "last"})
    head, turns = split_turns(msgs)
    assert head == msgs[:1] and len(turns) == 5
    count = lambda m: 10 * len(m)  # noqa: E731
    kept, dropped = trim_oldest_turns(msgs, count, 50)  # 10 per message: system + two turns (5 messages)
    assert dropped == 3 and kept[0]["content"] == "S" and kept[1]["content"] == "u3" and kept[-1]["content"] == "last"
    kept, dropped = trim_oldest_turns(msgs, count, 0)  # impossible budget: head and last turn stay
    assert kept == [msgs[0], msgs[-1]] and dropped == 4
    assert len(msgs) == 10  # the caller's list is untouched
    with pytest.raises(ValueError):
        trim_oldest_turns(msgs, count, -1)


def test_session_trim_budget_is_a_reversible_view(folder):
    eng = make_engine(str(folder), num_kv_blocks=128, block_size=4, validate_every=1)
    s = sessions_of(eng).open(system="Be brief.")
    for k in range(3):
        s.send(f"question number {k} about something rather long to make the prompt grow", GREEDY)
    full = len(eng.encode_chat(s.messages + [{"role": "user", "content": "next"}]))
    s.trim_budget = full // 2
    r = s.send("next", GREEDY)
    assert s.trimmed_turns >= 1 and r.prompt_tokens <= full // 2
    assert len(s.messages) == 1 + 2 * 4  # nothing was lost
    s.trim_budget = None
    r2 = s.send("and again", GREEDY)
    assert s.trimmed_turns == 0 and r2.prompt_tokens > full
    s.close()
    assert eng.pool.num_used == 0 and check_engine(eng) == []


def test_config_rejects_bad_thresholds():
    with pytest.raises(ValueError, match="usage_threshold"):
        BreakerConfig(usage_threshold=1.5)
    with pytest.raises(ValueError, match="recovery"):
        BreakerConfig(usage_threshold=0.5, recover_usage=0.9)


def test_waiting_turns_holding_session_kv_do_not_starve_the_queue_head(folder):
    """Turns queued together each hold their session's handed-over KV; when the head cannot fit and nothing
    runs, the others' blocks are released (they stay in the prefix cache) instead of rejecting the head."""
    eng = make_engine(str(folder), num_kv_blocks=30, block_size=4, validate_every=1, max_num_batched_tokens=256)
    ss = [sessions_of(eng).open(system=f"S{i}") for i in range(3)]
    for i, s in enumerate(ss):
        s.send(f"first message of session {i} with several words in it to fill blocks", GREEDY)
    seqs = []
    for i, s in enumerate(ss):
        msgs = s.messages + [{"role": "user", "content": f"second message of session {i}, also long enough " * 2}]
        seqs.append(s.begin_turn(messages=msgs, params=GREEDY, request_id=f"t2-{i}"))
    assert all(q.block_table for q in seqs) and eng.pool.num_free < 12
    while any(not q.finished for q in seqs):
        eng.step()  # a finished turn's KV goes back to its session at once
    assert [q.finish_reason for q in seqs] == ["length"] * 3, [q.error for q in seqs]
    for s in ss:
        s.close()
    assert eng.pool.num_used == 0 and check_engine(eng) == []


def test_degraded_breaker_offloads_sessions_that_refill_the_pool_and_closes(folder):
    """Sessions busy during tiers 1-2 pin their KV afterwards: while degraded the breaker repeats the
    offload tier, so the pool drains and the breaker closes instead of refusing sessions for ever."""
    eng = make_engine(str(folder), num_kv_blocks=48, block_size=4, validate_every=1, max_num_batched_tokens=64)
    ss = [sessions_of(eng).open(system=f"S{i}") for i in range(3)]
    clock = Clock()
    br = CircuitBreaker(eng, sessions_of(eng), BreakerConfig(usage_threshold=0.6, recover_usage=0.5, escalate_after_s=1.0,
                                           cooldown_s=2.0), clock=clock)
    eng.step_hooks.clear()
    seqs = []
    for i, s in enumerate(ss):
        seqs.append(s.begin_turn(messages=s.messages + [{"role": "user", "content": f"tell me story {i} " * 6}],
                                 params=SamplingParams(max_tokens=12, ignore_eos=True), request_id=f"turn-{i}"))
    while eng.pool.usage() < 0.6:
        eng.step()
    for t in (0.0, 1.0, 2.0):  # compaction, offload (every session busy: nothing to move), degrade
        clock.t = t
        br.evaluate(force=True)
    assert br.tier == 3
    while any(not q.finished for q in seqs):
        eng.step()
    n_offload = sum(e["action"] == "offload_idle_sessions" for e in br.events)
    clock.t = 3.0
    st = br.evaluate(force=True)
    assert st.usage >= 0.6  # the finished turns pinned their KV again: the degraded breaker moves it out
    assert sum(e["action"] == "offload_idle_sessions" for e in br.events) == n_offload + 1
    assert eng.kv.pool_stats().usage < 0.5 and eng.kv.offloaded_blocks() > 0
    for t in (4.0, 5.0, 6.5):
        clock.t = t
        br.evaluate(force=True)
    assert br.tier == 0 and br.events[-1]["action"] == "close"
    for i, s in enumerate(ss):  # the offloaded sessions continue (their KV comes back from the host tier)
        r = s.send(f"and then {i}?", GREEDY)
        assert r.finish_reason == "length" and r.cached_tokens > 0


def test_degraded_breaker_does_not_stay_stuck_between_recovery_and_trip_levels(folder):
    """Degraded with idle high-priority sessions holding KV between the recovery level and the trip level:
    the breaker must go on relieving the pool (offload idle sessions) and close, not refuse new sessions
    forever."""
    eng = make_engine(str(folder), num_kv_blocks=40, block_size=4, validate_every=1)
    lo, hi1, hi2 = (sessions_of(eng).open(system=f"S{i}") for i in range(3))
    lo.priority, hi1.priority, hi2.priority = -1, 5, 5
    clock = Clock()
    br = CircuitBreaker(eng, sessions_of(eng), BreakerConfig(usage_threshold=0.5, recover_usage=0.3, frag_threshold=1.0,
                                           recover_frag=1.0, escalate_after_s=1.0, cooldown_s=2.0), clock=clock)
    eng.step_hooks.clear()
    k = 0
    while eng.pool.usage() < 0.5:
        for s in (lo, hi1, hi2):
            s.send(f"message {k} with a few words to use blocks", GREEDY)
        k += 1
    br.evaluate(force=True)  # t=0: compaction
    clock.t = 1.0
    br.evaluate(force=True)  # t=1: offload idle sessions
    assert br.tier == 2 and eng.pool.usage() < 0.5
    while eng.pool.usage() < 0.5:  # the sessions come back and fill the pool again
        for s in (lo, hi1, hi2):
            s.send(f"message {k} with a few words to use blocks", GREEDY)
        k += 1
    clock.t = 2.0
    br.evaluate(force=True)  # t=2: degrade; only `lo` is trimmed
    assert br.degraded and br.trimmed_sessions == {lo.id}
    hi2.close()  # a client ends its conversation; hi1 keeps the pool between the levels
    while eng.pool.usage() < 0.3:
        hi1.send(f"message {k} with a few words to use blocks", GREEDY)
        k += 1
    assert 0.3 <= eng.pool.usage() < 0.5, eng.pool.usage()
    for t in range(3, 12):
        clock.t = float(t)
        br.evaluate(force=True)
    assert br.tier == 0, (eng.pool.usage(), br.events[-1])
    sessions_of(eng).open().close()  # admitted again
    r = hi1.send("and one more", GREEDY)  # the offloaded KV comes back
    assert r.cached_tokens > 0
    assert check_engine(eng) == []


def test_tripped_breaker_compacts_again_when_fragmentation_sits_between_its_levels(folder):
    """Tripped (tier 1) and the pool fragmentation rate between recover_frag and frag_threshold while idle:
    it must compact again and close, not stay tripped for good."""
    eng, live = _fragmented(folder)
    rate = eng.kv.pool_stats().pool_rate
    assert rate > 0.1
    clock = Clock()
    br = CircuitBreaker(eng, sessions_of(eng), BreakerConfig(frag_threshold=min(1.0, rate + 0.05), recover_frag=rate - 0.05,
                                           escalate_after_s=1.0, cooldown_s=2.0, frag_min_usage=0.0), clock=clock)
    eng.step_hooks.clear()
    br.tier, br.trips, br._tier_at = 1, 1, 0.0  # tripped earlier; the pool has since settled in the band
    for t in range(1, 8):
        clock.t = float(t)
        br.evaluate(force=True)
    assert br.tier == 0 and eng.kv.pool_stats().pool_rate == 0.0, br.events
    assert all(s.tier == "pool" for s in live)  # tier 1 never offloads
    assert check_engine(eng) == []


def test_fragmentation_alone_recompacts_and_never_escalates():
    """A pool that churn keeps fragmenting at low usage gets compaction again, never offload or refusals
    (a scripted engine: the pool reads fragmented at every check)."""
    from kvkeeper.kvcache.telemetry import PoolStats

    frag = PoolStats(num_blocks=100, block_size=16, free=60, cached=0, owned=40, offloaded=0, owned_slots=640,
                     used_slots=600, largest_free_run=10, largest_owned_run=8, internal=0.06, external=0.8,
                     pool_rate=0.8, usage=0.4)
    calls = []
    clock = Clock()
    idle = CircuitBreaker(*_scripted(lambda: frag, calls, moved=30), BreakerConfig(escalate_after_s=1.0), clock=clock)
    idle.evaluate(force=True)  # usage 0.4, under the default frag_min_usage (0.5): fragmentation does not count
    assert idle.tier == 0 and idle.trips == 0 and calls == []
    br = CircuitBreaker(*_scripted(lambda: frag, calls, moved=30), BreakerConfig(escalate_after_s=1.0,
                                                                                  frag_min_usage=0.3), clock=clock)
    for t in (0.0, 1.0, 2.0, 3.0):
        clock.t = t
        br.evaluate(force=True)
        assert br.tier == 1 and not br.degraded
    assert calls == ["compact"] * 4
    br.check_new_session("new")  # admitted


def test_tier_one_moves_on_to_offload_when_idle_sessions_hold_usage_over_recovery():
    """Tripped at tier 1 with usage between the recovery and trip levels (idle sessions hold it, compaction frees
    nothing): after ``escalate_after_s`` the breaker offloads (tier 2), never degrades, and closes once usage is
    calm (a scripted engine; before, it stayed at tier 1 for as long as the sessions held their KV)."""
    from kvkeeper.kvcache.telemetry import PoolStats

    def stats():
        owned = state["owned"]
        return PoolStats(num_blocks=100, block_size=16, free=100 - owned, cached=0, owned=owned, offloaded=0,
                         owned_slots=owned * 16, used_slots=owned * 16, largest_free_run=100 - owned,
                         largest_owned_run=owned, internal=0.0, external=0.0, pool_rate=0.0, usage=owned / 100)

    state = {"owned": 88}
    calls = []

    def offload(n):
        state["owned"] -= n

    clock = Clock()
    br = CircuitBreaker(*_scripted(stats, calls, on_offload=offload),
                        BreakerConfig(escalate_after_s=1.0, cooldown_s=1.0, recover_usage=0.8), clock=clock)
    br.tier, br.trips, br._tier_at = 1, 1, 0.0  # tripped earlier; usage has since fallen under the trip level
    clock.t = 0.5
    br.evaluate(force=True)
    assert br.tier == 1 and calls == []  # compaction gets its escalate_after_s
    clock.t = 1.0
    br.evaluate(force=True)
    assert br.tier == 2 and calls == [("offload", 88 - 79)] and state["owned"] == 79
    for t in (2.0, 3.0, 4.0):
        clock.t = t
        br.evaluate(force=True)
    assert br.tier == 0 and not br.degraded and [e["action"] for e in br.events][-1] == "close"
