"""Context policies (kvkeeper.sessions.context): what a long conversation's prompt keeps within a budget.

The planner is checked with hypothesis over random conversations (real chat template, real tokenizer);
the policies run end to end on the embedded model through sessions (cached tokens: the KV is invalidated
only from the first changed token; a summary's KV is reused on the next turn); the vector memory finds a
fact planted ten thousand tokens back, never another session's or tenant's, survives a restart and goes
with the session.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkeeper import SamplingParams
from kvkeeper.sessions import SessionManager
from kvkeeper.sessions.context import (MEMORY_HEADER, SUMMARY_HEADER, ContextBudgetError, ContextPlanner, ContextSpec,
                                       ContextState, flat, split_turns)
from kvkeeper.sessions.session import common_prefix
from tests.utils import paths

pytestmark = pytest.mark.slow

DATA = paths.DATA / "topical_chat" / "test_freq_conversations_first20.jsonl"
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def topical_messages(limit: int | None = None) -> list[dict]:
    """Topical-Chat conversations (data/topical_chat, CDLA-Sharing-1.0) as user/assistant messages."""
    out = []
    for line in DATA.read_text().splitlines()[:limit]:
        for i, t in enumerate(json.loads(line)["turns"]):
            out.append({"role": "user" if i % 2 == 0 else "assistant", "content": t["text"]})
    return out


# ---- the planner: hypothesis over random conversations ------------------------------------------------

WORDS = st.lists(st.sampled_from("the sea ship red 42 Paris cat runs fast over seven blue hills".split()),
                 min_size=1, max_size=30).map(" ".join)


@st.composite
def conversations(draw):
    """A system message (or none), then turns: a user message, maybe a reply, maybe a tool call and its result."""
    msgs = [{"role": "system", "content": draw(WORDS)}] if draw(st.booleans()) else []
    n_calls = 0
    for t in range(draw(st.integers(1, 12))):
        msgs.append({"role": "user", "content": draw(WORDS)})
        kind = draw(st.sampled_from(["reply", "none", "tool", "tool_pending"]))
        if kind == "tool_pending" and t < 11:
            kind = "reply"
        if kind in ("tool", "tool_pending"):
            n_calls += 1
            cid = f"call_{n_calls}"
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]})
            if kind == "tool":
                msgs.append({"role": "tool", "tool_call_id": cid, "content": draw(WORDS)})
                msgs.append({"role": "assistant", "content": draw(WORDS)})
        elif kind == "reply":
            msgs.append({"role": "assistant", "content": draw(WORDS)})
    return msgs


def _kept_turn_indices(out: list[dict], head: list[dict], turns: list[list[dict]]) -> list[int]:
    """Where each turn of ``out`` (split again) is in the original turns, in order; fails on a partial turn
    (an assistant or tool message without the message it answers would join the turn before it)."""
    idx, j = [], 0
    for t in split_turns(out)[1]:
        while j < len(turns) and turns[j] != t:
            j += 1
        assert j < len(turns), ("not a whole turn of the conversation", t)
        idx.append(j)
        j += 1
    return idx


class _NoMemory:
    """Hybrid without embeddings: oldest middle turns leave first; nothing is stored or retrieved."""

    def add(self, items, tenant):
        return 0

    def search(self, *a):
        return []

    def similarities(self, query, texts):
        return [float(i) for i in range(len(texts))]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations(), budget=st.integers(16, 600), every=st.integers(1, 3),
       policy=st.sampled_from(["last", "last", "hybrid"]))
def test_last_keeps_system_latest_user_and_answered_pairs(engine, conv, budget, every, policy):
    count = lambda m: len(engine.encode_chat(m))  # noqa: E731
    spec = ContextSpec(policy, budget, every=every, summary_tokens=1, memory_share=0.0)
    planner = ContextPlanner(spec, count, lambda prev, turns: "", _NoMemory())
    head, turns = split_turns(conv)
    try:
        out, rep = planner.plan(conv, ContextState())
    except ContextBudgetError as e:
        assert e.needed_tokens == count(head + turns[-1]) > budget == e.budget_tokens
        assert str(budget) in str(e) and str(e.needed_tokens) in str(e)
        return
    engine.render_chat(out)  # the chat template's own rendering raises nothing
    assert count(out) <= budget and rep.prompt_tokens == count(out)
    assert out[:len(head)] == head  # the system message is kept, first
    users = [m for m in conv if m["role"] == "user"]
    if users:
        assert [m for m in out if m["role"] == "user"][-1] == users[-1]
    for i, m in enumerate(out):
        if m["role"] == "tool":
            assert any(c["id"] == m["tool_call_id"] for p in out[:i] for c in p.get("tool_calls") or [])
    idx = _kept_turn_indices(out, head, turns)
    assert idx[-1] == len(turns) - 1 and len(idx) == rep.kept and rep.kept + rep.dropped == len(turns)
    if policy == "last":
        assert out == head + flat(turns[rep.dropped:])
        if every == 1 and rep.dropped:  # as many of the latest turns as fit
            assert count(head + flat(turns[rep.dropped - 1:])) > budget


def test_full_keeps_everything_and_bad_specs_are_refused():
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    out, rep = ContextPlanner(ContextSpec(), lambda m: 10**6).plan(conv, ContextState())
    assert out == conv and rep.dropped == 0
    for kw, param in (({"policy": "recent"}, "context_policy"), ({"policy": "last"}, "context_budget"),
                      ({"policy": "memory", "budget": 8}, "context_budget")):
        with pytest.raises(Exception) as e:
            ContextSpec(**kw)
        assert getattr(e.value, "param", None) == param


@pytest.mark.parametrize("policy, expect", [("memory", {1.0: 1, None: 5, 0.3: 8}), ("hybrid", {1.0: 2, None: 6, 0.3: 8})])
def test_low_water_lets_turns_leave_until_the_rest_fits_the_mark(policy, expect):
    # every message counts 10 tokens: an answered turn 20, the latest user message 10; budget 200, no reserve
    count = lambda m: 10 * len(m)  # noqa: E731
    conv = [m for i in range(10) for m in ({"role": "user", "content": f"u{i}"},
                                           {"role": "assistant", "content": f"a{i}"})]
    conv.append({"role": "user", "content": "u10"})  # 210 tokens: over the budget by one turn
    head, turns = split_turns(conv)
    dropped = {}
    for water in (1.0, None, 0.3):
        spec = ContextSpec(policy, 200, every=1, summary_tokens=1, memory_share=0.0, low_water=water)
        planner = ContextPlanner(spec, count, lambda prev, turns: "", _NoMemory())
        state = ContextState()
        out, rep = planner.plan(conv, state)
        assert count(out) <= spec.water * 200 if spec.water < 1 else count(out) <= 200
        dropped[water] = rep.dropped
        # the next turn extends this prompt: nothing more leaves while the budget holds it
        nxt = conv[:-1] + [conv[-1], {"role": "assistant", "content": "a10"}, {"role": "user", "content": "u11"}]
        out2, rep2 = planner.plan(nxt, state)
        if water != 1.0:
            assert rep2.dropped == rep.dropped and out2[:len(out) - 1] == out[:-1]
    # 1.0: just the turns that must leave (hybrid reserves 17 tokens for its summary: 183 of room, so 2); the
    # default for memory/hybrid (0.6 of the room) and 0.3 leave until the kept turns fit the mark
    assert dropped == expect
    assert ContextSpec("last", 200).water == 1.0 and ContextSpec("summary", 200).water == 1.0
    assert ContextSpec(policy, 200).water == 0.6
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(Exception) as e:
            ContextSpec(policy, 200, low_water=bad)
        assert getattr(e.value, "param", None) == "context_policy" and "low_water" in str(e.value)


# ---- sessions on the embedded model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def manager(engine):
    return SessionManager(engine)


def test_last_reuses_kv_up_to_the_first_changed_token(engine, manager):
    s = manager.open(system="You answer in one short sentence.", context=ContextSpec("last", 170, every=2))
    prev_tokens = None
    rebuilt = steady = 0
    bs = engine.config.block_size
    try:
        for i in range(7):
            r = s.send(f"Tell me one fact about ocean number {i}.", GREEDY)
            rep = r.context
            assert rep["prompt_tokens"] == r.prompt_tokens <= 170
            if prev_tokens is not None:
                # the KV kept is the longest common prefix of what the session held (its last token has no KV)
                # and the new prompt, down to a block boundary when the block it ends in is in the prefix cache
                expect = min(common_prefix(prev_tokens[:-1], r.prompt_token_ids), r.prompt_tokens - 1)
                assert expect - expect % bs <= r.cached_tokens <= expect
                if rep["rewritten"]:
                    rebuilt += 1
                    sys_ids = engine.encode_chat([{"role": "system", "content": "You answer in one short sentence."}],
                                                 add_generation_prompt=False)
                    assert r.cached_tokens >= (len(sys_ids) - 1) // bs * bs  # the system's KV survives a drop
                else:
                    steady += 1
                    assert r.cached_tokens >= len(prev_tokens) - 2  # all of the previous turn's KV is reused
            prev_tokens = r.prompt_token_ids + r.token_ids
        assert rebuilt >= 1 and steady >= 1 and s.turns[-1].context["dropped"] >= 2
    finally:
        s.close()


def test_latest_turn_over_the_budget_is_refused_with_both_numbers(manager):
    s = manager.open(system="Be brief.", context=ContextSpec("last", 24))
    try:
        with pytest.raises(ContextBudgetError) as e:
            s.send("word " * 60, GREEDY)
        assert e.value.budget_tokens == 24 and e.value.needed_tokens > 60
        assert "24" in str(e.value) and str(e.value.needed_tokens) in str(e.value)
        assert not s.turns and s.messages == [{"role": "system", "content": "Be brief."}]
    finally:
        s.close()


def test_summary_sits_after_the_system_message_and_its_kv_is_reused(engine, manager):
    system = "You are a helpful assistant."
    s = manager.open(system=system, context=ContextSpec("summary", 260, every=2, summary_tokens=24))
    try:
        r = None
        for i in range(12):
            r = s.send(f"Remember this: item {i} is a {['red', 'blue', 'green'][i % 3]} box in room {i + 10}.", GREEDY)
            if r.context["summarized"]:
                break
        assert r.context["summarized"] >= 2 and r.context["rewritten"]
        assert r.context["summary_ms"] > 0  # the summary written this turn is measured (not a timing bound)
        summary = s.context_state.summary
        assert summary
        text = engine.tokenizer.decode(r.prompt_token_ids)
        assert text.index(system) < text.index(SUMMARY_HEADER) < text.index("item")
        head = engine.encode_chat([{"role": "system", "content": f"{system}\n\n{SUMMARY_HEADER}\n{summary}"}],
                                  add_generation_prompt=False)
        nxt = s.send("And what is in room 99?", GREEDY)
        assert not nxt.context["rewritten"] and s.context_state.summary == summary and nxt.context["summary_ms"] == 0
        # system plus summary served from the KV of the summary turn (down to a block boundary)
        assert nxt.cached_tokens >= (len(head) - 1) // engine.config.block_size * engine.config.block_size
        assert nxt.prompt_token_ids[:len(head) - 1] == head[:len(head) - 1]
    finally:
        s.close()


# ---- vector memory ---------------------------------------------------------------------------------------

FACT = "By the way, my sister Zanthe Okonkwo was born on 14 March 1987 in Valparaiso."
QUESTION = "Where was my sister Zanthe born?"


def planted_conversation() -> list[dict]:
    return [{"role": "system", "content": "You are a friendly conversation partner."},
            {"role": "user", "content": FACT}, {"role": "assistant", "content": "What a lovely place to be born!"},
            *topical_messages(), {"role": "user", "content": QUESTION}]


def test_memory_retrieves_a_fact_ten_thousand_tokens_back(engine, tmp_path):
    conv = planted_conversation()
    assert len(engine.encode_chat(conv[:-1])) >= 10_000
    m = SessionManager(engine, data_dir=str(tmp_path))
    s = m.open(context=ContextSpec("memory", 1024))
    other = m.open(context=ContextSpec("memory", 1024))
    try:
        seq = s.begin_turn(messages=conv, params=GREEDY)
        engine.run_until_done([seq])
        rep = s.turns[-1].context
        prompt = engine.tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens])
        assert rep["retrieved"] >= 1 and rep["dropped"] > 150 and seq.num_prompt_tokens <= 1024
        assert MEMORY_HEADER in prompt and "Zanthe Okonkwo" in prompt and "Valparaiso" in prompt
        # another session (same tenant) and another tenant of the same session retrieve nothing of it
        seq = other.begin_turn(messages=[{"role": "user", "content": QUESTION}], params=GREEDY)
        engine.run_until_done([seq])
        assert "Valparaiso" not in engine.tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens])
        mem = m.memory_of(s)
        assert mem.search(QUESTION, m.tenant_of(None), 3, 0.0)
        assert mem.search(QUESTION, m.tenant_of(engine.isolated_namespace("t2")), 3, -1.0) == []
        path = m.memory_path(s.id)
        assert path.is_file()
        assert m.save_all() >= 1
        m2 = SessionManager(engine, data_dir=str(tmp_path))  # a restart: the saved session comes back
        s2 = m2.get(s.id)
        assert s2.context.policy == "memory" and s2.context_state.stored == s.context_state.stored
        hits = m2.memory_of(s2).search(QUESTION, m2.tenant_of(None), 3, 0.35)
        assert any("Valparaiso" in text for _, text in hits)
        m2.close(s2.id)
        assert not path.exists()
    finally:
        for sess in (s, other):
            if not sess.closed:
                sess.close()


def test_memory_threshold_retrieves_nothing_unrelated(engine):
    m = SessionManager(engine)
    s = m.open()
    try:
        mem = m.memory_of(s)
        mem.add([(0, "user: my favourite dish is mushroom risotto")], "")
        assert mem.search("quantum chromodynamics lattice", "", 3, 0.5) == []
        assert mem.search("what food do I like best?", "", 3, 0.2)
        # a conversation may repeat a turn word for word, even among the turns leaving at once: stored once
        assert mem.add([(1, "user: ok"), (2, "assistant: sure"), (3, "user: ok")], "") == 2
        assert mem.add([(4, "user: ok")], "") == 0 and mem.count("") == 3
    finally:
        s.close()


def test_hybrid_prunes_the_least_relevant_middle_turns(engine, manager):
    conv = planted_conversation()[:3] + topical_messages(2) + [{"role": "user", "content": QUESTION}]
    s = manager.open(context=ContextSpec("hybrid", 500, every=2, summary_tokens=16))
    try:
        seq = s.begin_turn(messages=conv, params=GREEDY)
        engine.run_until_done([seq])
        rep, st = s.turns[-1].context, s.context_state
        prompt = engine.tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens])
        assert rep["dropped"] >= 10 and rep["summarized"] == rep["dropped"] and seq.num_prompt_tokens <= 500
        assert st.first_kept == 0 and len(st.pruned) == rep["dropped"] and st.summary
        # the fact's turn is the most similar to the question: later, less relevant turns left before it
        assert 0 not in st.pruned and max(st.pruned) > 5 and "Valparaiso" in prompt
        assert prompt.index(SUMMARY_HEADER) < prompt.index("Valparaiso")
    finally:
        s.close()
