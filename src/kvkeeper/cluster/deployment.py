"""``kvkeeper serve --replicas N``: N engine replicas on Ray Serve, behind a gateway, routed by :mod:`.router`.

::

    client -> Ray Serve HTTP proxy -> gateway (ASGI, 0 CPUs) -> KVKeeperRequestRouter -> engine replica i
                                                                                         (build_server's app)

* **Engine replicas** (:class:`EngineReplica`): each loads an engine and serves the very app of the
  single-process server (:func:`kvkeeper.api.server.build_server`: same routes, headers, errors);
  the gateway hands it the request's ASGI scope and body and streams the ASGI messages back.  Each
  publishes in its Ray Serve routing stats the bounded summary of the prompt blocks it served.
  With a shared ``--data-dir`` and ``--checkpoint-every``, idle sessions are checkpointed to the
  disk tier and a replica continues a session from the newest checkpoint (SessionManager.refresh_from_disk);
  a replica that drains (Ray Serve's graceful shutdown) writes its sessions to disk.
* **Gateway** (:class:`Gateway`): reads the body, derives the routing hint (``X-Session-ID``, cache
  salt, first prompt blocks) and calls the engine deployment's handle.  A replica that dies before
  answering is retried once on another; when that fails too the client gets 503 with
  ``Retry-After``.  ``GET /metrics`` joins every replica's page (label ``replica``) and the routing
  counters.
* **Router** (:class:`KVKeeperRequestRouter`): Ray Serve's request-router API (``RequestRouter.choose_replicas``)
  over :class:`kvkeeper.cluster.router.Policy` (the text-hash router), or, with ``--kv-events-config``, over
  :class:`kvkeeper.cluster.exact_router.ClusterExactRouter` (the token-exact router).

With ``--kv-events-config`` each replica publishes its KV events on an endpoint pair of its own
(:mod:`kvkeeper.cluster.replica_events`) and advertises it in its routing stats with its block size, base
namespace and load; the router, in the gateway's process, subscribes to every replica's stream and keeps the
index of which replica holds which block; the gateway tokenizes each request
(:mod:`kvkeeper.cluster.gateway_tokens`) and hands the router its token ids.  The session ring stays first for
``X-Session-ID`` and ``prompt_cache_key``; until the first replica advertises its events (a second after start)
the text-hash router decides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.request_router import RequestRouter
from ray.serve._private.constants import DEFAULT_REQUEST_ROUTER_PATH
from ray.serve.config import RequestRouterConfig

from .config import ClusterConfig, ReplicaSpec
from .exact_router import ClusterExactRouter, replica_routing_stats
from .gateway_tokens import GatewayTokenizer, load_renderer, parse_body
from .metrics_text import merge
from .replica_events import replica_config
from .router import REGISTRY, Candidate, Policy, PrefixSummary, cache_key_of, prompt_block_hashes

log = logging.getLogger(__name__)

APP_NAME = "kvkeeper"
BOARD_NAME = "kvkeeper-metrics-board"
BOARD_TTL_S = 30.0
REPLICA_HEADER = b"x-kvkeeper-replica"
KV_SEQ_KEY = "kvkeeper_kv_seq"  # (replica id, KV event seq) on a response's last ASGI message, replica to gateway
FLUSH_WAIT_S = 0.5  # at most this long a replica waits for its KV events to go out before a response's last message,
# and the router for its index to apply them before routing the next request (KVKeeperRequestRouter)
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string",
               "headers", "server", "client")


class KVKeeperRequestRouter(RequestRouter):
    """Ray Serve request router: session affinity, then longest prefix, then power of two choices.

    The hint is the ``routing`` keyword of :meth:`EngineReplica.asgi` (``{"session": id | None, "prefix":
    [block hashes]}``); the replicas' summaries come from their routing stats (``{"prefix": [...]}``).
    With ``exact`` (``request_router_kwargs``, set by ``--kv-events-config``) the token-exact router
    (:class:`~kvkeeper.cluster.exact_router.ClusterExactRouter`) decides from the replicas' KV events and the hint's
    ``tokens``; the text-hash policy only until a replica advertises its events.
    """

    def initialize_state(self, **kwargs):
        vnodes = int(kwargs.get("vnodes", 64))
        self.policy = Policy(vnodes=vnodes)
        self.affinity_wait_s = float(kwargs.get("affinity_wait_s", ClusterConfig.affinity_wait_s))
        self._sets: dict[str, tuple[int, frozenset]] = {}
        self.exact = ClusterExactRouter(vnodes=vnodes, **kwargs.get("exact_weights", {})) if kwargs.get("exact") \
            else None

    def update_replicas(self, replicas):
        super().update_replicas(replicas)
        exact = getattr(self, "exact", None)
        if exact is not None:  # a replica that left: its stream unfollowed, its blocks out of the index
            exact.forget_others(r.replica_id.unique_id for r in replicas)

    def _candidate(self, r) -> Candidate:
        rid = r.replica_id.unique_id
        held = (r.routing_stats or {}).get("prefix") or []
        cached = self._sets.get(rid)
        if cached is None or cached[0] != id(held):
            cached = self._sets[rid] = (id(held), frozenset(held))
        return Candidate(rid, cached[1])

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        hint = (pending_request.kwargs.get("routing") if pending_request is not None else None) or {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if self.exact is not None:
            if hint.get("after") and (hint.get("tokens") or hint.get("hashes")):
                deadline = time.monotonic() + FLUSH_WAIT_S  # bounded: availability before exactness
                while self.exact.behind(hint["after"]):
                    if time.monotonic() > deadline:
                        self.exact.give_up(hint["after"])
                        break
                    await asyncio.sleep(0.002)
            d = self.exact.choose([(r.replica_id.unique_id, r.routing_stats or {},
                                    self.replica_queue_len_cache.get(r.replica_id)) for r in candidate_replicas], hint)
            if d is not None:
                self.exact.export({r.replica_id.unique_id: r.routing_stats["replica"] for r in candidate_replicas
                                   if (r.routing_stats or {}).get("replica")})
                return [[by_id[i] for i in rank] for rank in self._ranks(d, pending_request, self.affinity_wait_s)
                        if rank]
        d = self.policy.choose([self._candidate(r) for r in candidate_replicas], hint.get("session"),
                               hint.get("prefix") or (), hint.get("cache_key"))
        return [[by_id[i] for i in rank] for rank in self._ranks(d, pending_request, self.affinity_wait_s) if rank]

    @staticmethod
    def _ranks(d, pending_request, wait_s: float, now: float | None = None) -> list[list[str]]:
        """The ranks Ray Serve may try now.  A decision by affinity (``session``, ``cache_key``, ``prefix``) offers
        only its first rank during the request's first ``wait_s`` seconds (``--affinity-wait-s``): Ray Serve moves
        to the next rank when a replica's queue-length probe misses its 0.1 s deadline, which a busy CPU causes
        without the replica being full, and a session's KV would then be recomputed elsewhere.  After the wait (the
        replica really full or stuck) every rank is offered: availability before affinity."""
        if d.reason == "load" or pending_request is None:
            return d.ranks
        waited = (time.time() if now is None else now) - pending_request.created_at
        return d.ranks if waited >= wait_s else d.ranks[:1]


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The replicas' latest /metrics pages (a named actor the gateway reads)."""

    def __init__(self):
        self.pages: dict[str, tuple[float, str]] = {}

    def put(self, name: str, text: str) -> None:
        self.pages[name] = (time.time(), text)

    def drop(self, name: str) -> None:
        self.pages.pop(name, None)

    def get(self) -> dict[str, str]:
        now = time.time()
        return {k: t for k, (ts, t) in self.pages.items() if now - ts < BOARD_TTL_S}


