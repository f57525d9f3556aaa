"""Sessions: one conversation whose KV stays in the pool between turns.

Each turn appends the user's message, renders the chat template over the
whole conversation and turns it into token ids.  When the rendered text
starts with the text the session's KV already covers (the previous prompt plus
the model's reply), the new ids are the old ids followed by the tokens of the
new text only, so turn N prefills just its new tokens (the llama.cpp server
does the same with its slot cache).  Otherwise the session falls back to the
template's own tokenisation and reuses the longest common token prefix.

Between turns the session pins its blocks (holds a reference).  Under memory
pressure the engine may unpin an idle session: its full blocks stay in the
prefix cache and are usually found again on the next turn.  An idle session
may also be offloaded (:meth:`Session.offload`, see :mod:`kvkeeper.sessions.offload`):
its KV moves to host memory or disk and comes back at its next turn.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass

from ..engine.sampling_params import SamplingParams
from ..engine.sequence import Sequence
from ..errors import InvalidRequestError, KVKeeperError


@dataclass
class TurnResult:
    """Stats and output of one turn.  Times in seconds, speed in tokens/s."""

    turn: int
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_tok_per_s: float | None
    finish_reason: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Session:
    """A multi-turn conversation on an :class:`LLMEngine` (created by ``engine.new_session``).

    reuse=False makes every turn recompute the whole conversation (a baseline for tests and benchmarks).
    """

    def __init__(self, engine, system: str | None = None, session_id: str | None = None, reuse: bool = True,
                 params: SamplingParams | None = None):
        self.engine = engine
        self.id = session_id or f"sess-{uuid.uuid4().hex[:12]}"
        if self.id in engine.sessions:
            raise InvalidRequestError(f"session id {self.id!r} is already open")
        self.messages: list[dict] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.reuse = reuse
        self.params = params or SamplingParams()
        self.priority = 0  # higher is more important; the circuit breaker trims the lowest first
        self.trim_budget: int | None = None  # tokens: render without the oldest turns to fit (set while degraded)
        self.trimmed_turns = 0  # turns left out of the last prompt by trim_budget
        self.turns: list[TurnResult] = []
        self.last_used = time.monotonic()
        self.closed = False
        # KV state carried between turns (a detached Sequence holding the blocks)
        self._state: Sequence | None = None
        self._text = ""  # the text whose tokens are in _state.token_ids
        engine.sessions[self.id] = self

    # ---- bookkeeping -----------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._state.token_ids) if self._state else 0

    @property
    def num_blocks(self) -> int:
        return len(self._state.block_table) if self._state else 0

    @property
    def tier(self) -> str:
        """Where the session's KV is: "pool", "host" or "disk" (see :mod:`kvkeeper.sessions.offload`)."""
        store = getattr(self.engine, "offload_store", None)
        return (store.tier_of(self.id) if store is not None else None) or "pool"

    def info(self) -> dict:
        return {"id": self.id, "turns": len(self.turns), "tokens": self.num_tokens, "blocks": self.num_blocks,
                "messages": len(self.messages), "tier": self.tier}

    def offload(self, tier: str = "host") -> int:
        """Move this idle session's KV out of the pool to ``tier`` ("host" or "disk"); returns blocks released.

        The KV comes back on the next turn (:meth:`send` / :meth:`hand_over`).  Raises
        :class:`InvalidRequestError` for a closed session, an unknown or disabled tier or a request
        in flight, and ``OffloadError`` when the disk write fails (the KV then stays in the pool).
        """
        if self.closed:
            raise InvalidRequestError(f"session {self.id} is closed")
        return self.engine.offload_store.offload(self, tier)

    def unpin(self) -> int:
        """Release the pinned blocks (full ones stay in the prefix cache); returns how many were held."""
        if self._state is None or not self._state.block_table:
            return 0
        n = len(self._state.block_table)
        self.engine.kv.free(self._state)
        return n

    def close(self) -> None:
        """Free the session's blocks (and any offloaded copy) and forget it."""
        self.unpin()
        store = getattr(self.engine, "offload_store", None)
        if store is not None:
            store.discard(self.id)
        self._state = None
        self.closed = True
        self.engine.sessions.pop(self.id, None)

    # ---- KV hand-over (also used by the HTTP server, which renders prompts itself) ----------
    def hand_over(self, seq: Sequence) -> int:
        """Give the session's pinned KV to ``seq``, a request just added to the engine and not yet scheduled.

        Keeps the longest common token prefix of the pinned tokens and ``seq``'s
        prompt (at least one prompt token is left to compute) and frees the rest;
        KV computed under another namespace (tenant salt) is freed, never handed
        over.  Marks ``seq`` so the engine leaves its blocks for :meth:`keep`.
        An offloaded session's KV is first restored into the pool (or, when it
        cannot be, recomputed).  Returns the number of tokens handed over.
        """
        eng = self.engine
        seq.keep_blocks = True
        store = getattr(eng, "offload_store", None)
        if store is not None and store.tier_of(self.id):
            st = self._state
            if self.reuse and st is not None and st.namespace == seq.namespace:
                store.restore(self)
            else:
                store.discard(self.id)
        st = self._state
        if st is None or not st.block_table:
            return 0
        if not self.reuse or st.namespace != seq.namespace or st.kv_offset:
            eng.kv.free(st)  # another tenant's KV, or compressed KV: never given to a request expecting the full one
            return 0
        ids = seq.token_ids
        keep = min(_common_prefix(st.token_ids[: st.num_computed], ids), len(ids) - 1)
        eng.kv.truncate(st, keep)
        seq.block_table, seq.block_hashes, seq.num_computed = st.block_table, st.block_hashes, st.num_computed
        st.block_table, st.block_hashes, st.num_computed = [], [], 0
        return seq.num_computed

    def keep(self, seq: Sequence) -> None:
        """Pin a finished request's blocks as the session's state (frees any older pinned state).

        On a closed session the blocks are freed instead.
        """
        eng = self.engine
        eng.detached.pop(id(seq), None)
        if self.closed:
            eng.kv.free(seq)
            return
        if self._state is not None and self._state is not seq and self._state.block_table:
            eng.kv.free(self._state)
        self._state = seq
        self.last_used = time.monotonic()
        from ..engine.llm_engine import RequestOutput

        r = RequestOutput.from_seq(seq)
        self.turns.append(TurnResult(len(self.turns) + 1, r.text, r.token_ids, r.prompt_token_ids, r.prompt_tokens,
                                     r.cached_tokens, r.completion_tokens, r.ttft_s, r.decode_tok_per_s,
                                     r.finish_reason))

    # ---- turns ---------------------------------------------------------------
    def context_messages(self, messages: list[dict] | None = None) -> list[dict]:
        """The messages a prompt is rendered from: all of them, or without the oldest turns while
        :attr:`trim_budget` is set (see :mod:`kvkeeper.sessions.budget`); sets :attr:`trimmed_turns`."""
        messages = self.messages if messages is None else messages
        self.trimmed_turns = 0
        if self.trim_budget is None:
            return messages
        from .budget import trim_oldest_turns

        kept, self.trimmed_turns = trim_oldest_turns(messages, lambda m: len(self.engine.encode_chat(m)),
                                                     self.trim_budget)
        return kept

    def _prompt(self) -> tuple[list[int], str]:
        """(token ids, rendered text) of the next prompt."""
        eng = self.engine
        text = eng.render_chat(self.context_messages(), add_generation_prompt=True)
        st = self._state
        if self.reuse and st is not None and self._text and text.startswith(self._text):
            return list(st.token_ids) + eng.tokenizer.encode(text[len(self._text):], add_special_tokens=False), text
        return eng.tokenizer.encode(text, add_special_tokens=False), text

    def send(self, content: str, params: SamplingParams | None = None, role: str = "user") -> TurnResult:
        """Add a message, generate the reply, keep the KV; returns the turn's :class:`TurnResult`.

        Raises :class:`InvalidRequestError` for an empty message or a closed session and
        :class:`ContextLengthError` when the conversation no longer fits the context
        (the message is then not kept, so the session can go on after trimming).
        """
        if self.closed:
            raise InvalidRequestError(f"session {self.id} is closed")
        if not isinstance(content, str) or not content.strip():
            raise InvalidRequestError("the message is empty: give some text")
        eng = self.engine
        params = params or self.params
        self.messages.append({"role": role, "content": content})
        try:
            ids, prompt_text = self._prompt()
            seq = eng.add_request(ids, params, request_id=f"{self.id}-t{len(self.turns) + 1}")
        except KVKeeperError:
            self.messages.pop()
            raise
        self.hand_over(seq)
        if not self.reuse:
            seq.namespace = eng.isolated_namespace("noreuse")
        eng.run_until_done([seq])
        eng.detached.pop(id(seq), None)
        self._state = seq
        if not self.reuse:
            eng.kv.free(seq)
        reply = seq.text
        self._text = prompt_text + eng.tokenizer.decode(seq.output_token_ids, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": reply})
        self.last_used = time.monotonic()
        from ..engine.llm_engine import RequestOutput

        r = RequestOutput.from_seq(seq)
        res = TurnResult(len(self.turns) + 1, reply, r.token_ids, r.prompt_token_ids, r.prompt_tokens, r.cached_tokens,
                         r.completion_tokens, r.ttft_s, r.decode_tok_per_s, r.finish_reason)
        if seq.finish_reason == "error":
            raise KVKeeperError(seq.error or "request failed")
        self.turns.append(res)
        return res
