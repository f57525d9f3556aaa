"""The engine loop thread: the only thread that touches the :class:`LLMEngine` and its sessions.

The HTTP handlers run on an asyncio event loop.  They never call the engine, nor read it, but for its two
thread-safe parts, used in worker threads: the grammar compiler and the input processor (a prompt is rendered,
tokenized and checked against the context window before its :class:`Add`, so that a prompt of megabytes never
stalls the running streams).  They read the snapshot the engine thread publishes (``served``, a :class:`~kvkeeper.api.common.served.ServedModels`: model name,
LoRA adapters, context window, vocabulary size), and put typed commands on a thread-safe queue:

* :class:`Add` (``submit(GenerationRequest)``) -- the engine thread adds the request
  (:class:`~kvkeeper.api.engine_client.tracker.RequestTracker`: a session turn when it names a session)
  and answers with a :class:`RequestStream`; errors (:class:`KVKeeperError`) are raised to the caller.
* :class:`Abort` (``abort(request_id)``) -- a client went away: every sequence of the request is aborted at once.
* :class:`Call` (``call(fn)``) -- run ``fn(engine)`` on the engine thread (tokenizing, session listing and
  deletion, loading LoRA adapters); the snapshot is published again after it.
* ``block_map()`` -- the pool's block map (:mod:`kvkeeper.kvcache.blockmap`), built on the engine thread.
* :class:`Wake` -- no work: wakes the thread to see that it is asked to stop.

While there is work the thread calls ``engine.step()`` and then publishes each request's new
output; while idle it lets the circuit breaker cool down.  It also refreshes the metrics
snapshot (engine, sessions, audit, breaker) and samples the fragmentation telemetry: at most
every ``frag_interval_s`` (0.1 s; longer when one sample costs more than 2% of it, so the
telemetry never takes more than about 2% of the thread), after steps and while idle (every 0.5 s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ...diagnostics.health import engine_counters
from ...errors import KVKeeperError
from ...kvcache.blockmap import engine_block_map
from ...kvcache.telemetry import FragmentationMonitor
from ..common.errors import QueueFullError
from ..common.served import ServedModels
from ..common.streams import Accepted, EngineDeadError, GenerationRequest, RequestStream
from .metrics import ServerMetrics
from .tracker import RequestTracker

log = logging.getLogger(__name__)

__all__ = ["Abort", "Add", "AsyncEngine", "Call", "Command", "EngineDeadError", "GenerationRequest",
           "RequestStream", "Wake"]

from ..common.errors import DEFAULT_MAX_QUEUE  # noqa: E402  (ServerConfig.max_queue)
from ...engine.handle import EngineHandle  # noqa: E402


PROMPT_WORKERS = 2  # threads rendering and tokenizing prompts (AsyncEngine._off_thread)
PROMPT_NICE = 19  # their scheduling niceness above the process's (Linux: per thread; measured below)


def _prompt_worker() -> None:
    """Start of a prompt worker thread: on Linux, lower its CPU priority by :data:`PROMPT_NICE`, so that on a
    machine with few cores a prompt of megabytes being tokenized takes the cores the engine thread leaves (the
    running streams' decode steps first); elsewhere nothing.  Measured on 2 cores: decode steps with a 0.5 MB prompt
    tokenized in a loop beside them took a median 0.49 s at the same priority, 0.03 s (as alone) at nice 19."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + PROMPT_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the thread keeps the process's priority
        pass


def _resolve(fut: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


@dataclass
class Add:
    """Add ``req``; resolve ``fut`` (on ``loop``) with its :class:`Accepted`, then feed its outputs to ``q``."""

    req: GenerationRequest
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future
    q: asyncio.Queue


@dataclass
class Abort:
    """Abort every sequence of the request ``request_id`` (no-op when it has finished)."""

    request_id: str


@dataclass
class Call:
    """Run ``fn(engine)``; resolve ``fut`` (on ``loop``) with its result or exception."""

    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future


@dataclass
class Wake:
    """Nothing to do: wakes an idle engine thread (to see that it must stop)."""


Command = Add | Abort | Call | Wake


class AsyncEngine:
    """Owns an :class:`LLMEngine` (and its sessions) on a background thread; entry points for asyncio code.

    sessions: the engine's :class:`~kvkeeper.sessions.manager.SessionManager` (None: requests with a
    session id are refused).  breaker: a circuit breaker to evaluate while idle.  auditor: a reuse
    auditor whose counters go to /metrics.  max_queue: requests that may wait (not yet admitted)
    before :meth:`submit` raises :class:`QueueFullError` (HTTP 503).  max_new_tokens: cap on tokens
    per choice.  tracer: a :class:`kvkeeper.api.engine_client.tracing.RequestTracer` (None: no traces).  health: a
    :class:`~kvkeeper.diagnostics.health.HealthMonitor` fed with the telemetry samples (None: none).
    ``served``: the :class:`~kvkeeper.api.common.served.ServedModels` snapshot handlers read (replaced, never changed,
    by the engine thread after each :class:`Call`).
    """

    def __init__(self, engine: EngineHandle, sessions=None, max_queue: int = DEFAULT_MAX_QUEUE, metrics: ServerMetrics | None = None,
                 tracer=None, max_new_tokens: int | None = None, breaker=None, auditor=None, health=None):
        self.engine = engine
        self.sessions = sessions
        self.breaker = breaker
        self.auditor = auditor
        self.health = health
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self.tracker = RequestTracker(engine, sessions, self.metrics, tracer, max_new_tokens)
        self._served_name: str | None = None
        self._grammars = getattr(engine, "grammars", None)  # the compiler (thread-safe), taken before the thread runs
        self._inputs = getattr(engine, "inputs", None)  # the input processor: its rendering and tokenizing are too
        self._prompt_pool: ThreadPoolExecutor | None = None  # the prompt workers, started on the first prompt
        self.served = ServedModels.of(engine)  # replaced (never changed) by the engine thread
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending_adds = 0  # submitted, not yet taken by the engine thread
        self._engine_waiting = 0  # snapshot of the scheduler's waiting queue
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self.monitor = FragmentationMonitor()  # touched only by the engine thread (and here, before it starts)
        self.frag_interval_s = 0.1
        self._frag_next = 0.0
        self._frag: dict = {}
        self._checkpoint_next = 0.0
        self._expire_next = 0.0
        self._sample_fragmentation()
        self._publish_stats()

    # ---- lifecycle --------------------------------------------------------------------
    def serve_as(self, name: str | None) -> None:
        """Serve the model as ``name`` (the ``model`` id clients send; None: the engine's model name).
        Call before :meth:`start`."""
        self._served_name = name
        self.served = ServedModels.of(self.engine, name)

    def start(self) -> None:
        if self._thread is None:
            self._warm_prompt_path()
            self._thread = threading.Thread(target=self._run, name="kvkeeper-engine", daemon=True)
            self._thread.start()

    def _warm_prompt_path(self) -> None:
        """Build the prompt path's one-time parts here, at the process's own priority, not in a prompt worker at
        nice 19 (:data:`PROMPT_NICE`): the chat encoder's tokenizer copies, the chat template and the modules its
        rendering imports, the vocabulary's longest token (:meth:`check_bytes`), about 1.3 s of CPU.  Nothing is
        tokenized here: prompts still are in the workers only.  Niceness is
        machine-wide: beside two busy processes of other programs a nice-19 thread got about 3% of a core, and the
        first request's ``count_tokens`` took 69 s (1.3 s on the idle machine).  A failure is left to the first
        request (which reports it)."""
        inputs = self._inputs
        if inputs is None:
            return
        try:
            inputs.render_prompt([{"role": "user", "content": "hi"}])  # renders, tokenizes nothing
            _ = inputs.chat_encoder, inputs.max_token_bytes
        except Exception:  # noqa: BLE001  (the first request meets it again and answers with it)
            log.debug("warming the prompt path failed", exc_info=True)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the engine thread; then, with a disk tier, save the sessions holding KV (see sessions.offload)."""
        self._stop.set()
        self._inbox.put(Wake())
        if self._prompt_pool is not None:
            self._prompt_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
        if self.sessions is None:
            return
        try:
            n = self.sessions.save_all()
        except Exception:  # never let a shutdown fail on this
            log.exception("could not save the sessions")
        else:
            if n:
                log.warning("saved %d sessions to %s", n, self.sessions.store.sessions_dir)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        return self._pending_adds + self._engine_waiting

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns() % 10**9:09d}"

    # ---- entry points (event loop side) -----------------------------------------------
    async def _compile_grammar(self, req: GenerationRequest) -> None:
        """Compile the request's output grammar in a worker thread, so that the engine thread finds it
        compiled (the compiler keeps it) instead of stalling every running request while it compiles.
        Raises :class:`InvalidRequestError` for a grammar that cannot be used."""
        so = req.params[0].structured if req.params else None
        if self._grammars is not None and so is not None:
            await asyncio.to_thread(self._grammars.matcher, so)

    async def _off_thread(self, fn: Callable[..., Any], *args):
        """``fn(*args)`` in one of the prompt workers (:func:`_prompt_worker`), awaited."""
        if self._prompt_pool is None:
            self._prompt_pool = ThreadPoolExecutor(PROMPT_WORKERS, "kvkeeper-prompt", initializer=_prompt_worker)
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, fn, *args)

    async def _tokenize(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with its prompt rendered, tokenized and checked against the context window in a worker thread
        (``prompt_ids``), so that a prompt of megabytes never stalls the engine thread's running streams; one whose
        byte length alone proves it too long is refused before tokenizing.  A session's turn is rendered by its
        session on the engine thread (its context policy and reuse rule are session state): its latest message
        gets the byte check here.  Raises ``InvalidRequestError`` / ``ContextLengthError``."""
        inputs = self._inputs
        if inputs is None or not req.params or req.prompt_ids is not None:
            return req
        if req.session_id is not None:
            if req.messages:  # the latest message must fit whatever the session's context policy keeps
                await self._off_thread(inputs.check_bytes, str(req.messages[-1].get("content") or ""))
            return req
        if req.context is not None:  # refused by the engine thread (a context policy needs a session)
            return req
        if req.messages is not None:
            ids = await self._off_thread(inputs.chat_prompt_ids, req.messages, req.params[0], req.chat)
        elif isinstance(req.prompt, str):
            ids = await self._off_thread(inputs.text_prompt_ids, req.prompt, req.params[0])
        else:
            return req
        return dataclasses.replace(req, prompt_ids=ids)

    async def encode_chat(self, messages: list[dict], **chat) -> list[int]:
        """Token ids of a conversation exactly as a chat request gets them (``LLMEngine.encode_chat``), computed in a
        worker thread (on the engine thread for an engine without an input processor)."""
        if self._inputs is None:
            return await self.call(lambda eng: eng.encode_chat(messages, **chat))
        return await self._off_thread(lambda: self._inputs.encode_chat(messages, **chat))

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (``tokenizer.encode``, as ``/tokenize`` gives them), computed in a worker thread
        (on the engine thread for an engine without an input processor)."""
        if self._inputs is None:
            return await self.call(lambda eng: eng.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return await self._off_thread(lambda: self._inputs.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def submit(self, req: GenerationRequest) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises :class:`QueueFullError` when ``max_queue`` requests already wait,
        :class:`KVKeeperError` subclasses for invalid input (bad prompt, context overflow),
        :class:`EngineDeadError` when the engine thread is gone.
        """
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        req = await self._tokenize(req)
        await self._compile_grammar(req)
        with self._lock:
            if self.num_waiting >= self.max_queue:
                raise QueueFullError(self.max_queue)
            self._pending_adds += 1
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.put(Add(req, loop, fut, q))
        try:
            accepted: Accepted = await fut
        except asyncio.CancelledError:
            self.abort(req.request_id)  # processed after the add: the queue keeps order
            raise
        return RequestStream(req.request_id, accepted, q, self.abort)

    def abort(self, request_id: str) -> None:
        """Abort every sequence of a request (no-op if it already finished); frees its blocks."""
        self._inbox.put(Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]):
        """Run ``fn(engine)`` on the engine thread and return its result (exceptions propagate)."""
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put(Call(fn, loop, fut))
        return await fut

    async def block_map(self) -> dict:
        """The block map now (:func:`kvkeeper.kvcache.blockmap.engine_block_map`) with the monitor's windows."""
        return await self.call(lambda eng: engine_block_map(eng, self.monitor.windows()))

    # ---- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                try:
                    self._iterate()
                except Exception as e:  # a bug: end what is in flight, keep serving
                    log.exception("engine step failed")
                    self.tracker.fail_all(e)
        except BaseException as e:  # pragma: no cover - last resort
            log.exception("engine thread died")
            self.error = e
            self.tracker.fail_all(e)

    def _iterate(self) -> None:
        """One step and its output when there is work; else let the breaker cool down; then the telemetry."""
        if self.engine.has_unfinished():
            t0 = time.perf_counter()
            self.engine.step()
            feed = getattr(self.health, "feed", None)
            if feed is not None:
                feed.add_busy(time.perf_counter() - t0)
            self.tracker.release_siblings()
            self.tracker.publish(before_send=self._publish_stats)  # gauges first: a response sees its effect
        elif self.breaker is not None:
            self.breaker.evaluate()  # idle: let the breaker cool down and close
        self._maybe_checkpoint()
        self._maybe_expire()
        self._sample_fragmentation()
        self._publish_stats()

    def _maybe_checkpoint(self) -> None:
        """Every ``checkpoint_every_s`` seconds (SessionConfig), copy idle sessions' new KV to the disk tier."""
        period = getattr(getattr(self.sessions, "config", None), "checkpoint_every_s", None)
        now = time.monotonic()
        if period is None or now < self._checkpoint_next:
            return
        self._checkpoint_next = now + period
        self.sessions.checkpoint_idle()

    def _maybe_expire(self) -> None:
        """About once a second, close the sessions idle for longer than ``--session-ttl`` (SessionConfig)."""
        now = time.monotonic()
        if getattr(getattr(self.sessions, "config", None), "session_ttl_s", None) is None or now < self._expire_next:
            return
        self._expire_next = now + 1.0
        self.sessions.expire_idle(now)

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

    def _handle(self, cmd: Command) -> None:
        match cmd:
            case Add(req, loop, fut, q):
                with self._lock:
                    self._pending_adds -= 1
                self._answer(loop, fut, lambda: self.tracker.add(req, loop, q),
                             f"could not add request {req.request_id}")
            case Abort(request_id):
                self.tracker.abort(request_id)
                self.tracker.publish(before_send=self._publish_stats)
            case Call(fn, loop, fut):
                self._answer(loop, fut, lambda: self._call(fn), None)

    def _call(self, fn: Callable[[Any], Any]):
        """``fn(engine)``, then the snapshot again (the call may have loaded or unloaded an adapter)."""
        try:
            return fn(self.engine)
        finally:
            self.served = ServedModels.of(self.engine, self._served_name)

    def _answer(self, loop, fut, fn: Callable[[], Any], unexpected: str | None) -> None:
        """Resolve ``fut`` on its loop with ``fn()``'s result or exception (unexpected ones are logged);
        the gauges are published first (a session opened or closed shows in /metrics before the answer)."""
        try:
            res = fn()
        except Exception as e:
            if unexpected is not None and not isinstance(e, KVKeeperError):
                log.exception("%s", unexpected)
            self._publish_stats()
            loop.call_soon_threadsafe(_resolve, fut, None, e)
        else:
            self._publish_stats()
            loop.call_soon_threadsafe(_resolve, fut, res)

    def _publish_stats(self) -> None:
        st = self.engine.stats()
        self._engine_waiting = st["num_waiting"]
        st["num_waiting"] += self._pending_adds
        if self.sessions is not None:
            st.update(self.sessions.stats())
        if self.auditor is not None:
            st.update(self.auditor.stats())
        if self.breaker is not None:
            br = self.breaker
            st["breaker"] = {"tier": br.tier, "trips": br.trips,
                             "actions": [{"tier": t, "action": a, "count": n} for (t, a), n in br.actions.items()]}
        if self.health is not None:
            st["kv_health_score"], st["kv_health_warnings"] = self.health.score, self.health.warnings
            st["kv_health_breach_eta_seconds"] = self.health.breach_eta()
        st.update(self._frag)  # fragmentation windows and block states of the latest sample
        pool = getattr(self.engine, "pool", None)
        if pool is not None and "kv_block_states" in st:  # the block counts are O(1): current, not sampled
            owned, cached = pool.num_used, pool.num_cached_free
            st["kv_block_states"] = {**st["kv_block_states"], "owned": owned, "cached": cached,
                                     "free": pool.num_blocks - owned - cached}
        self.metrics.update(st)

    def _observe_health(self, st, now: float) -> None:
        """Feed the health detector (it samples every ``interval_s``) from a pool sample and the counters."""
        if self.health is None:
            return
        m = self.metrics
        try:
            self.health.observe(engine_counters(self.engine, self.auditor, m.ttft_sum, m.ttft_count, self.breaker,
                                                stats=st), now)
        except Exception:  # telemetry must never take the engine down
            log.exception("health detector failed")
            self.health = None

    def _sample_fragmentation(self) -> None:
        """Record ``engine.kv.pool_stats()`` if ``frag_interval_s`` has passed (engine thread only).

        The interval stretches to 50 times the cost of the last sample (``pool_stats`` is
        O(blocks): about 0.2 ms for 1,456 blocks), so sampling takes at most ~2% of the thread.
        """
        now = time.monotonic()
        if now < self._frag_next:
            return
        if not hasattr(self.engine, "kv"):  # a stand-in engine (unit tests): no telemetry
            self._frag_next = float("inf")
            return
        try:
            st = self.engine.kv.pool_stats()
        except Exception:  # telemetry must never take the engine down
            log.exception("pool_stats failed")
            self._frag_next = now + 10.0
            return
        self.monitor.record(st, now)
        self._observe_health(st, now)
        cost = time.monotonic() - now
        self._frag_next = now + max(self.frag_interval_s, 50.0 * cost)
        self._frag = {"kv_fragmentation": self.monitor.windows(now),
                      "kv_block_states": {"free": st.free, "cached": st.cached, "owned": st.owned,
                                          "offloaded": st.offloaded}}