def _board():
    return MetricsBoard.options(name=BOARD_NAME, namespace="kvkeeper", get_if_exists=True,
                                lifetime="detached").remote()


async def run_asgi(app, scope: dict, body: bytes, extra_headers: list | None = None):
    """Run one HTTP request through an ASGI ``app``; yields its ``send`` messages as they come (bytes body given whole)."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected; the task ends with the response

    async def send(msg):
        if msg["type"] == "http.response.start" and extra_headers:
            msg = {**msg, "headers": list(msg.get("headers") or []) + extra_headers}
        await q.put(msg)

    async def call():
        try:
            await app(dict(scope), receive, send)
        finally:
            await q.put(done)

    task = asyncio.ensure_future(call())
    try:
        while (msg := await q.get()) is not done:
            yield msg
        await task
    finally:
        task.cancel()


class EngineReplica:
    """One engine and the single-process server's app (:func:`kvkeeper.api.server.build_server`)."""

    def __init__(self, spec: ReplicaSpec):
        import torch

        from ..api.server import build_server
        from ..engine.llm_engine import LLMEngine

        torch.set_num_threads(spec.torch_threads)
        try:
            ctx = serve.get_replica_context()
            rid = ctx.replica_id.unique_id
            rank = getattr(ctx.rank, "local_rank", ctx.rank)
        except Exception:  # outside a Serve replica (tests)
            rid, rank = "local", 0
        ecfg = spec.engine
        events = ecfg.kv_events_config
        if events is not None and events.active:  # this replica's own endpoints (kvkeeper.cluster.replica_events)
            ecfg = dataclasses.replace(ecfg, kv_events_config=replica_config(events, int(rank or 0)))
        engine = self.engine = LLMEngine(ecfg)
        self.node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.app = build_server(engine, spec.server, spec.sessions, spec.breaker, spec.audit, spec.health)
        self.aeng = self.app.state.engine
        self.aeng.start()
        self.summary = PrefixSummary(spec.summary_size)
        self.rid = rid
        self.name = f"{rid}@{socket.gethostname()}:{os.getpid()}"
        self._board = None
        self._pusher: asyncio.Task | None = None

    def _ensure_pusher(self) -> None:
        """Start publishing this replica's /metrics page (on the replica's event loop, once)."""
        if self._pusher is None:
            try:
                self._pusher = asyncio.get_running_loop().create_task(self._push_metrics())
            except RuntimeError:  # no loop on this thread: the next call on the loop starts it
                pass

    async def _push_metrics(self, period_s: float = 2.0) -> None:
        self._board = _board()
        while True:
            try:
                self._board.put.remote(self.name, self.aeng.metrics.render().decode())
            except Exception:  # metrics must never take a replica down
                log.exception("could not publish this replica's metrics")
            await asyncio.sleep(period_s)

    def record_routing_stats(self) -> dict:
        """Ray Serve routing stats: the prompt-block summary (at most ``summary_size`` hashes); with KV events, the
        event endpoints, block size, base namespace and load
        (:func:`~kvkeeper.cluster.exact_router.replica_routing_stats`)."""
        self._ensure_pusher()
        snap = getattr(self.aeng.metrics, "snapshot", None) or {}
        load = {"running": int(snap.get("num_running", 0)), "waiting": int(snap.get("num_waiting", 0)),
                "kv_usage": float(snap.get("kv_usage", 0.0))}
        return {"prefix": self.summary.snapshot(), "replica": self.name,
                **replica_routing_stats(self.engine, self.engine.kv_events, self.node_ip, load)}

    async def asgi(self, scope: dict, body: bytes, routing: dict | None = None):
        """Serve one request (its ASGI scope and whole body): yields the ASGI messages of the response."""
        self._ensure_pusher()
        if routing and routing.get("prefix"):
            self.summary.add(routing["prefix"])
        pub = self.engine.kv_events
        async for msg in run_asgi(self.app, scope, body, [(REPLICA_HEADER, self.name.encode())]):
            if pub is not None and msg.get("type") == "http.response.body" and not msg.get("more_body"):
                # the blocks this request stored go out before its answer ends: the gateway tells the router to
                # route no later request before its index has them (read your own writes; KVKeeperRequestRouter)
                deadline = time.monotonic() + FLUSH_WAIT_S
                while not pub.flushed() and time.monotonic() < deadline:
                    await asyncio.sleep(0.002)
                msg = {**msg, KV_SEQ_KEY: (self.rid, pub.seq)}
            yield msg

    def __del__(self):
        """Graceful shutdown (drain): stop the engine thread and write the sessions to the disk tier."""
        pusher = getattr(self, "_pusher", None)
        if pusher is not None:
            pusher.cancel()
        aeng = getattr(self, "aeng", None)
        if aeng is not None:
            aeng.stop()
        publisher = getattr(getattr(self, "engine", None), "kv_events", None)
        if publisher is not None:
            publisher.close()
        board = getattr(self, "_board", None)
        if board is not None:
            board.drop.remote(self.name)


