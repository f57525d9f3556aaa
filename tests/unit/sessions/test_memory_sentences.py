"""Sentence-level session memory (kvkeeper.sessions.memory, issue 32): a fact said in passing at the end of a
long unrelated message is found by a paraphrased question; a corrected fact outranks the original; the prompt's
memory block names each sentence's turn and role.

The store is the real one (apsw + sqlite-vec, all-MiniLM-L6-v2 from its package); the unrelated turns are real
Topical-Chat messages (data/topical_chat, CDLA-Sharing-1.0).  No engine is loaded: these tests stay fast.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.sessions.context import ContextPlanner, ContextSpec, ContextState
from kvkeeper.sessions.memory import Embedder, SessionMemory, split_sentences
from tests.utils import paths

DATA = paths.DATA / "topical_chat" / "test_freq_conversations_first20.jsonl"
PARKED = "I parked the car on level P11 of the garage."
PARKED_Q = "On which level of the garage did I park?"


def topical_texts(limit: int = 4) -> list[str]:
    return [t["text"] for line in DATA.read_text().splitlines()[:limit] for t in json.loads(line)["turns"]]


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture
def memory(embedder):
    m = SessionMemory(None, embedder)
    yield m
    m.close()


def _store_turns(memory: SessionMemory, texts: list[str], tenant: str = "") -> None:
    memory.add([(i, f"{'user' if i % 2 == 0 else 'assistant'}: {t}") for i, t in enumerate(texts)], tenant)


def test_a_fact_said_in_passing_is_found_by_a_paraphrase(memory):
    texts = topical_texts()
    # the fact closes a long, unrelated user message (the example)
    long_msg = max((t for i, t in enumerate(texts) if i % 2 == 0), key=len)
    at = texts.index(long_msg)
    assert len(long_msg.split()) >= 30
    texts[at] = f"{long_msg} {PARKED}"
    _store_turns(memory, texts)
    hits = memory.search(PARKED_Q, "", 3, 0.35)
    assert hits, "nothing retrieved"
    assert any("P11" in text for _, text in hits), hits
    turn, text = next(h for h in hits if "P11" in h[1])
    assert turn == at and "garage" in text
    # a sentence, not the whole message: the rest of the long message stays out
    assert len(text) < len(long_msg)


def test_a_fact_after_an_unpunctuated_message_is_an_entry_of_its_own(memory):
    # chat messages often end without a full stop: the fact said after one is still its own sentence entry
    texts = topical_texts()
    at = max(range(0, len(texts), 2), key=lambda i: len(texts[i]))
    texts[at] = f"{texts[at].rstrip(' .!?')} Your reminder is set for 7:00 am, as you asked."
    _store_turns(memory, texts)
    hits = memory.search("When will you nudge me?", "", 8, 0.25)
    fact = next((text for turn, text in hits if "7:00 am" in text), None)
    assert fact == "user: Your reminder is set for 7:00 am, as you asked.", hits


def test_a_corrected_fact_is_retrieved_ahead_of_the_original(memory):
    texts = topical_texts(2)
    texts[2] = f"{texts[2]} My flight to Lisbon is BA117 on Friday."
    texts[-2] = f"{texts[-2]} Actually, my flight to Lisbon changed to BA2490."
    _store_turns(memory, texts)
    hits = memory.search("Which flight am I taking to Lisbon?", "", 3, 0.35)
    texts_hit = [t for _, t in hits]
    new = next(i for i, t in enumerate(texts_hit) if "BA2490" in t)
    old = next((i for i, t in enumerate(texts_hit) if "BA117" in t), len(texts_hit))
    assert new < old, texts_hit


def test_unrelated_text_retrieves_nothing_and_tenants_stay_apart(memory):
    _store_turns(memory, [f"{topical_texts(1)[0]} {PARKED}"], tenant="a")
    assert memory.search("quantum chromodynamics lattice gauge", "a", 3, 0.35) == []
    assert memory.search(PARKED_Q, "b", 3, 0.0) == []
    assert any("P11" in t for _, t in memory.search(PARKED_Q, "a", 3, 0.35))


def test_the_memory_block_names_each_sentence_turn_and_role(memory):
    texts = topical_texts(2)
    texts[4] = f"{texts[4]} {PARKED}"
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    msgs.append({"role": "user", "content": PARKED_Q})
    count = lambda m: sum(len(x["content"].split()) + 4 for x in m)  # noqa: E731 (words stand in for tokens)
    planner = ContextPlanner(ContextSpec("memory", 300, every=2), count, memory=memory)
    out, rep = planner.plan(msgs, ContextState())
    assert rep.retrieved >= 1 and rep.dropped >= 3
    block = out[-1]["content"]
    assert "[turn 2] user: I parked the car on level P11 of the garage." in block, block


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(["Mr.", "Dr.", "we", "parked", "on", "level", "P11.", "It", "was", "3.5", "km!",
                                 "ok?", "yes", "...", "e.g.", "No.", "5"]), min_size=1, max_size=40))
def test_sentences_keep_every_word_in_order(words):
    text = " ".join(words)
    parts = split_sentences(text)
    assert all(p.strip() for p in parts)
    assert " ".join(parts).split() == text.split()
