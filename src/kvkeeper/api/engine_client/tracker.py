"""The engine thread's view of HTTP requests: add them, release their sibling choices, publish their output.

A request with ``X-Session-ID`` runs as a turn of that session (``Session.begin_turn``,
the same turn protocol as the library's ``Session.send``): its first choice gets the
session's KV and, when it finishes, the session keeps its blocks and records the turn.
Choices ``1..n-1`` join once the first has computed its prompt, so that they take the
prompt's full blocks from the prefix cache instead of prefilling it ``n`` times.

Everything here runs on the engine thread; outputs reach the request's ``asyncio.Queue``
through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ...engine.sequence import Sequence
from ...errors import InvalidRequestError, ModelNotFoundError
from ...sampling.params import SamplingParams
from ...sessions.session import session_key
from ..common.streams import Accepted, ChoiceDelta, EngineDeadError, GenerationRequest, StepOutput, Usage
from .cache_miss import MissLog
from .metrics import ServerMetrics
from .token_text import TokenText
from ...engine.handle import EngineHandle

log = logging.getLogger(__name__)

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item) -> None:
    """Hand ``item`` to an event loop's queue from the engine thread (dropped when the loop has closed)."""
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # the loop is closed (shutdown)
        pass


@dataclass
class Tracked:
    """A request in flight: its sequences (one per started choice), where its output goes, what was sent."""

    req: GenerationRequest
    seqs: list[Sequence]
    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    emitted: list[list[int]] = field(default_factory=list)  # per choice: [text chars, logprob entries, reported]
    pending: list[SamplingParams] = field(default_factory=list)  # choices 1..n-1 until choice 0 has its prompt's KV
    opened_session: bool = False  # the request opened its session (closed again if its first turn fails)
    prompt_logprobs_sent: bool = False


