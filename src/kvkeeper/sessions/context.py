"""Conversation context policies and turn trimming: what of a long conversation a session's prompt keeps
within a token budget.

A conversation is a head (its leading system / developer messages) and *turns* (a user message and
the messages after it up to the next user message: the reply, tool calls and their results;
:func:`split_turns`).  A policy decides which turns a prompt renders:

* ``full``: every message (no budget);
* ``last``: the head, then as many of the latest turns as fit the budget; the latest turn (it holds
  the latest user message and any unanswered tool call) is always kept, and when the head plus the
  latest turn alone exceed the budget :class:`ContextBudgetError` says both numbers;
* ``summary``: as ``last``, plus a summary of the turns that left, written by the engine itself and
  placed right after the system message (appended to its text, or as a system message of its own);
* ``memory``: as ``last``; turns that leave are stored sentence by sentence in the session's memory
  (:mod:`kvkeeper.sessions.memory`) and, for each new user message, the best stored sentences (embedding
  similarity and BM25 fused by reciprocal rank; a correction ahead of what it corrects) are placed in a
  memory block at the head of the latest user message, one ``[turn N] role: sentence`` line each, in the
  order they were said;
* ``hybrid``: summary plus memory plus the turns that fit, chosen by *semantic pruning*: when the prompt would
  exceed the budget, the middle turns least similar to the latest user message (cosine of their embeddings)
  leave first, ``every`` at a time, never the latest turn nor a turn with an unanswered tool call; those that
  leave are stored in the memory and folded into the summary.

**Keeping the KV reusable.**  The prompt is laid out stable-first: head, summary, kept turns, then the
memory block inside the newest message only.  Turns leave ``every`` turns at a time (at least), and
only when the prompt would exceed the budget; then they leave until the kept turns take at most the low-water
share of the room (``low_water``: 0.6 by default for memory and hybrid, whose turns stay retrievable, 1.0 for
last and summary), so between those moments each turn's prompt extends the
last one and the session reuses all of its KV but the newest message; when turns leave (or the summary
is rewritten), the session's longest-common-prefix rule (:mod:`kvkeeper.sessions.session`) keeps the
KV up to the first changed token.  The memory block sits in the newest message (rather than before the
kept turns) so that retrieving for every message never invalidates the kept turns' KV.

The state that survives between turns (:class:`ContextState`: how many turns left, a digest of them,
the summary) is kept by the session and saved in its manifest; a client that resends a different
history (the digest no longer matches) starts it again from the first turn.

**Trimming under the circuit breaker.**  While the breaker degrades a session (its ``trim_budget``,
:mod:`kvkeeper.sessions.breaker`), :func:`trim_oldest_turns` then drops the oldest turns of the policy's
messages until they fit that budget (:meth:`ContextPlanner.prompt` applies both).  Trimming never edits
the caller's list: it returns a shorter copy, so it is undone by rendering the full list again.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..errors import InvalidRequestError

CONTEXT_POLICIES = ("full", "last", "summary", "memory", "hybrid")
SUMMARY_HEADER = "Summary of the earlier conversation:"
MEMORY_HEADER = "Earlier in this conversation (retrieved from memory):"
MEMORY_FOOTER = "Current message:"
_HEAD_ROLES = ("system", "developer")
# memory / hybrid: when turns must leave, they leave until the kept turns take at most this share of the room, so
# that turns leave less often and more turns in a row extend the last prompt (its KV reused); the turns that left
# stay retrievable.  Chosen from the harder recall set's turn replay (docs/serving/context-policies.md).
MEMORY_LOW_WATER = 0.6


class ContextBudgetError(InvalidRequestError):
    """The head and the latest turn alone need more tokens than the context budget (HTTP 400)."""

    def __init__(self, needed_tokens: int, budget_tokens: int):
        self.needed_tokens = needed_tokens
        self.budget_tokens = budget_tokens
        super().__init__(f"the system message and the latest turn need {needed_tokens} tokens but the context "
                         f"budget is {budget_tokens} tokens; raise the budget (context_budget) or send a shorter "
                         "message", param="context_budget")


@dataclass
class ContextSpec:
    """A session's context policy.

    policy: one of :data:`CONTEXT_POLICIES`.  budget: prompt tokens (None only with ``full``).  every: turns leave
    at least this many at a time (1: exactly as many as must).  summary_tokens: the longest summary
    (tokens).  memory_top_k: stored sentences retrieved (the best of the fused ranking, as many as fit the
    memory block); memory_threshold: the cosine floor (-1..1) below which a sentence is clearly unrelated for the
    embedding ranking (BM25 matches still count); memory_share: the fraction of the budget the memory block
    may take; low_water: when turns must leave, they leave (``every`` at a time) until the kept turns take at
    most this share (0..1] of the room the budget leaves them (None: :attr:`water`'s default).  Raises :class:`InvalidRequestError` (``param`` ``context_policy`` or ``context_budget``).
    """

    policy: str = "full"
    budget: int | None = None
    every: int = 4
    summary_tokens: int = 96
    memory_top_k: int = 8
    memory_threshold: float = 0.25
    memory_share: float = 0.25
    low_water: float | None = None

    def __post_init__(self):
        if self.policy not in CONTEXT_POLICIES:
            raise InvalidRequestError(f"context policy must be one of {', '.join(CONTEXT_POLICIES)}, got {self.policy!r}",
                                      param="context_policy")
        if self.policy != "full" and (self.budget is None or self.budget < 16):
            raise InvalidRequestError(f"context policy {self.policy!r} needs a budget of at least 16 tokens, got "
                                      f"{self.budget}", param="context_budget")
        if self.every < 1 or self.summary_tokens < 1 or self.memory_top_k < 0 or not 0 <= self.memory_share < 1:
            raise InvalidRequestError("context every/summary_tokens must be >= 1, memory_top_k >= 0 and "
                                      "memory_share in [0, 1)", param="context_policy")
        if self.low_water is not None and not 0 < self.low_water <= 1:
            raise InvalidRequestError(f"context low_water must be in (0, 1], got {self.low_water}",
                                      param="context_policy")

    @property
    def water(self) -> float:
        """The low-water mark in effect: ``low_water``, or by default 0.6 for the policies whose turns stay
        retrievable once they leave (memory, hybrid) and 1.0 (just as many as must) for last and summary."""
        if self.low_water is not None:
            return self.low_water
        return MEMORY_LOW_WATER if self.remembers else 1.0

    @property
    def summarizes(self) -> bool:
        return self.policy in ("summary", "hybrid")

    @property
    def remembers(self) -> bool:
        return self.policy in ("memory", "hybrid")


@dataclass
class ContextState:
    """What a session's policy carries from turn to turn: turns ``[0, first_kept)`` have left the prompt
    (``digest``: sha256 of their messages), ``summary`` sums them up, turns ``[0, stored)`` are in memory."""

    first_kept: int = 0
    digest: str = ""
    summary: str = ""
    stored: int = 0
    pruned: list[int] = field(default_factory=list)  # hybrid: middle turns dropped for their low relevance

    def span(self) -> int:
        """Turns ``[0, span)`` the digest covers: those before the first kept one and up to the last pruned one."""
        return max([self.first_kept] + [p + 1 for p in self.pruned])

    def reset(self) -> None:
        self.first_kept, self.digest, self.summary, self.stored, self.pruned = 0, turns_digest([]), "", 0, []

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ContextReport:
    """What one turn's prompt kept (turns), dropped (left the prompt this turn or before), summarized (turns
    the summary covers), retrieved (stored turns placed in the memory block); tokens of the prompt, whether
    text before the kept turns changed this turn (``rewritten``), the memory's time (``memory_ms``: embedding,
    storing, searching) and the time spent writing the summary this turn (``summary_ms``; 0 on the turns that
    rewrite no summary), both in milliseconds of the calling thread (the engine thread in the server)."""

    policy: str
    budget: int | None
    kept: int
    dropped: int
    summarized: int = 0
    retrieved: int = 0
    prompt_tokens: int = 0
    rewritten: bool = False
    memory_ms: float = 0.0
    retrieved_turns: list[int] = field(default_factory=list)
    summary_ms: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def header(self) -> str:
        """The ``X-KVKeeper-Context`` response header: ``policy=last; kept=3; dropped=5; ...``."""
        return (f"policy={self.policy}; budget={self.budget}; kept={self.kept}; dropped={self.dropped}; "
                f"summarized={self.summarized}; retrieved={self.retrieved}; prompt_tokens={self.prompt_tokens}; "
                f"rewritten={int(self.rewritten)}; memory_ms={self.memory_ms:.2f}; summary_ms={self.summary_ms:.2f}")


def turns_digest(turns: list[list[dict]]) -> str:
    """sha256 of the turns' messages (role, content, tool calls) in a canonical JSON form."""
    h = hashlib.sha256()
    for t in turns:
        for m in t:
            h.update(json.dumps([m.get("role"), m.get("content"), m.get("tool_calls"), m.get("tool_call_id")],
                                sort_keys=True).encode())
    return h.hexdigest()