def routing_hint(headers: dict[bytes, bytes], body: bytes, doc: dict | None = None) -> dict:
    """``{"session": X-Session-ID or None, "cache_key": prompt_cache_key or None, "prefix": first prompt block
    hashes}`` of one request (``doc``: its body already parsed, :func:`parse_body`)."""
    sid = headers.get(b"x-session-id")
    if sid is not None:
        return {"session": sid.decode("latin-1"), "prefix": []}
    if doc is None:
        doc = parse_body(body)
    salt = headers.get(b"x-cache-salt", b"").decode("latin-1") or str(doc.get("cache_salt") or "")
    return {"session": None, "cache_key": cache_key_of(doc), "prefix": prompt_block_hashes(doc, salt)}


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    return b"".join(chunks)


async def _send_simple(send, status: int, body: bytes, headers: list | None = None,
                       ctype: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _ASGI:
    """An ASGI 3 callable around a coroutine function (uvicorn takes a bare bound method for ASGI 2)."""

    def __init__(self, fn):
        self.fn = fn

    async def __call__(self, scope, receive, send):
        await self.fn(scope, receive, send)


class Gateway:
    """The ingress: forwards each request to an engine replica (retried once if that replica dies).

    tokens: ``(EngineConfig, served model name, KeyRing or None)`` when the token-exact router is on: the gateway
    loads the model's tokenizer and hands the router each request's token ids
    (:class:`~kvkeeper.cluster.gateway_tokens.GatewayTokenizer`)."""

    def __init__(self, engines, retry_after_s: int = 2, tokens: tuple | None = None):
        self.engines = engines.options(stream=True)
        self.retry_after_s = retry_after_s
        self.board = None  # the metrics board, found on the first GET /metrics
        self.tokens = None
        self.kv_seq: dict[str, int] = {}  # replica id -> the KV event seq its last answer carried
        if tokens is not None:
            engine_cfg, served_name, key_ring = tokens
            self.tokens = GatewayTokenizer(load_renderer(engine_cfg), served_name, key_ring)

    def __serve_build_asgi_app__(self):
        return _ASGI(self._asgi)

    async def _asgi(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        if scope.get("path") == "/metrics" and scope.get("method") == "GET":
            return await self._metrics(send)
        await self._forward({k: scope[k] for k in _SCOPE_KEYS if k in scope}, body, send)

    async def _forward(self, scope: dict, body: bytes, send) -> None:
        """Forward to a replica; a replica that dies before the response starts is retried once, then 503."""
        headers = {bytes(k).lower(): bytes(v) for k, v in scope.get("headers", [])}
        doc = parse_body(body)
        hint = routing_hint(headers, body, doc)
        if self.tokens is not None and hint.get("session") is None and hint.get("cache_key") is None:
            got = await asyncio.to_thread(self.tokens.prompt, scope.get("path", ""), headers, doc)
            if got is not None:
                hint.update(got)  # {"tokens", "salt"}: the router hashes them (ClusterExactRouter)
                hint["after"] = dict(self.kv_seq)  # the events of every answer forwarded so far
        scope["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
        for attempt in (1, 2):
            started = False
            try:
                async for msg in self.engines.asgi.remote(scope, body, routing=hint):
                    started = True
                    kv = msg.pop(KV_SEQ_KEY, None)
                    if kv is not None:
                        rid, seq = kv
                        self.kv_seq[rid] = max(seq, self.kv_seq.get(rid, -1))
                    await send(msg)
                return
            except RayActorError as e:
                log.warning("replica died during a request (attempt %d, response started: %s): %s", attempt,
                            started, e)
                if started:
                    return  # the client sees the response cut short, never a wrong one
        msg = (b'{"error": {"message": "the replica serving this request stopped; retry after a few seconds", '
               b'"type": "service_unavailable", "param": null, "code": 503}}')
        await _send_simple(send, 503, msg, [(b"retry-after", str(self.retry_after_s).encode())])

    async def _metrics(self, send) -> None:
        from prometheus_client import generate_latest

        try:
            self.board = self.board or _board()
            pages = await self.board.get.remote()
        except Exception as e:  # the board is gone: the routing counters alone
            log.warning("no replica metrics: %s", e)
            pages = {}
        text = merge(pages) + generate_latest(REGISTRY).decode()
        await _send_simple(send, 200, text.encode(), ctype=b"text/plain; version=0.0.4; charset=utf-8")


def build_app(spec: ReplicaSpec, cluster: ClusterConfig):
    """The Ray Serve application: the gateway bound to ``cluster.replicas`` engine replicas; the token-exact router
    when the replicas publish KV events (``spec.engine.kv_events_config``) and ``cluster.router`` is kvkeeper."""
    events = spec.engine.kv_events_config
    exact = cluster.router == "kvkeeper" and events is not None and events.active
    ours = cluster.router == "kvkeeper"
    router = RequestRouterConfig(
        request_router_class=KVKeeperRequestRouter if ours else DEFAULT_REQUEST_ROUTER_PATH,
        request_router_kwargs={"exact": exact, "affinity_wait_s": cluster.affinity_wait_s} if ours else {},
        request_routing_stats_period_s=cluster.routing_stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 3 * cluster.routing_stats_period_s))
    threads = str(spec.torch_threads)
    engines = serve.deployment(
        EngineReplica, name="kvkeeper-engine", num_replicas=cluster.replicas,
        max_ongoing_requests=cluster.max_ongoing_requests, request_router_config=router,
        graceful_shutdown_timeout_s=30,
        ray_actor_options={"num_cpus": cluster.replica_cpus,
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}})
    gateway = serve.deployment(serve.ingress()(Gateway), name="kvkeeper-gateway", num_replicas=1,
                               max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    tokens = (spec.engine, spec.server.served_model_name, spec.server.key_ring()) if exact else None
    return gateway.bind(engines.bind(spec), retry_after_s=cluster.retry_after_s, tokens=tokens)


# Ray Serve's HTTP proxy must answer its readiness check within 5 s, three times running, or the controller kills it
# and ``serve.start`` fails (``ActorDiedError``): a 2-core machine busy with other work took longer to start the
# proxy (seen in the test suite beside a CPU-bound build, AMD EPYC, 2026-12-07), and beside a busy loop at the start
# of a full test run it took more than 60 s (2026-12-08).  The Ray this process starts gets these bounds instead (its
# processes inherit the environment; a cluster joined with --ray-address keeps its own), unless the environment names
# them.
SERVE_PROXY_BOUNDS_S = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "300", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def start(spec: ReplicaSpec, cluster: ClusterConfig, host: str, port: int) -> None:
    """Start (or join, ``cluster.ray_address``) Ray, Serve's HTTP proxy on ``host:port`` and the application;
    returns when every replica is running.  Raises RuntimeError when the deployment fails.

    ``serve.start`` gives up waiting for the proxy after a fixed 60 s (``TimeoutError``; Ray Serve's constant) while
    the controller goes on checking it for the bound above: that wait is logged and the application deployed; the
    proxy answers once it is up (a client sees the port refuse until then)."""
    if not ray.is_initialized():
        for name, value in SERVE_PROXY_BOUNDS_S.items():
            os.environ.setdefault(name, value)
        ray.init(address=cluster.ray_address, include_dashboard=False, namespace="kvkeeper",
                 logging_level=logging.WARNING, log_to_driver=True)
    try:
        serve.start(http_options={"host": host, "port": port})
    except TimeoutError as e:
        log.warning("%s; deploying the application while the proxy comes up", e)
    serve.run(build_app(spec, cluster), name=APP_NAME, route_prefix="/")


def stop() -> None:
    """Delete the application (replicas drain: their sessions go to disk), stop Serve and disconnect from Ray."""
    try:
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        try:
            ray.kill(ray.get_actor(BOARD_NAME, namespace="kvkeeper"))
        except Exception:  # already gone
            pass
        ray.shutdown()