class RequestTracker:
    """Requests of the HTTP server on one engine (and its sessions, when given).

    max_new_tokens: the operator's cap on tokens per choice (``serve --max-new-tokens``).
    tracer: a :class:`kvkeeper.api.engine_client.tracing.RequestTracer` or None.
    """

    def __init__(self, engine: EngineHandle, sessions=None, metrics: ServerMetrics | None = None, tracer=None,
                 max_new_tokens: int | None = None):
        self.engine = engine
        self.sessions = sessions
        self.metrics = metrics or ServerMetrics()
        self.tracer = tracer
        self.max_new_tokens = max_new_tokens
        self.tracked: dict[str, Tracked] = {}
        self._token_text = TokenText(engine.tokenizer)
        self.misses = MissLog(lambda ids: self.engine.tokenizer.decode(ids))

    # ---- adding --------------------------------------------------------------------------------
    def add(self, req: GenerationRequest, loop, q) -> Accepted:
        """Add the request's first choice; a session opened for it is closed again if it is refused.

        Raises :class:`InvalidRequestError` (bad prompt, id in use), ``ContextLengthError``,
        ``OverloadedError`` (no new sessions now), ``QuotaExceededError`` (the tenant is at a limit) and
        ``SessionBusyError``.
        """
        if req.request_id in self.tracked:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        req = self._under_adapter(req)
        sid = None if req.session_id is None else session_key(req.tenant, req.session_id)
        refresh = getattr(self.sessions, "refresh_from_disk", None) if sid is not None else None
        if refresh is not None:
            refresh(sid)  # a newer checkpoint another server sharing the data dir wrote
        opened = sid is not None and self.sessions is not None and sid not in self.sessions
        try:
            seq, trimmed, report = self._start(req)
        except BaseException:
            if opened and sid in self.sessions:
                self.sessions.close(sid)  # no empty session stays open per refused first request
            raise
        if req.retention is not None:
            self._hold(seq, *req.retention)
        n = len(req.params)
        self.tracked[req.request_id] = Tracked(req, [seq], loop, q, [[0, 0, 0] for _ in range(n)],
                                               pending=list(req.params[1:]), opened_session=opened)
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        echo = None
        if req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else self.engine.tokenizer.decode(prompt)
        if report is not None and req.messages is not None:
            if report.policy == "full":  # the planner renders nothing for it: the prompt as queued
                report.prompt_tokens = len(prompt)
            self.metrics.observe_context(report)
        return Accepted(prompt, trimmed, echo, report.header() if report is not None else None)

    def _hold(self, seq, tokens: int | None, ttl_s: float) -> None:
        """Hold the first ``tokens`` of the sequence's prompt (None: all of it) in the cache for ``ttl_s`` seconds
        (``engine.kv.hold_prefix``: its full blocks, once computed, skip LRU eviction until then)."""
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        self.engine.kv.hold_prefix(seq.namespace, prompt if tokens is None else prompt[:tokens], ttl_s)

    def _under_adapter(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with its namespace under the LoRA adapter it names (``ModelNotFoundError``, a 404, when the
        adapter was unloaded since the handler saw it)."""
        if req.lora is None:
            return req
        try:
            return dataclasses.replace(req, namespace=self.engine.lora_namespace(req.lora, req.namespace))
        except InvalidRequestError as e:
            raise ModelNotFoundError(str(e)) from None

    def _start(self, req: GenerationRequest):
        """Queue choice 0, as a session turn when the request names a session; returns it, the turns trimmed
        and the turn's context report (None outside a session)."""
        kw: dict[str, Any] = dict(request_id=f"{req.request_id}-0", namespace=req.namespace,
                                  compression=req.compression, strict_max_tokens=True,
                                  max_new_tokens=self.max_new_tokens)
        if req.session_id is None:
            if req.session_compression is not None:
                raise InvalidRequestError("a session compression policy applies to a session's KV between turns: send "
                                          "the request with X-Session-ID", param="session_compression")
            if req.context is not None:
                raise InvalidRequestError("a context policy and budget apply to a session's turns (a policy keeps "
                                          "state between them): send the request with X-Session-ID",
                                          param="context_policy")
            prompt = req.prompt_ids if req.prompt_ids is not None else (
                self.engine.encode_chat(req.messages, **req.chat) if req.messages is not None else req.prompt)
            return self.engine.add_request(prompt, req.params[0], **kw), 0, None
        if self.sessions is None:
            raise InvalidRequestError("this server keeps no sessions; send the request without X-Session-ID")
        s = self.sessions.find(req.tenant, req.session_id)
        self.sessions.check_quota(req.tenant, req.quota, opening=s is None)  # 429 beyond the tenant's limits
        if s is None:
            s = self.sessions.open(session_id=req.session_id, tenant=req.tenant)
        if req.session_priority is not None:
            s.priority = req.session_priority
        if req.context is not None:  # what the request leaves out stays as the session has it
            policy, budget = req.context
            s.context = self.sessions.config.context_spec(policy or s.context.policy,
                                                          budget if budget is not None else s.context.budget)
        if req.session_compression is not None:  # likewise: what is left out stays as the session has it
            policy, ratio = req.session_compression
            s.compression = self.sessions.config.compression_spec(policy or s.compression.policy,
                                                                  ratio if ratio is not None else s.compression.ratio)
        seq = s.begin_turn(messages=req.messages, prompt=None if req.messages is not None else req.prompt,
                           params=req.params[0], **req.chat, **kw)
        return seq, s.trimmed_turns, s.last_context if req.messages is not None else None

    def release_siblings(self) -> None:
        """Add the waiting choices of requests whose first choice has computed its prompt."""
        for rid, t in list(self.tracked.items()):
            lead = t.seqs[0]
            if not t.pending or not (lead.finished or lead.num_output_tokens > 0):
                continue
            if lead.finish_reason in ("abort", "error"):
                t.pending = []  # the request ends with its first choice
                continue
            prompt = lead.token_ids[: lead.num_prompt_tokens]
            try:
                for p in t.pending:
                    t.seqs.append(self.engine.add_request(prompt, p, request_id=f"{rid}-{len(t.seqs)}",
                                                          namespace=t.req.namespace, compression=t.req.compression,
                                                          max_new_tokens=self.max_new_tokens))
            except Exception as e:  # a choice that cannot start ends its own request, never the others
                log.exception("choice %d of %s could not start", len(t.seqs), rid)
                self._fail(rid, t, f"choice {len(t.seqs)} could not start: {type(e).__name__}")
                continue
            t.pending = []

    def abort(self, request_id: str) -> None:
        """Abort every sequence of a request (its blocks are freed, or kept by its session)."""
        t = self.tracked.get(request_id)
        if t is not None:
            t.pending = []
            for s in t.seqs:
                self.engine.abort(s.request_id)

    # ---- output ----------------------------------------------------------------------------------
    def publish(self, before_send: Callable[[], None] | None = None) -> None:
        """Push what each tracked request produced since the last call; retire finished requests.

        before_send: called once the requests are retired and before any output is handed over (the
        server publishes its gauges there, so a client reading /metrics after its response sees them).
        """
        now = time.perf_counter()
        sends = []
        for rid in list(self.tracked):
            t = self.tracked[rid]
            deltas = [d for i in range(len(t.seqs)) if (d := self._delta(t, i, now)) is not None]
            finished = not t.pending and all(s.finished for s in t.seqs)
            usage = None
            if finished:
                for i in range(len(t.seqs), len(t.emitted)):  # aborted or failed before the other choices began
                    deltas.append(ChoiceDelta(i, "", [], [], t.seqs[0].finish_reason, t.seqs[0].error))
                usage = self._retire(rid, t)
            if deltas or finished:
                sends.append((t.loop, t.q, StepOutput(deltas, finished, usage)))
        if sends and before_send is not None:
            before_send()
        for loop, q, out in sends:
            put(loop, q, out)

    def _delta(self, t: Tracked, i: int, now: float) -> ChoiceDelta | None:
        seq, em = t.seqs[i], t.emitted[i]
        text, lps = seq.text[em[0]:], seq.logprobs[em[1]:]
        done_now = seq.finished and not em[2]
        new_ids = seq.output_token_ids[em[1]:] if seq.params.logprobs is None else [e["token_id"] for e in lps]
        if not text and not new_ids and not done_now:
            return None
        em[0] += len(text)
        em[1] += len(new_ids)
        d = ChoiceDelta(i, text, new_ids, self._logprob_entries(lps) if seq.params.logprobs is not None else [])
        if seq.prompt_logprobs is not None and not t.prompt_logprobs_sent and (seq.num_output_tokens or done_now):
            t.prompt_logprobs_sent = True
            d.prompt_logprobs = self._prompt_entries(seq)
        if done_now:
            d.finish_reason, d.error, d.stop_string = seq.finish_reason, seq.error, seq.stop_string
            em[2] = 1
            self.metrics.observe_sequence(seq, now)
        return d

    def _retire(self, rid: str, t: Tracked) -> Usage:
        lead = t.seqs[0]
        usage = Usage(lead.num_prompt_tokens, sum(s.num_output_tokens for s in t.seqs), lead.num_cached_tokens or 0)
        usage.cache_miss = self._explain_miss(rid, t, usage.cached_tokens)
        if lead.params.prediction is not None:  # OpenAI's completion_tokens_details of Predicted Outputs (zeros
            # for an empty prediction, as OpenAI reports them)
            usage.accepted_prediction_tokens = sum(s.spec.prediction_accepted for s in t.seqs if s.spec is not None)
            usage.rejected_prediction_tokens = sum(s.spec.prediction_rejected for s in t.seqs if s.spec is not None)
        del self.tracked[rid]
        self.metrics.observe_usage(lead, usage.prompt_tokens, usage.cached_tokens)
        sid = None if t.req.session_id is None else session_key(t.req.tenant, t.req.session_id)
        s = self.sessions.sessions.get(sid) if sid is not None and self.sessions is not None else None
        usage.cache_write_tokens = _cache_written(lead, usage.cached_tokens, s is not None and s.kv is lead and s.reuse)
        if s is not None and s.kv is lead and s.compression.active and s.last_compression is not None:
            usage.session_compression = s.last_compression.to_dict()
        if t.opened_session and lead.finish_reason == "error" and sid in self.sessions \
                and not self.sessions.get(sid).turns:
            self.sessions.close(sid)  # a first turn that failed leaves no empty session behind
        if self.tracer is not None:
            try:
                self.tracer.record(rid, "chat" if t.req.messages is not None else "text_completion", t.seqs, usage,
                                   t.req.session_id, t.req.namespace is not None)
            except Exception:  # tracing must never take a request down
                log.exception("could not record the trace of %s", rid)
        return usage

    def _explain_miss(self, rid: str, t: Tracked, cached: int):
        """Why the request read less than its session's or cache key's predecessor (a
        :class:`~kvkeeper.api.engine_client.cache_miss.CacheMiss`, counted), None when nothing was lost, there was
        no predecessor, the request names neither or failed."""
        req, lead = t.req, t.seqs[0]
        if (req.session_id is None and req.cache_key is None) or lead.finish_reason == "error":
            return None
        name = ("session", req.session_id) if req.session_id is not None else ("cache_key", req.cache_key)
        try:
            miss = self.misses.observe((req.tenant, *name), name, rid, lead.token_ids[: lead.num_prompt_tokens],
                                       lead.output_token_ids, lead.namespace, cached,
                                       self.engine.block_size)
        except Exception:  # an explanation must never take a request down
            log.exception("could not explain the cache read of %s", rid)
            return None
        if miss is not None:
            self.metrics.observe_cache_miss(miss.reason)
        return miss

    def _logprob_entries(self, entries: list[dict], with_ids: bool = False) -> list[dict]:
        """OpenAI logprob entries (token, logprob, bytes, top_logprobs); ``with_ids``: plus token ids and ranks."""
        tt = self._token_text
        out = []
        for e in entries:
            tok, raw = tt(e["token_id"])
            top = []
            for tid, lp in e["top"]:
                s, b = tt(tid)
                top.append({"token": s, "logprob": max(float(lp), _LOGPROB_FLOOR), "bytes": b,
                            **({"token_id": tid} if with_ids else {})})
            out.append({"token": tok, "logprob": max(float(e["logprob"]), _LOGPROB_FLOOR), "bytes": raw,
                        "top_logprobs": top, **({"token_id": e["token_id"], "rank": e["rank"]} if with_ids else {})})
        return out

    def _prompt_entries(self, seq: Sequence) -> list[dict]:
        """The prompt's logprob entries (see :class:`ChoiceDelta`); the first token's logprob is None."""
        first = seq.token_ids[0]
        tok, raw = self._token_text(first)
        head = {"token": tok, "logprob": None, "bytes": raw, "top_logprobs": None, "token_id": first, "rank": None}
        return [head] + self._logprob_entries([e for e in seq.prompt_logprobs[1:] if e is not None], with_ids=True)

    def fail_all(self, e: BaseException) -> None:
        """End every request in flight with :class:`EngineDeadError` (the engine step raised ``e``)."""
        for rid, t in list(self.tracked.items()):
            self._fail(rid, t, f"the engine failed: {type(e).__name__}")

    def _fail(self, rid: str, t: Tracked, message: str) -> None:
        """End one request: abort its sequences and hand its stream :class:`EngineDeadError` (a 500)."""
        for s in t.seqs:
            try:
                self.engine.abort(s.request_id)
            except Exception:  # pragma: no cover
                log.exception("abort failed")
        put(t.loop, t.q, EngineDeadError(message))
        del self.tracked[rid]


def _cache_written(lead: Sequence, cached: int, session_holds: bool) -> int:
    """Prompt tokens whose KV the request computed and left in the cache for later requests (usage's
    ``cache_write_tokens``): with its session holding its KV, every prompt token it computed (the session keeps its
    KV whole, a partial last block included) but those a compression dropped; otherwise the tokens of the full prompt
    blocks it stored first in the prefix cache (``Sequence.num_cache_written``).  At most the tokens it computed."""
    computed = max(0, lead.num_prompt_tokens - cached)
    return max(0, computed - lead.num_kv_dropped) if session_holds else min(lead.num_cache_written, computed)