def turn_text(turn: list[dict]) -> str:
    """One turn as plain text, a line per message: ``user: ...``, ``assistant: ...``."""
    return "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in turn)


def pending_call(turn: list[dict]) -> bool:
    """Whether a turn holds a tool call that no tool message of the turn answers."""
    calls = {c.get("id") for m in turn for c in m.get("tool_calls") or []}
    return bool(calls - {m.get("tool_call_id") for m in turn if m.get("role") == "tool"})


def flat(turns: list[list[dict]]) -> list[dict]:
    return [m for t in turns for m in t]


def split_turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(head messages, turns): the leading system/developer messages, then each turn's messages."""
    i = 0
    while i < len(messages) and messages[i].get("role") in _HEAD_ROLES:
        i += 1
    head, turns = list(messages[:i]), []
    for m in messages[i:]:
        if m.get("role") == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return head, turns


def trim_oldest_turns(messages: list[dict], count_tokens: Callable[[list[dict]], int],
                      budget_tokens: int) -> tuple[list[dict], int]:
    """Drop the oldest turns until ``count_tokens(messages) <= budget_tokens`` (tokens).

    Returns (the kept messages, the number of turns dropped).  Keeps the head and the
    last turn even when they alone exceed the budget (the request then runs as it is).
    ``count_tokens`` renders and counts a message list (e.g. ``len(engine.encode_chat(m))``).
    Raises ValueError when ``budget_tokens`` is negative.
    """
    if budget_tokens < 0:
        raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
    head, turns = split_turns(messages)
    dropped = 0
    while len(turns) > 1 and count_tokens(head + flat(turns)) > budget_tokens:
        turns.pop(0)
        dropped += 1
    return head + flat(turns), dropped


