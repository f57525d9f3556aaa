"""Sessions: one conversation whose KV stays in the pool between turns, and the one turn protocol.

Both doors run a turn the same way: the library's :meth:`Session.send` and the HTTP
server (a client resending its history with ``X-Session-ID``) call :meth:`Session.begin_turn`
with the conversation so far and get a queued :class:`~kvkeeper.engine.sequence.Sequence`;
when the engine finishes it, the session's end of turn takes its blocks over.

**The reuse rule** (one for both doors).  The conversation is rendered with the chat template
(under the session's context budget, :mod:`kvkeeper.sessions.context`).  When the rendered text
extends the text the session's KV covers (the previous prompt plus the model's own reply,
special tokens included), the prompt is the session's own token ids followed by the tokens of
the new text only: the generated tokens are reused even when the reply, resent as text, would
tokenize differently (the llama.cpp server does the same with its slot cache).  Otherwise the
prompt is the template's own tokenization and the longest common token prefix is reused.  A raw
text prompt follows the same rule on its text; token-id prompts keep the longest common prefix.

**Where a turn's state lives.**  Between turns the session pins its KV in ``Session.kv`` (the
finished sequence of its last turn: token ids, block table); while a turn runs, that KV has
been handed to the turn's sequence (``Session.turn``) and nothing else holds it; an idle
session's KV may instead sit in an offload tier (:mod:`kvkeeper.sessions.offload`), from which
the next turn restores it.

**Session compression** (:mod:`kvkeeper.sessions.compress`).  With a compression policy the KV is compressed at the
end of each turn and kept; the next turn appends after it when its prompt extends the previous turn's full token
history, and recomputes the whole prompt when the history was edited.  Under memory pressure an idle session may be unpinned: its full
blocks stay in the prefix cache and are usually found again on the next turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine.outputs import TurnResult
from ..sampling.params import SamplingParams
from ..engine.sequence import Sequence
from ..errors import InvalidRequestError, KVKeeperError, SessionBusyError
from .compress import CompressionReport, SessionCompression, compress_session_kv
from .context import ContextPlanner, ContextReport, ContextSpec, ContextState


def session_key(tenant: str | None, session_id: str) -> str:
    """The manager's key of a tenant's session: the client's id alone for no tenant (None), else
    ``"<tenant>/<id>"``.  Tenant names have no "/" (:mod:`kvkeeper.api.common.auth` checks them) and neither have
    HTTP session ids, so the same id opened by two tenants is two sessions, and one tenant never names
    another's."""
    return session_id if tenant is None else f"{tenant}/{session_id}"


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Turn:
    """A turn in flight: its sequence (``seq.num_handed_over``: tokens of KV the session gave it), the
    text its prompt renders (None for token ids), the conversation it answers (None for a raw prompt)
    and whether the reply continues the conversation's last message (``continue_final_message``)."""

    seq: Sequence
    prompt_text: str | None
    messages: list[dict] | None
    continues: bool = False
    context: ContextReport | None = None


def _with_reply(messages: list[dict], reply: str, continues: bool) -> list[dict]:
    """The conversation after a reply: a new assistant message, or the last message continued by it."""
    if continues and messages:
        last = messages[-1]
        return messages[:-1] + [{**last, "content": (last.get("content") or "") + reply}]
    return messages + [{"role": "assistant", "content": reply}]


