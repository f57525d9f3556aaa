"""Recall of early facts under a context policy: replay long conversations, ask about what was said long ago.

**Data.** A line of a conversations file is ``{"id", "system"?, "messages": [{"role", "content"}, ...],
"questions": [{"after": message index, "question", "answer", "evidence": [message index, ...]}]}``.
:func:`generate` writes such conversations: real Topical-Chat dialogues (Gopalakrishnan et al., 2019;
``data/topical_chat``, CDLA-Sharing-1.0) joined until a conversation holds at least ``min_tokens``
tokens, with facts (a name, a number, a date, a place) planted as user messages in its first
``plant_within`` share, each asked about later (seeded: the same seed gives the same file).

**Replay.**  Each conversation is one session under the policy and budget.  With ``replay="turns"``
(the default) every user message of the history is sent in order, as a client would, with the history
before it as written (assistant messages included) and a one-token reply (the written reply is what the
next turn sends); at each question the history up to ``after`` plus the question is sent and the model
answers greedily.  With ``replay="questions"`` only the questions are sent (faster; its cached share then
says nothing about a live conversation, whose turns come one after another).

**Figures** (each a fraction in 0..1 unless named): ``answer_in_prompt`` (the answer string appears in
the prompt that was built, case-insensitive), ``evidence_in_prompt`` (every evidence message's text
appears in it), ``answer_in_reply`` (the reply contains the answer, case-insensitive),
``mean_prompt_tokens`` (tokens, of the questions' prompts), ``cached_share`` (prompt tokens served from the
KV cache / prompt tokens, over every request sent: history turns and questions), ``cached_share_questions``
(the same over the questions only), ``memory_ms_per_turn`` (milliseconds the memory took per request
sent), ``summary_ms_per_turn`` (milliseconds spent writing summaries per request sent: the engine thread runs
them before the turn's own prefill); ``per_question`` holds each question's prompt, reply and counts and ``per_turn`` each history turn's
counts, so that every figure can be recomputed (:func:`figures`).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from pathlib import Path
from typing import Callable

from ..progress import track
from ..engine.handle import EngineHandle

SYSTEM = "You are a friendly conversation partner. When asked about something said earlier, answer briefly."
NAMES = ["Zanthe", "Orlaith", "Bartholomew", "Ysolde", "Kwabena", "Thaddeus", "Marisol", "Leopold", "Anouk",
         "Ignatius", "Saoirse", "Evander", "Odalys", "Fenwick", "Ingrid", "Casimir", "Rosalind", "Tobiah"]
PLACES = ["Valparaiso", "Tromso", "Ouagadougou", "Hobart", "Cusco", "Tbilisi", "Windhoek", "Reykjavik",
          "Trondheim", "Zanzibar", "Ulaanbaatar", "Antofagasta", "Galway", "Kyoto", "Timbuktu", "Asuncion"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
RELATIONS = ["sister", "cousin", "neighbour", "best friend", "piano teacher", "landlord", "dentist", "uncle"]
THINGS = ["locker", "membership", "parking permit", "library card", "gym badge", "flight"]
EVENTS = ["dentist appointment", "sister's wedding", "job interview", "final exam", "trip to the coast"]


def load_dialogues(path: str | Path) -> list[list[str]]:
    """Topical-Chat dialogues: the texts of each conversation's turns, in order (an even count of them)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            texts = [t["text"] for t in json.loads(line)["turns"]]
            out.append(texts[: len(texts) // 2 * 2])
    return [d for d in out if d]


def _fact(rng: random.Random, kind: str) -> tuple[str, str, str]:
    """(statement, question, answer) of a planted fact of ``kind``: name, number, date or place."""
    if kind == "name":
        rel, name = rng.choice(RELATIONS), rng.choice(NAMES)
        return f"By the way, my {rel}'s name is {name}.", f"What is my {rel}'s name?", name
    if kind == "number":
        thing, num = rng.choice(THINGS), str(rng.randint(1000, 99999))
        return f"Oh, before I forget: my {thing} number is {num}.", f"What is my {thing} number?", num
    if kind == "date":
        ev, day = rng.choice(EVENTS), f"{rng.choice(MONTHS)} {rng.randint(2, 28)}"
        return f"Also, my {ev} is on {day}.", f"On what date is my {ev}?", day
    rel, place = rng.choice(RELATIONS), rng.choice(PLACES)
    return f"Fun fact: my {rel} lives in {place}.", f"In which city does my {rel} live?", place


def generate(dialogues: list[list[str]], n: int, min_tokens: int, count: Callable[[str], int], seed: int = 0,
             facts: int = 3, plant_within: float = 0.15, harder: bool = False) -> list[dict]:
    """``n`` conversations of at least ``min_tokens`` tokens (``count``: tokens of a text, plus 5 per message for
    the chat template), each with ``facts`` planted facts asked about after 60%..100% of the conversation.

    ``harder`` (issue 32): each fact is said in passing at the end of a longer real message (one of them in an
    assistant message), asked with a paraphrase sharing few words with it, one fact corrected later ("Actually,
    ..."; the answer is the new value, the old one is kept as ``corrected``), one with a distractor (the same kind
    of fact about another person); planted within the first 30%, asked at depths spread over the second half
    (``depth``: the question's place as a share of the conversation).  Raises ValueError when a conversation is too
    short to host the facts."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        texts, total = [], 0
        while total < min_tokens:
            for t in rng.choice(dialogues):
                texts.append(t)
                total += count(t) + 5
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
        if harder:
            questions = _plant_harder(rng, msgs, facts, max(plant_within, 0.3))
            out.append({"id": f"memhard-{seed}-{c}", "system": SYSTEM, "messages": msgs, "questions": questions})
            continue
        kinds = rng.sample(["name", "number", "date", "place"], facts)
        slots = sorted(rng.sample(range(0, max(2, int(len(msgs) * plant_within)) // 2), facts))
        planted = []
        for j, (slot, kind) in enumerate(zip(slots, kinds)):
            at = 2 * slot + 2 * j  # a user position; each plant shifts the later ones by two messages
            statement, question, answer = _fact(rng, kind)
            msgs[at:at] = [{"role": "user", "content": statement},
                           {"role": "assistant", "content": "Got it, thanks for telling me."}]
            planted.append((at, question, answer))
        asks = [int(round((len(msgs) - 1) * f)) for f in ([0.6, 0.8, 1.0][-facts:] if facts <= 3 else
                                                          [0.5 + 0.5 * k / (facts - 1) for k in range(facts)])]
        questions = [{"after": a, "question": q, "answer": ans, "evidence": [at]}
                     for a, (at, q, ans) in zip(asks, planted)]
        out.append({"id": f"memconv-{seed}-{c}", "system": SYSTEM, "messages": msgs, "questions": questions})
    return out


# ---- the harder set (issue 32): facts said in passing, paraphrased questions, distractors, corrections ----------
LEVELS = ["P3", "P7", "P11", "B2", "B4", "L5", "G9", "P14"]
LOCKS = ["locker", "bike lock", "garden gate", "safe", "storage unit"]
RESTAURANTS = ["Luigi's", "the Blue Lantern", "Casa Mora", "the Old Mill", "Sakura House", "the Green Fig"]
TIMES = ["7:30 pm", "8:15 pm", "6:45 pm", "9:00 pm", "7:00 am", "6:20 am"]
USER_KINDS = ("parking", "name", "code", "date", "place")
ASSISTANT_KINDS = ("table", "reminder")


def _value(rng: random.Random, kind: str, avoid: str = "") -> str:
    """A fresh answer of ``kind`` (other than ``avoid``)."""
    pools = {"parking": LEVELS, "name": NAMES, "place": PLACES, "table": TIMES, "reminder": TIMES}
    while True:
        if kind == "code":
            v = str(rng.randint(1000, 99999))
        elif kind == "date":
            v = f"{rng.choice(MONTHS)} {rng.randint(2, 28)}"
        else:
            v = rng.choice(pools[kind])
        if v != avoid:
            return v


def _hard_fact(kind: str, subject: str, value: str, who: str = "my") -> tuple[str, str]:
    """(statement said in passing, a paraphrased question sharing few words with it) of a fact of ``kind``
    about ``subject`` (a relation, a lock, an event or a restaurant) of ``who`` ("my", or "my cousin's": a
    distractor's owner)."""
    if kind == "parking":
        return (f"I parked the car on level {value} of the garage." if who == "my" else
                f"{who.capitalize()} car is on level {value} of the garage.",
                "Which floor did I leave my vehicle on?")
    if kind == "name":
        return f"{who.capitalize()} {subject} goes by {value}.", f"How do people call my {subject}?"
    if kind == "code":
        return (f"The code to {who} {subject} is {value}.",
                f"Which digits open my {subject}?")
    if kind == "date":
        return f"{who.capitalize()} {subject} got scheduled for {value}.", f"When is my {subject} happening?"
    if kind == "place":
        return f"{who.capitalize()} {subject} moved to {value} last spring.", f"Where is my {subject} based these days?"
    if kind == "table":
        return (f"I have booked your table at {subject} for {value}.",
                "At what hour is our dinner reservation?")
    return f"Your reminder is set for {value}, as you asked.", "When will you nudge me?"


def _correction(kind: str, subject: str, value: str) -> str:
    """The sentence that corrects a fact of ``kind`` to ``value``."""
    return {"parking": f"Actually, I moved the car to level {value}.",
            "name": f"Actually, my {subject} now goes by {value}.",
            "code": f"Actually, the code to my {subject} changed to {value}.",
            "date": f"Actually, my {subject} is now on {value}.",
            "place": f"Actually, my {subject} now lives in {value}."}[kind]


def _subject(rng: random.Random, kind: str) -> str:
    return {"parking": "car", "name": rng.choice(RELATIONS), "code": rng.choice(LOCKS),
            "date": rng.choice(EVENTS), "place": rng.choice(RELATIONS),
            "table": rng.choice(RESTAURANTS), "reminder": "reminder"}[kind]


def _host(rng: random.Random, msgs: list[dict], role: str, lo: float, hi: float, used: set[int]) -> int:
    """A message of ``role`` in the ``[lo, hi)`` share of the conversation, not yet used, the longest of a few
    drawn (a fact is said at the end of a longer message)."""
    n = len(msgs)
    pool = [i for i in range(int(n * lo), max(int(n * lo) + 1, int(n * hi)))
            if i < n and msgs[i]["role"] == role and i not in used]
    if not pool:
        raise ValueError(f"no free {role} message in the {lo:.0%}..{hi:.0%} share of a conversation of {n} messages;"
                         " raise --min-tokens")
    pick = max(rng.sample(pool, min(4, len(pool))), key=lambda i: len(msgs[i]["content"]))
    used.add(pick)
    return pick


def _plant_harder(rng: random.Random, msgs: list[dict], facts: int, plant_within: float) -> list[dict]:
    """Plants ``facts`` facts in ``msgs`` (in place) the harder way; returns the questions.  The facts: all but
    one in user messages, one in an assistant message; the first user fact corrected later (its question's
    answer is the new value), the second with a distractor (the same kind of fact about someone else)."""
    used: set[int] = set()
    kinds = rng.sample(USER_KINDS, max(1, facts - 1)) + ([rng.choice(ASSISTANT_KINDS)] if facts > 1 else [])
    rng.shuffle(kinds)
    users = [k for k in kinds if k in USER_KINDS]
    plan = []
    for kind in kinds:
        subject, value = _subject(rng, kind), _value(rng, kind)
        role = "user" if kind in USER_KINDS else "assistant"
        at = _host(rng, msgs, role, 0.02, plant_within, used)
        statement, question = _hard_fact(kind, subject, value)
        msgs[at] = {**msgs[at], "content": f"{msgs[at]['content']} {statement}"}
        q = {"question": question, "answer": value, "evidence": [at], "fact": statement, "kind": kind, "role": role}
        if users and kind == users[0] and kind in ("parking", "name", "code", "date", "place"):
            new = _value(rng, kind, avoid=value)
            fix = _host(rng, msgs, "user", plant_within, 0.5, used)
            sent = _correction(kind, subject, new)
            msgs[fix] = {**msgs[fix], "content": f"{msgs[fix]['content']} {sent}"}
            q.update(answer=new, evidence=[fix], fact=sent, corrected=value)
        elif len(users) > 1 and kind == users[1]:
            other = rng.choice([r for r in RELATIONS if r != subject])
            d_at = _host(rng, msgs, "user", 0.02, 0.5, used)
            d_sent, _ = _hard_fact(kind, subject if kind != "parking" else "car", _value(rng, kind, avoid=value),
                                   who=f"my {other}'s")
            msgs[d_at] = {**msgs[d_at], "content": f"{msgs[d_at]['content']} {d_sent}"}
            q["distractor"] = d_sent
        plan.append(q)
    # asked at several depths: spread over the second half of the conversation, each after its evidence
    n = len(msgs)
    depths = [0.55 + 0.45 * k / max(1, len(plan) - 1) for k in range(len(plan))]
    rng.shuffle(depths)
    for q, d in zip(plan, depths):
        after = max(int(round((n - 1) * d)), q["evidence"][0] + 2)
        after = min(n - 1, after + (after % 2 == 0))  # end on an assistant message: the question is the next user turn
        q["after"], q["depth"] = after, round(d, 2)
    return [{k: q[k] for k in ("after", "question", "answer", "evidence", "fact", "kind", "role", "depth")
             if k in q} | {k: q[k] for k in ("corrected", "distractor") if k in q} for q in plan]


def question_messages(conv: dict, q: dict) -> list[dict]:
    """What a question sends: the system message, the history up to ``after`` as written, the question."""
    head = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
    return head + conv["messages"][: q["after"] + 1] + [{"role": "user", "content": q["question"]}]


def figures(conversations: list[dict], per_question: list[dict], per_turn: list[dict] | None = None) -> dict:
    """The figures of a run, from its per-question records (``prompt``, ``reply``, ``prompt_tokens``,
    ``cached_tokens``, ``memory_ms``, ``summary_ms``, ``conversation``, ``question_index``), its per-turn records
    (``prompt_tokens``, ``cached_tokens``, ``memory_ms``, ``summary_ms``) and the conversations."""
    by_id = {c["id"]: c for c in conversations}
    n = len(per_question)
    a_p = e_p = a_r = 0
    for r in per_question:
        conv = by_id[r["conversation"]]
        q = conv["questions"][r["question_index"]]
        prompt, ans = r["prompt"].lower(), q["answer"].lower()
        a_p += ans in prompt
        e_p += (q["fact"].lower() in prompt if q.get("fact") else
                all(conv["messages"][i]["content"].lower() in prompt for i in q["evidence"]))
        a_r += ans in r["reply"].lower()
    sent = per_question + list(per_turn or [])
    qtok = sum(r["prompt_tokens"] for r in per_question)
    stok = sum(r["prompt_tokens"] for r in sent)
    return {"questions": n, "turns": len(per_turn or []), "answer_in_prompt": a_p / n if n else 0.0,
            "evidence_in_prompt": e_p / n if n else 0.0, "answer_in_reply": a_r / n if n else 0.0,
            "mean_prompt_tokens": qtok / n if n else 0.0,
            "cached_share": sum(r["cached_tokens"] for r in sent) / stok if stok else 0.0,
            "cached_share_questions": sum(r["cached_tokens"] for r in per_question) / qtok if qtok else 0.0,
            "memory_ms_per_turn": sum(r["memory_ms"] for r in sent) / len(sent) if sent else 0.0,
            "summary_ms_per_turn": sum(r.get("summary_ms", 0.0) for r in sent) / len(sent) if sent else 0.0}


def history_turns(conv: dict) -> list[int]:
    """Indices of the history's user messages: each is the last message of one request of the replay."""
    return [i for i, m in enumerate(conv["messages"]) if m.get("role") == "user"]


class LibraryBackend:
    """Questions through sessions of an in-process engine (one session per conversation)."""

    def __init__(self, engine: EngineHandle, policy: str, budget: int, max_tokens: int = 16, **context):
        from ..sampling.params import SamplingParams
        from ..sessions.manager import SessionConfig, SessionManager

        self.engine = engine
        self.manager = SessionManager(engine, SessionConfig(context_policy=policy, context_budget=budget, **context))
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.turn_params = SamplingParams(temperature=0.0, max_tokens=1)
        self.sessions: dict[str, object] = {}

    def ask(self, conv_id: str, messages: list[dict], max_tokens: int | None = None) -> dict:
        """One request of conversation ``conv_id``; ``max_tokens`` 1 for a history turn (None: the answer's)."""
        s = self.sessions.get(conv_id)
        if s is None:
            s = self.sessions[conv_id] = self.manager.open()
        seq = s.begin_turn(messages=messages, params=self.turn_params if max_tokens == 1 else self.params)
        self.engine.run_until_done([seq])
        rep = s.last_context
        ids = seq.token_ids[: seq.num_prompt_tokens]
        return {"prompt": self.engine.tokenizer.decode(ids), "reply": seq.text, "prompt_tokens": len(ids),
                "cached_tokens": seq.num_cached_tokens or 0, "memory_ms": rep.memory_ms if rep else 0.0,
                "summary_ms": rep.summary_ms if rep else 0.0,
                "context": rep.to_dict() if rep else None}

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()


class ServerBackend:
    """Questions through a running server: ``X-Session-ID`` per conversation, the policy in the body."""

    def __init__(self, url: str, policy: str, budget: int, max_tokens: int = 16):
        import httpx

        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=600)
        self.policy, self.budget, self.max_tokens = policy, budget, max_tokens
        self.run = uuid.uuid4().hex[:8]
        self.sids: set[str] = set()

    def ask(self, conv_id: str, messages: list[dict], max_tokens: int | None = None) -> dict:
        """One request of conversation ``conv_id`` (``max_tokens`` None: the answer's)."""
        sid = f"eval-{self.run}-{conv_id}"[:128]
        self.sids.add(sid)
        r = self.http.post("/v1/chat/completions", headers={"X-Session-ID": sid}, json={
            "messages": messages, "max_tokens": max_tokens or self.max_tokens, "temperature": 0, "return_token_ids": True,
            "context_policy": self.policy, "context_budget": self.budget})
        r.raise_for_status()
        body = r.json()
        prompt = self.http.post("/detokenize", json={"tokens": body["prompt_token_ids"]}).json()["prompt"]
        rep = dict(kv.split("=", 1) for kv in r.headers.get("x-kvkeeper-context", "").split("; ") if "=" in kv)
        return {"prompt": prompt, "reply": body["choices"][0]["message"]["content"] or "",
                "prompt_tokens": body["usage"]["prompt_tokens"],
                "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                "memory_ms": float(rep.get("memory_ms", 0.0)), "summary_ms": float(rep.get("summary_ms", 0.0)),
                "context": rep or None}

    def close(self) -> None:
        for sid in self.sids:
            self.http.delete(f"/v1/sessions/{sid}")
        self.http.close()


def _replay(conv: dict, backend, replay: str, per: list[dict], turns: list[dict]) -> None:
    """Send one conversation's requests in order: its history turns (``replay="turns"``) and questions."""
    head = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
    points = history_turns(conv) if replay == "turns" else []
    todo = sorted([(i, 0, None) for i in points] + [(q["after"], 1, qi) for qi, q in enumerate(conv["questions"])])
    for at, is_q, qi in todo:
        if is_q:
            q = conv["questions"][qi]
            rec = backend.ask(conv["id"], question_messages(conv, q))
            per.append({"conversation": conv["id"], "question_index": qi, "question": q["question"],
                        "answer": q["answer"], "evidence": q["evidence"], **rec})
        else:
            rec = backend.ask(conv["id"], head + conv["messages"][: at + 1], max_tokens=1)
            turns.append({"conversation": conv["id"], "index": at, "prompt_tokens": rec["prompt_tokens"],
                          "cached_tokens": rec["cached_tokens"], "memory_ms": rec["memory_ms"],
                          "summary_ms": rec["summary_ms"]})


def run(conversations: list[dict], backend, policy: str, budget: int | None, replay: str = "turns") -> dict:
    """Replay every conversation through ``backend`` (``ask(conv_id, messages, max_tokens=None) -> record``):
    with ``replay="turns"`` each user message of the history in order, and the questions at their places;
    with ``"questions"`` the questions only.  Returns the result object (policy, budget, replay, the
    figures, per_question, per_turn, seconds).  Raises ValueError for another ``replay``."""
    if replay not in ("turns", "questions"):
        raise ValueError(f"replay must be 'turns' or 'questions', got {replay!r}")
    t0 = time.perf_counter()
    per: list[dict] = []
    turns: list[dict] = []
    try:
        for conv in track(conversations, "memory recall (conversations)"):
            _replay(conv, backend, replay, per, turns)
    finally:
        backend.close()
    return {"policy": policy, "budget": budget, "replay": replay, **figures(conversations, per, turns),
            "seconds": round(time.perf_counter() - t0, 1), "per_question": per, "per_turn": turns}