def with_summary(head: list[dict], summary: str) -> list[dict]:
    """The head with the summary right after the system message (appended to it, or a system message)."""
    if not summary:
        return list(head)
    block = f"{SUMMARY_HEADER}\n{summary}"
    if head and head[0].get("role") == "system":
        first = head[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{block}"}] + list(head[1:])
    return [{"role": "system", "content": block}] + list(head)


def memory_lines(hits: list[tuple[int, str]]) -> str:
    """The memory block's lines, ``[turn N] role: sentence`` for each (turn index, ``"role: sentence"``) hit."""
    return "\n".join(f"[turn {i}] {text}" for i, text in hits)


def with_memory(turn: list[dict], block: str) -> list[dict]:
    """The latest turn with the memory block at the head of its user message (unchanged without one)."""
    if not block or not turn or turn[0].get("role") != "user":
        return list(turn)
    first = turn[0]
    return [{**first, "content": f"{MEMORY_HEADER}\n{block}\n\n{MEMORY_FOOTER}\n{first.get('content') or ''}"}] \
        + list(turn[1:])


class ContextPlanner:
    """Builds a turn's messages under a :class:`ContextSpec`.

    count: tokens of a rendered message list (e.g. ``len(engine.encode_chat(m))``).  summarize(previous
    summary, turns) -> new summary text (summary policies).  memory: a
    :class:`~kvkeeper.sessions.memory.SessionMemory`-like object with ``add(items, tenant)`` and
    ``search(query, tenant, top_k, threshold) -> [(turn index, text)]`` (memory policies); tenant: the
    key that isolates one tenant's stored turns.
    """

    def __init__(self, spec: ContextSpec, count: Callable[[list[dict]], int],
                 summarize: Callable[[str, list[list[dict]]], str] | None = None, memory=None, tenant: str = ""):
        self.spec = spec
        self.count = count
        self.summarize = summarize
        self.memory = memory
        self.tenant = tenant
        self.memory_s = 0.0  # seconds spent in the memory (embedding, storing, searching) by the last plan
        self.summary_s = 0.0  # seconds spent writing the summary by the last plan

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.memory_s += time.perf_counter() - t0

    def prompt(self, messages: list[dict], state: ContextState,
               trim_budget: int | None = None) -> tuple[list[dict], ContextReport, int]:
        """(the messages to render, the report, turns trimmed): :meth:`plan`, then, when ``trim_budget``
        (tokens; the circuit breaker's) is set, :func:`trim_oldest_turns` to fit it.  Raises
        :class:`ContextBudgetError` (the policy's budget), ValueError (a negative ``trim_budget``)."""
        out, report = self.plan(messages, state)
        if trim_budget is None:
            return out, report, 0
        kept, trimmed = trim_oldest_turns(out, self.count, trim_budget)
        return kept, report, trimmed

    def plan(self, messages: list[dict], state: ContextState) -> tuple[list[dict], ContextReport]:
        """(the messages to render, the report); updates ``state``.  Raises :class:`ContextBudgetError`."""
        sp = self.spec
        head, turns = split_turns(messages)
        if sp.policy == "full" or not turns:
            return list(messages), ContextReport(sp.policy, sp.budget, len(turns), 0)
        if state.span() >= len(turns) or turns_digest(turns[:state.span()]) != state.digest:
            state.reset()
        self.memory_s = self.summary_s = 0.0
        if sp.policy == "hybrid":
            leaving = self._prune(head, turns, state)
        else:
            leaving = list(range(state.first_kept, self._fit(head, turns, state.first_kept)))
        if leaving:
            self._leave(turns, leaving, state)
        block, hits = self._recall(turns[-1]) if sp.remembers and state.stored else ("", [])
        mem_ms = self.memory_s * 1000.0 if sp.remembers else 0.0  # embedding, storing, searching (not summarizing)
        kept = self._window(turns, state)
        out, n, summary, block = self._assemble(head, state.summary, kept, block)
        hits, dropped = (hits if block else []), len(turns) - len(kept)
        return out, ContextReport(sp.policy, sp.budget, len(kept), dropped, dropped if summary else 0, len(hits), n,
                                  bool(leaving), mem_ms, hits, self.summary_s * 1000.0)

    @staticmethod
    def _window(turns: list[list[dict]], state: ContextState) -> list[list[dict]]:
        """The turns the prompt keeps: from the first kept one on, less the pruned ones."""
        gone = set(state.pruned)
        return [t for i, t in enumerate(turns) if i >= state.first_kept and i not in gone]

    def _prune(self, head: list[dict], turns: list[list[dict]], state: ContextState) -> list[int]:
        """Hybrid: the middle turns that leave when the window overflows, least similar to the latest user message
        first (cosine of their embeddings), ``every`` at a time; never the latest turn nor a turn whose tool call is
        unanswered.  Raises :class:`ContextBudgetError` when nothing more may leave and the prompt still overflows."""
        sp, last = self.spec, len(turns) - 1
        avail = sp.budget - self._reserve()
        gone = set(state.pruned)
        if self.count(head + flat(self._window(turns, state))) <= avail:
            return []
        middle = [i for i in range(state.first_kept, last) if i not in gone and not pending_call(turns[i])]
        query = next((m.get("content") or "" for m in turns[-1] if m.get("role") == "user"), "")
        if middle and self.memory is not None and query.strip():
            sims = self._timed(self.memory.similarities, query, [turn_text(turns[i]) for i in middle])
            middle = [i for _, i in sorted(zip(sims, middle))]
        out: list[int] = []
        probe = ContextState(state.first_kept, pruned=list(gone))
        room = avail * sp.water  # turns leave now: on until the rest fits the low-water mark
        while middle and self.count(head + flat(self._window(turns, probe))) > room:
            out += middle[:sp.every]
            middle = middle[sp.every:]
            probe.pruned = list(gone | set(out))
        need = self.count(head + flat(self._window(turns, probe)))
        if need > sp.budget:
            raise ContextBudgetError(need, sp.budget)
        return sorted(out)

    def _reserve(self) -> int:
        """Tokens kept free for the summary and the memory block."""
        sp = self.spec
        r = sp.summary_tokens + 16 if sp.summarizes else 0
        return r + (int(sp.budget * sp.memory_share) if sp.remembers else 0)

    def _fit(self, head: list[dict], turns: list[list[dict]], k: int) -> int:
        """The first turn to keep: ``k`` if the rest fits, else ``k`` moved on ``every`` turns at a time."""
        sp, last = self.spec, len(turns) - 1
        avail = sp.budget - self._reserve()

        def at(j: int) -> int:
            return min(last, k + j * sp.every)

        def least(lo: int, room: float) -> int:  # the tokens fall as j grows: the least j that fits, by bisection
            hi = -(-(last - k) // sp.every)
            while lo < hi:
                mid = (lo + hi) // 2
                if self.count(head + flat(turns[at(mid):])) <= room:
                    hi = mid
                else:
                    lo = mid + 1
            return lo

        j = least(0, avail)
        if j and sp.water < 1:  # turns leave now: on until the rest fits the low-water mark
            j = least(j, avail * sp.water)
        k = at(j)
        if k == last:
            need = self.count(head + flat(turns[last:]))
            if need > sp.budget:
                raise ContextBudgetError(need, sp.budget)
        return k

    def _leave(self, turns: list[list[dict]], leaving: list[int], state: ContextState) -> None:
        """Turns ``leaving`` (indices) leave the prompt: stored in memory, folded into the summary."""
        sp = self.spec
        if sp.remembers and self.memory is not None:
            self._timed(self.memory.add, [(i, turn_text(turns[i])) for i in leaving], self.tenant)
            state.stored += len(leaving)
        if sp.summarizes and self.summarize is not None:
            t0 = time.perf_counter()
            state.summary = self.summarize(state.summary, [turns[i] for i in leaving]).strip()
            self.summary_s += time.perf_counter() - t0
        if sp.policy == "hybrid":
            state.pruned = sorted(set(state.pruned) | set(leaving))
        else:
            state.first_kept = max(leaving) + 1
        state.digest = turns_digest(turns[:state.span()])

    def _recall(self, latest: list[dict]) -> tuple[str, list[int]]:
        """The memory block for the latest user message and the turn indices it holds."""
        sp = self.spec
        query = next((m.get("content") or "" for m in latest if m.get("role") == "user"), "")
        if self.memory is None or not query.strip():
            return "", []
        hits = self._timed(self.memory.search, query, self.tenant, sp.memory_top_k, sp.memory_threshold)
        chosen: list[tuple[int, str]] = []  # best first, while the block fits its share of the budget
        cap = int(sp.budget * sp.memory_share)
        for hit in hits:
            if self.count([{"role": "user", "content": memory_lines(chosen + [hit])}]) > cap:
                break
            chosen.append(hit)
        chosen.sort(key=lambda h: h[0])  # in the order they were said, each line naming its turn
        return memory_lines(chosen), sorted({i for i, _ in chosen})

    def _assemble(self, head, summary, kept, block) -> tuple[list[dict], int, str, str]:
        """Head + summary + kept turns (memory block in the newest); drops the block, then the summary, when
        the whole would exceed the budget.  Returns (messages, tokens, the summary and block used)."""
        for s, b in ((summary, block), (summary, ""), ("", "")):
            out = with_summary(head, s) + flat(kept[:-1]) + with_memory(kept[-1], b)
            n = self.count(out)
            if n <= self.spec.budget:
                break
        return out, n, s, b