class Session:
    """A multi-turn conversation on an engine, opened by :meth:`SessionManager.open`.

    reuse=False makes every turn recompute the whole conversation (a baseline for tests and benchmarks): from the
    same prompt ids the reuse rule gives (the session's own ids plus the new text's), in a namespace of its own, so
    that reuse on and off differ only in where the KV comes from.
    ``tenant``: the tenant owning it (None: no tenant); ``name``: its id as the tenant's client knows it
    (``id`` is the manager's key, :func:`session_key`).
    Attributes: ``messages`` (the conversation), ``turns`` (a :class:`TurnResult` per finished turn),
    ``kv`` (the pinned KV between turns), ``text`` (the text that KV covers), ``turn`` (the turn in
    flight), ``priority`` (the circuit breaker trims the lowest first), ``trim_budget`` (tokens:
    render without the oldest turns to fit; set while the breaker is degraded).
    """

    def __init__(self, manager, session_id: str, system: str | None = None, reuse: bool = True,
                 params: SamplingParams | None = None, context: ContextSpec | None = None,
                 tenant: str | None = None, name: str | None = None,
                 compression: SessionCompression | None = None):
        self.manager = manager
        self.engine = manager.engine
        self.id = session_id  # the manager's key: the tenant's name and the client's id (see session_key)
        self.tenant = tenant  # the owning tenant (an API key's); None on a server without keys and in the library
        self.name = name if name is not None else session_id  # the id its client knows
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        self.reuse = reuse
        self.params = params or SamplingParams()
        self.priority = 0
        self.trim_budget: int | None = None
        self.trimmed_turns = 0  # turns left out of the last prompt by trim_budget
        self.turns: list[TurnResult] = []
        self.last_used = time.monotonic()
        self.closed = False
        self.kv: Sequence | None = None
        self.kv_source = "session"  # where self.kv came from: session (its own turn), fork, import (see _hand_over)
        self.text = ""
        self.turn: Turn | None = None
        self.context = context or ContextSpec()  # the context policy (kvkeeper.sessions.context)
        self.context_state = ContextState()
        self.last_context: ContextReport | None = None  # what the last prompt kept, dropped, retrieved
        self.compression = compression or SessionCompression()  # kvkeeper.sessions.compress
        self.last_compression: CompressionReport | None = None  # what the last turn's end kept per layer

    # ---- bookkeeping -----------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.kv.token_ids) if self.kv else 0

    @property
    def num_blocks(self) -> int:
        return len(self.kv.block_table) if self.kv else 0

    @property
    def tier(self) -> str:
        """Where the session's KV is: "pool", "host" or "disk" (see :mod:`kvkeeper.sessions.offload`)."""
        return self.manager.store.tier_of(self.id) or "pool"

    @property
    def idle(self) -> bool:
        """Open, no turn in flight, and pinning KV in the pool (so it may be offloaded; compressed KV included)."""
        st = self.kv
        return not self.closed and self.turn is None and st is not None and bool(st.block_table)

    @property
    def kv_entries(self) -> int:
        """KV entries per layer and KV head the session holds (its tokens with KV, less those compression dropped)."""
        st = self.kv
        return 0 if st is None else max(0, st.num_computed - st.kv_offset)

    def info(self) -> dict:
        out = {"id": self.name, "turns": len(self.turns), "tokens": self.num_tokens, "blocks": self.num_blocks,
               "messages": len(self.messages), "tier": self.tier}
        if self.compression.active:
            out["compression"] = {**self.compression.to_dict(), "kv_entries": self.kv_entries,
                                  "last": self.last_compression.to_dict() if self.last_compression else None}
        return out

    def offload(self, tier: str = "host") -> int:
        """Move this idle session's KV out of the pool to ``tier`` ("host" or "disk"); returns blocks released.

        The KV comes back on the next turn.  While a turn runs the KV belongs to it: nothing is moved (0).
        Raises :class:`InvalidRequestError` for a closed session or an unknown or disabled tier, and ``OffloadError`` when the disk write fails (the KV then stays in the pool).
        """
        if self.closed:
            raise InvalidRequestError(f"session {self.id} is closed")
        return self.manager.store.offload(self, tier)

    def unpin(self) -> int:
        """Release the pinned blocks (full ones stay in the prefix cache); returns how many went back to the pool's
        free list (blocks a fork of this session still references stay held)."""
        if self.kv is None or not self.kv.block_table:
            return 0
        return self.engine.kv.free(self.kv)

    def close(self) -> None:
        """Free the session's blocks (and any offloaded copy) and forget it; a turn in flight frees its own.

        Closing a closed session does nothing."""
        if not self.closed:
            self.manager.close(self.id)

    # ---- the turn protocol ----------------------------------------------------------
    def context_messages(self, messages: list[dict], namespace=None, **chat) -> list[dict]:
        """The messages a prompt is rendered from under the session's context policy (:attr:`context`,
        :mod:`kvkeeper.sessions.context`; sets :attr:`last_context`), without the oldest turns while the
        circuit breaker's :attr:`trim_budget` is set (:func:`~kvkeeper.sessions.context.trim_oldest_turns`; sets
        :attr:`trimmed_turns`).  chat: the rendering options (add_generation_prompt, tools...); namespace: the
        turn's cache namespace (summaries run in it; its tenant salt keys the memory).  Raises
        :class:`~kvkeeper.sessions.context.ContextBudgetError` when the latest turn alone exceeds the budget.
        """
        def count(m: list[dict]) -> int:
            return len(self.engine.encode_chat(m, **chat))

        self.trimmed_turns = 0
        ns = namespace or self.engine.namespace
        spec = self.context
        planner = ContextPlanner(spec, count,
                                 lambda prev, turns: self.manager.summarize(prev, turns, ns, spec.summary_tokens),
                                 self.manager.memory_of(self) if spec.remembers else None, self.manager.tenant_of(ns))
        kept, self.last_context, self.trimmed_turns = planner.prompt(messages, self.context_state, self.trim_budget)
        return kept

    def begin_turn(self, messages: list[dict] | None = None, prompt: str | list[int] | None = None,
                   params: SamplingParams | None = None, request_id: str | None = None, *,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   tools: list[dict] | None = None, **request) -> Sequence:
        """Start a turn from the whole conversation (``messages``) or a raw ``prompt`` (text or token ids).

        Derives the prompt ids by the reuse rule, queues the request on the engine (``request``: the
        keyword arguments of ``LLMEngine.add_request``: namespace, compression, strict_max_tokens,
        max_new_tokens) and hands it the session's KV (restored first when offloaded).
        add_generation_prompt, continue_final_message, tools: how the conversation is rendered (see
        ``LLMEngine.render_chat``); a continued last message gets the reply appended to it in the
        session's conversation.  Returns the
        sequence; when it finishes, the session keeps its KV and records the turn.  Raises
        :class:`InvalidRequestError` for a closed session, :class:`SessionBusyError` while a turn is in
        flight, and what ``add_request`` raises (the session is then unchanged).
        """
        if self.closed:
            raise InvalidRequestError(f"session {self.id} is closed")
        if self.turn is not None:
            raise SessionBusyError(f"session {self.id} has a turn in flight ({self.turn.seq.request_id}); "
                                   "send the next turn once it has finished")
        if (messages is None) == (prompt is None):
            raise InvalidRequestError("a turn needs exactly one of messages or prompt")
        text = rendered = None
        if messages is not None:
            chat = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                        tools=tools)
            rendered = self.engine.inputs.render_prompt(self.context_messages(messages, request.get("namespace"), **chat),
                                                 **chat)
            text = rendered.text
        elif isinstance(prompt, str):
            text = prompt
        ids = self._prompt_ids(text, prompt, rendered)
        if not self.reuse:
            request["namespace"] = self.engine.isolated_namespace("noreuse", request.get("namespace"))
        seq = self.engine.add_request(ids, params or self.params, request_id or self._request_id(), **request)
        try:
            seq.num_handed_over = self._hand_over(seq)
            seq.reuse_source = self.kv_source if seq.num_handed_over else None
        except BaseException:
            self.engine.abort(seq.request_id)  # nothing of the turn stays queued (it frees what it was given)
            raise
        seq.kv_holder = self._end_turn
        self.turn = Turn(seq, text, None if messages is None else list(messages), continue_final_message,
                         self.last_context if messages is not None else None)
        return seq

    def _request_id(self) -> str:
        """``<session id>-t<turn>``, with a suffix while a request of that id still runs (a closed namesake's)."""
        rid, k = f"{self.id}-t{len(self.turns) + 1}", 1
        while self.engine.has_request(rid):
            rid, k = f"{self.id}-t{len(self.turns) + 1}.{k}", k + 1
        return rid

    def _prompt_ids(self, text: str | None, prompt, rendered) -> list[int] | str:
        """The reuse rule: the session's own ids plus the new text's, when the text extends the session's.

        rendered: the conversation's :class:`~kvkeeper.text.chat_tokens.RenderedChat` (None for a raw prompt),
        tokenized with control tokens only from the template (``InputProcessor.encode_rendered``)."""
        st, eng = self.kv, self.engine
        if text is None:
            return prompt  # token ids: the hand-over keeps the longest common prefix
        # the same ids with reuse off (only the KV is not handed over): re-tokenizing the history as text could give
        # other ids than the generated ones, and "reuse off" would then compute another prompt
        extends = st is not None and self.text and text.startswith(self.text)
        start = len(self.text) if extends else 0
        if rendered is not None:
            new = eng.inputs.encode_rendered(rendered, start)
        else:
            new = eng.tokenizer.encode(text[start:], add_special_tokens=False) if extends else text
        return list(st.token_ids) + new if extends else new

    def _hand_over(self, seq: Sequence) -> int:
        """Give the session's KV to ``seq`` (not yet scheduled); returns the tokens handed over.

        Keeps the longest common token prefix of the session's tokens and the prompt (at least one
        prompt token is left to compute) and frees the rest.  Compressed KV (a session compression policy) is
        handed over whole when the prompt extends every token it covers, else freed (the prompt is recomputed);
        KV compressed by a request's own ``kv_compression`` (no session policy) is freed.
        KV of another namespace (tenant salt) is freed, never handed over; so is all of it when the request computes its whole
        prompt (``seq.computes_whole_prompt``: a compression policy scoring with the attention of every
        prompt query, h2o or snapkv, or prompt logprobs; as with the prefix cache).  Offloaded KV is restored first (or, when it cannot be, the prompt is
        recomputed; a restored KV's source, :attr:`kv_source`, becomes its tier).
        """
        store, st = self.manager.store, self.kv
        tier = store.tier_of(self.id)
        if tier:
            if self.reuse and st is not None and st.namespace == seq.namespace:
                if store.restore(self):
                    self.kv_source = tier  # the turn's reuse is counted as the tier's (host, disk)
            else:
                store.discard(self.id)
        if st is None or not st.block_table:
            return 0
        if not self.reuse or st.namespace != seq.namespace or seq.computes_whole_prompt:
            self.engine.kv.free(st)
            return 0
        ids = seq.token_ids
        if st.kv_offset:  # compressed: appended to when the prompt extends the whole history, else recomputed
            nc = st.num_computed
            if not self.compression.active or seq.compression is not None or len(ids) <= nc \
                    or ids[:nc] != st.token_ids[:nc]:  # a request's kv_compression: never handed over
                self.engine.kv.free(st)
                return 0
            seq.block_table, seq.block_hashes, seq.num_computed, seq.kv_offset = st.block_table, [], nc, st.kv_offset
            st.block_table, st.block_hashes, st.num_computed, st.kv_offset = [], [], 0, 0
            return nc
        self.engine.kv.truncate(st, min(common_prefix(st.token_ids[: st.num_computed], ids), len(ids) - 1))
        seq.block_table, seq.block_hashes, seq.num_computed = st.block_table, st.block_hashes, st.num_computed
        st.block_table, st.block_hashes, st.num_computed = [], [], 0
        return seq.num_computed

    def _end_turn(self, seq: Sequence) -> None:
        """The engine finished the turn's sequence (the ``kv_holder`` callback): pin its KV and, when it ran to
        its end (stop or length), record the turn and the reply in the conversation.

        A failed turn changes nothing but the KV it was given (recomputed next turn); an aborted one (a
        client went away) keeps its KV for reuse but records nothing: its reply was never delivered.
        """
        turn, self.turn = self.turn, None
        eng = self.engine
        if self.closed or turn is None or turn.seq is not seq or seq.finish_reason == "error":
            eng.kv.free(seq)
            return
        if self.kv is not None and self.kv.block_table:
            eng.kv.free(self.kv)
        report = None
        if self.compression.active and self.reuse and seq.block_table:
            report = self.last_compression = compress_session_kv(eng, seq, self.compression)  # before the
            # session pins it: a reclaim run while room is made never unpins the KV being compressed
        self.kv, self.kv_source = seq, "session"
        self.text = "" if turn.prompt_text is None else (
            turn.prompt_text + eng.tokenizer.decode(seq.output_token_ids, skip_special_tokens=False))
        self.last_used = time.monotonic()
        if not self.reuse:
            eng.kv.free(seq)
        if seq.finish_reason == "abort":
            return
        if turn.messages is not None:
            self.messages = _with_reply(turn.messages, seq.text, turn.continues)
        self.turns.append(TurnResult.from_seq(len(self.turns) + 1, seq,
                                              turn.context.to_dict() if turn.context is not None else None,
                                              report.to_dict() if report is not None else None))

    def send(self, content: str, params: SamplingParams | None = None, role: str = "user") -> TurnResult:
        """Add a message, generate the reply, keep the KV; returns the turn's :class:`TurnResult`.

        Raises :class:`InvalidRequestError` for an empty message or a closed session,
        :class:`ContextLengthError` when the conversation no longer fits the context, and
        :class:`KVKeeperError` when the request fails; the conversation is then as before the call.
        """
        if not isinstance(content, str) or not content.strip():
            raise InvalidRequestError("the message is empty: give some text")
        seq = self.begin_turn(messages=self.messages + [{"role": role, "content": content}], params=params)
        self.engine.run_until_done([seq])
        if seq.finish_reason == "error":
            raise KVKeeperError(seq.error or "request failed")
        return self.turns[-1]
