"""The engine loop thread: the only thread that touches the :class:`LLMEngine`.

The HTTP handlers run on an asyncio event loop.  They never call the engine (or
its tokenizer, which is not safe to share between threads); they put commands on
a thread-safe queue instead:

* ``submit(GenerationRequest)`` -- the engine thread renders and tokenizes the
  prompt, checks it against the context window, adds one sequence per choice
  (``n``; seeds ``seed, seed+1, ...`` when a seed is given), and answers with a
  :class:`RequestStream`; errors (:class:`KVKeeperError`) are raised to the caller.
* ``abort(request_id)`` -- a client went away: every sequence of the request is
  aborted at once, which frees its blocks.
* ``call(fn)`` -- run ``fn(engine)`` on the engine thread (session listing and deletion).
* ``block_map()`` -- the pool's block map (:mod:`kvkeeper.kvcache.blockmap`), built on the engine thread.

Fragmentation telemetry: the thread records ``engine.pool_stats()`` into a
:class:`~kvkeeper.kvcache.telemetry.FragmentationMonitor` at most every ``frag_interval_s``
(0.1 s; longer when one sample costs more than 2% of it, so the telemetry never takes more
than about 2% of the engine thread), after steps and while idle (every 0.5 s), and publishes
the 1/10/60 s window means and the block states with the metrics snapshot.

While there is work the thread calls ``engine.step()``; after each step it pushes
per-request :class:`StepOutput` objects (text deltas, token ids, logprobs, finish
reasons, and usage once all choices finished) to the request's ``asyncio.Queue``
with ``loop.call_soon_threadsafe``.

Sessions (``X-Session-ID``) reuse :class:`kvkeeper.sessions.session.Session`:
the first choice of a request receives the session's pinned KV
(``Session.hand_over``) and, when finished, its blocks become the new pinned
state (``Session.keep``).  The prompt is always exactly ``engine.encode_chat``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine.sampling_params import SamplingParams
from ..engine.sequence import Sequence
from ..errors import ContextLengthError, InvalidRequestError, KVKeeperError
from ..kvcache.namespace import Namespace
from ..kvcache.telemetry import FragmentationMonitor
from .errors import QueueFullError
from .metrics import ServerMetrics
from .token_text import TokenText

log = logging.getLogger(__name__)

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf


class EngineDeadError(RuntimeError):
    """The engine thread failed or stopped; requests in flight are ended with this error."""


@dataclass
class GenerationRequest:
    """One HTTP request: ``messages`` (chat) or ``prompt`` (text or token ids), ``n`` sampling params."""

    request_id: str
    params: list[SamplingParams]
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    namespace: Namespace | None = None
    session_id: str | None = None
    compression: Any = None  # kvkeeper.kvcache.compression.KVCompression
    session_priority: int | None = None  # X-Session-Priority: higher is trimmed later by the circuit breaker


@dataclass
class ChoiceDelta:
    """What one choice produced since the last :class:`StepOutput`.

    logprobs: entries ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``.
    finish_reason: "stop", "length", "abort" or "error" (then ``error`` says why), None while running.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Usage:
    """Token counts of a whole request (the prompt counted once whatever ``n``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class StepOutput:
    deltas: list[ChoiceDelta]
    finished: bool = False
    usage: Usage | None = None


class RequestStream:
    """The asynchronous output of one accepted request: iterate for :class:`StepOutput` objects."""

    def __init__(self, request_id: str, prompt_tokens: int, q: asyncio.Queue, engine: "AsyncEngine",
                 trimmed_turns: int = 0):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.trimmed_turns = trimmed_turns  # oldest turns left out by the circuit breaker (degraded sessions)
        self.finished = False
        self._q = q
        self._engine = engine

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


@dataclass
class _Tracked:
    req: GenerationRequest
    seqs: list[Sequence]
    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    session: Any = None
    emitted: list[list[int]] = field(default_factory=list)  # per choice: [text chars, logprob entries, reported]
    prompt_ids: list[int] = field(default_factory=list)
    pending: list[SamplingParams] = field(default_factory=list)  # choices 1..n-1 until choice 0 has its prompt's KV


def _put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # the loop is closed (shutdown)
        pass


def _resolve(fut: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncEngine:
    """Owns an :class:`LLMEngine` on a background thread; thread-safe entry points for asyncio code.

    max_queue: requests that may wait (not yet admitted to run) before :meth:`submit`
    raises :class:`QueueFullError` (HTTP 503).
    """

    def __init__(self, engine, max_queue: int = 256, metrics: ServerMetrics | None = None,
                 tracer=None, max_new_tokens: int | None = None):
        """tracer: a :class:`kvkeeper.api.tracing.RequestTracer` (None: no traces).
        max_new_tokens: the most tokens one choice may generate (an operator cap, like llama.cpp's
        ``--n-predict``); larger or omitted ``max_tokens`` are cut to it after the context check.
        """
        self.engine = engine
        self.max_queue = max_queue
        self.tracer = tracer
        self.max_new_tokens = max_new_tokens
        self.metrics = metrics or ServerMetrics()
        self.model_name = engine.model_name
        self.context_length = engine.context_length
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending_adds = 0  # submitted, not yet taken by the engine thread
        self._engine_waiting = 0  # snapshot of the scheduler's waiting queue
        self._tracked: dict[str, _Tracked] = {}
        self._token_text = TokenText(engine.tokenizer)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self.monitor = FragmentationMonitor()  # touched only by the engine thread (and here, before it starts)
        self.frag_interval_s = 0.1
        self._frag_next = 0.0
        self._frag: dict = {}
        self._sample_fragmentation()
        self._publish_stats()

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvkeeper-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the engine thread; then, with a disk tier, save the sessions holding KV (see sessions.offload)."""
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
        store = getattr(self.engine, "offload_store", None)
        if store is not None and store.sessions_dir is not None:
            try:
                n = store.save_all()
            except Exception:  # never let a shutdown fail on this
                log.exception("could not save the sessions")
            else:
                if n:
                    log.warning("saved %d sessions to %s", n, store.sessions_dir)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        return self._pending_adds + self._engine_waiting

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns() % 10**9:09d}"

    # ---- entry points (event loop side) -----------------------------------------------
    async def submit(self, req: GenerationRequest) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises :class:`QueueFullError` when ``max_queue`` requests already wait,
        :class:`KVKeeperError` subclasses for invalid input (bad prompt, context overflow),
        :class:`EngineDeadError` when the engine thread is gone.
        """
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        with self._lock:
            if self.num_waiting >= self.max_queue:
                raise QueueFullError(self.max_queue)
            self._pending_adds += 1
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", req, loop, fut, q))
        try:
            prompt_tokens, trimmed = await fut
        except asyncio.CancelledError:
            self.abort(req.request_id)  # processed after the add: the queue keeps order
            raise
        return RequestStream(req.request_id, prompt_tokens, q, self, trimmed)

    def abort(self, request_id: str) -> None:
        """Abort every sequence of a request (no-op if it already finished); frees its blocks."""
        self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]):
        """Run ``fn(engine)`` on the engine thread and return its result (exceptions propagate)."""
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put(("call", fn, loop, fut))
        return await fut

    async def block_map(self) -> dict:
        """The block map now (:func:`kvkeeper.kvcache.blockmap.engine_block_map`) with the monitor's windows."""
        from ..kvcache.blockmap import engine_block_map

        return await self.call(lambda eng: engine_block_map(eng, self.monitor.windows()))

    # ---- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                self._drain(block=not busy)
                if self.engine.has_unfinished():
                    try:
                        self.engine.step()
                    except Exception as e:  # a bug: end what is in flight, keep serving
                        log.exception("engine step failed")
                        self._fail_all(e)
                    self._release_siblings()
                    self._publish()
                elif getattr(self.engine, "breaker", None) is not None:
                    self.engine.breaker.evaluate()  # idle: let the breaker cool down and close
                self._sample_fragmentation()
                self._publish_stats()
        except BaseException as e:  # pragma: no cover - last resort
            log.exception("engine thread died")
            self.error = e
            self._fail_all(e)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, req, loop, fut, q = cmd
            with self._lock:
                self._pending_adds -= 1
            try:
                n_prompt = self._add(req, loop, q)
            except KVKeeperError as e:
                loop.call_soon_threadsafe(_resolve, fut, None, e)
            except Exception as e:
                log.exception("could not add request %s", req.request_id)
                loop.call_soon_threadsafe(_resolve, fut, None, e)
            else:
                loop.call_soon_threadsafe(_resolve, fut, n_prompt)
        elif kind == "abort":
            t = self._tracked.get(cmd[1])
            if t is not None:
                t.pending = []
                for s in t.seqs:
                    self.engine.abort(s.request_id)
                self._publish()
        elif kind == "call":
            _, fn, loop, fut = cmd
            try:
                res = fn(self.engine)
            except Exception as e:
                loop.call_soon_threadsafe(_resolve, fut, None, e)
            else:
                loop.call_soon_threadsafe(_resolve, fut, res)

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        eng = self.engine
        if req.messages is not None:
            return eng.encode_chat(req.messages)
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise InvalidRequestError("the prompt is empty: give at least one token of text")
            return eng.tokenizer.encode(req.prompt)
        return [int(t) for t in req.prompt or []]

    def _add(self, req: GenerationRequest, loop, q) -> tuple[int, int]:
        """Add the request's first choice; returns (prompt tokens, turns trimmed by the circuit breaker).

        A session opened by this request is closed again when the request is refused (no empty session stays).
        """
        eng = self.engine
        if req.request_id in self._tracked:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        opened = req.session_id is not None and req.session_id not in eng.sessions
        try:
            return self._add_checked(req, loop, q)
        except BaseException:
            if opened and req.session_id in eng.sessions and req.request_id not in self._tracked:
                eng.sessions[req.session_id].close()
            raise

    def _add_checked(self, req: GenerationRequest, loop, q) -> tuple[int, int]:
        eng = self.engine
        session = None
        if req.session_id is not None:
            session = eng.sessions.get(req.session_id)
            if session is None:
                session = eng.new_session(session_id=req.session_id)  # OverloadedError while degraded
            if req.session_priority is not None:
                session.priority = req.session_priority
        trimmed = 0
        if session is not None and session.trim_budget is not None and req.messages is not None:
            req.messages = session.context_messages(req.messages)
            trimmed = session.trimmed_turns
        ids = self._prompt_ids(req)
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        ctx = eng.context_length
        if len(ids) >= ctx:
            raise ContextLengthError(len(ids), ctx)
        max_tokens = req.params[0].max_tokens
        if max_tokens is not None and len(ids) + max_tokens > ctx:
            raise ContextLengthError(len(ids), ctx, max_tokens)
        if self.max_new_tokens is not None:
            cap = self.max_new_tokens
            req.params = [dataclasses.replace(p, max_tokens=min(p.max_tokens or cap, cap)) for p in req.params]
        # Choice 0 runs first; choices 1..n-1 join once its prompt KV is computed, so that they take
        # the prompt's full blocks from the prefix cache instead of prefilling it n times.
        seqs = [eng.add_request(ids, req.params[0], request_id=f"{req.request_id}-0", namespace=req.namespace,
                                compression=req.compression)]
        if session is not None:
            session.hand_over(seqs[0])
        n = len(req.params)
        self._tracked[req.request_id] = _Tracked(req, seqs, loop, q, session, [[0, 0, 0] for _ in range(n)],
                                                 prompt_ids=ids, pending=list(req.params[1:]))
        return len(ids), trimmed

    def _release_siblings(self) -> None:
        """Add the waiting choices of requests whose first choice has computed its prompt."""
        for rid, t in self._tracked.items():
            lead = t.seqs[0]
            if not t.pending or not (lead.finished or lead.num_output_tokens > 0):
                continue
            if lead.finish_reason in ("abort", "error"):
                t.pending = []  # the request ends with its first choice
                continue
            for p in t.pending:
                i = len(t.seqs)
                t.seqs.append(self.engine.add_request(t.prompt_ids, p, request_id=f"{rid}-{i}",
                                                      namespace=t.req.namespace, compression=t.req.compression))
            t.pending = []

    def _logprob_entries(self, entries: list[dict]) -> list[dict]:
        tt = self._token_text
        out = []
        for e in entries:
            tok, raw = tt(e["token_id"])
            top = []
            for tid, lp in e["top"]:
                s, b = tt(tid)
                top.append({"token": s, "logprob": max(float(lp), _LOGPROB_FLOOR), "bytes": b})
            out.append({"token": tok, "logprob": max(float(e["logprob"]), _LOGPROB_FLOOR), "bytes": raw,
                        "top_logprobs": top})
        return out

    def _publish(self) -> None:
        """Push what each tracked request produced since the last call; retire finished requests."""
        now = time.perf_counter()
        for rid in list(self._tracked):
            t = self._tracked[rid]
            deltas = []
            for i, (seq, em) in enumerate(zip(t.seqs, t.emitted)):
                text = seq.text[em[0]:]
                lps = seq.logprobs[em[1]:]
                done_now = seq.finished and not em[2]
                if not text and not lps and not done_now:
                    continue
                em[0] += len(text)
                em[1] += len(lps)
                d = ChoiceDelta(i, text, [e["token_id"] for e in lps] if lps else [], self._logprob_entries(lps)
                                if seq.params.logprobs is not None else [])
                if done_now:
                    d.finish_reason, d.error = seq.finish_reason, seq.error
                    em[2] = 1
                    self.metrics.observe_sequence(seq, now)
                deltas.append(d)
            finished = not t.pending and all(s.finished for s in t.seqs)
            if finished and len(t.seqs) < len(t.emitted):  # aborted or failed before the other choices began
                for i in range(len(t.seqs), len(t.emitted)):
                    deltas.append(ChoiceDelta(i, "", [], [], t.seqs[0].finish_reason, t.seqs[0].error))
            usage = None
            if finished:
                usage = Usage(t.seqs[0].num_prompt_tokens, sum(s.num_output_tokens for s in t.seqs),
                              max(t.seqs[0].num_cached_tokens, 0))
                del self._tracked[rid]
                if t.session is not None:
                    t.session.keep(t.seqs[0])
                if self.tracer is not None:
                    try:
                        self.tracer.record(rid, "chat" if t.req.messages is not None else "text_completion",
                                           t.seqs, usage, t.req.session_id, t.req.namespace is not None)
                    except Exception:  # tracing must never take a request down
                        log.exception("could not record the trace of %s", rid)
            if deltas or finished:
                _put(t.loop, t.q, StepOutput(deltas, finished, usage))

    def _fail_all(self, e: BaseException) -> None:
        for rid, t in list(self._tracked.items()):
            for s in t.seqs:
                try:
                    self.engine.abort(s.request_id)
                except Exception:  # pragma: no cover
                    log.exception("abort failed")
            _put(t.loop, t.q, EngineDeadError(f"the engine failed: {type(e).__name__}"))
            del self._tracked[rid]

    def _publish_stats(self) -> None:
        st = self.engine.stats()
        self._engine_waiting = st["num_waiting"]
        st["num_waiting"] += self._pending_adds
        st["pinned_blocks"] = sum(s.num_blocks for s in self.engine.sessions.values())
        br = getattr(self.engine, "breaker", None)
        if br is not None:
            st["breaker"] = {"tier": br.tier, "trips": br.trips,
                             "actions": [{"tier": t, "action": a, "count": n} for (t, a), n in br.actions.items()]}
        st.update(self._frag)  # fragmentation windows and block states of the latest sample
        self.metrics.update(st)

    def _sample_fragmentation(self) -> None:
        """Record ``engine.pool_stats()`` if ``frag_interval_s`` has passed (engine thread only).

        The interval stretches to 50 times the cost of the last sample (``pool_stats`` is
        O(blocks) Python: about 0.5 ms for 1,456 blocks, 9 ms for 22,528), so sampling takes at
        most ~2% of the thread.
        """
        now = time.monotonic()
        if now < self._frag_next:
            return
        if not hasattr(self.engine, "pool_stats"):  # a stand-in engine (unit tests): no telemetry
            self._frag_next = float("inf")
            return
        try:
            st = self.engine.pool_stats()
        except Exception:  # telemetry must never take the engine down
            log.exception("pool_stats failed")
            self._frag_next = now + 10.0
            return
        self.monitor.record(st, now)
        cost = time.monotonic() - now
        self._frag_next = now + max(self.frag_interval_s, 50.0 * cost)
        self._frag = {"kv_fragmentation": self.monitor.windows(now),
                      "kv_block_states": {"free": st.free, "cached": st.cached, "owned": st.owned,
                                          "offloaded": st.offloaded}}
