"""The OpenAI-compatible HTTP app (FastAPI): routes, error handlers, body-size limit.

Endpoints::

    GET    /health                  200 {"status": "ok"} while the engine thread runs, else 503
    GET    /metrics                 Prometheus text (see kvkeeper.api.engine_client.metrics)
    GET    /v1/models               the served model, with context_length (tokens)
    POST   /v1/chat/completions     chat (messages through the model's chat template), SSE with stream=true
    POST   /v1/completions          raw text or token-id prompt
    POST   /v1/messages             Anthropic's Messages API (and /v1/messages/count_tokens; kvkeeper.api.anthropic)
    POST   /tokenize                prompt token ids of a text or of messages (what a request would prefill)
    GET    /v1/sessions             open sessions: id, tokens, blocks, turns, tier (pool / host / disk)
    POST   /v1/sessions/{id}/offload?tier=host|disk   move an idle session's KV out of the pool
    DELETE /v1/sessions/{id}        close a session and free its blocks (404 if unknown)
    GET    /v1/sessions/{id}/export one checksummed file; POST /admin/sessions/import opens one (kvkeeper.api.sessions.transfer)
    POST   /v1/responses            OpenAI's Responses API on sessions; GET/DELETE /v1/responses/{id}, .../input_items
    POST   /v1/conversations        OpenAI's Conversations API (items held by the server; kvkeeper.api.responses.conversations)
    GET    /admin/kv                live KV block map page (HTML); /admin/kv.json its data (kvkeeper.api.admin.kv)
    GET    /admin/kv/dump           ?session=ID[&tenant=T&layers=0,5&start=N&end=M]: the session's K/V (safetensors)
    GET    /admin/breaker           the KV circuit breaker: tier, trips, action counts, recent events
    GET    /admin/health            the cache-health detector: score, signals, warning events (kvkeeper.api.admin.kv)
    GET    /admin/cache/misses      why session / prompt_cache_key requests missed the cache (X-KVKeeper-Cache-Miss)

Keys (:mod:`kvkeeper.api.common.auth`): with API keys every route but ``/health``, ``/metrics`` and
``/openapi.json`` needs ``Authorization: Bearer <key>`` (401 otherwise); sessions and the cache namespace belong
to the key's tenant (``/v1/sessions*`` see only the caller's sessions); ``/admin/*`` needs an admin key (a dump
also answers the session's tenant).  ``/metrics`` names no session and holds no token.

Headers: ``X-Session-ID`` runs the request as a turn of that session (the client resends its
history; the session's KV is reused by the rule of :mod:`kvkeeper.sessions.session`);
``X-Session-Priority``, an integer, default 0: the circuit breaker trims lower priorities first (a
response whose oldest turns were left out says how many in ``X-KVKeeper-Trimmed-Turns``);
``X-Cache-Salt`` (or the body field ``cache_salt``) narrows the caller's prefix-cache namespace.  Errors are
OpenAI-style JSON bodies (see :mod:`kvkeeper.api.common.errors`); no stack trace reaches a client.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException

from .admin.kv import router as admin_router
from .admin.lora import router as lora_router
from .anthropic.route import router as anthropic_router
from .chat.route import router as chat_router
from .common.access_log import AccessLogMiddleware
from .common.auth import KeyRing, admin_caller, caller
from .common.errors import DEFAULT_MAX_BODY_BYTES, BodyTooLargeError, install_error_handlers
from .common.streams import EngineDeadError
from .completions.route import router as completions_router
from .engine_client.async_engine import AsyncEngine
from .engine_client.tracing import flush_traces
from .observability.health import public_router
from .observability.models import router as models_router
from .responses.conversations import router as conversations_router
from .responses.route import router as responses_router
from .sessions.routes import router as session_router
from .sessions.transfer import admin_router as import_router
from .sessions.transfer import router as transfer_router


class BodyLimitMiddleware:
    """Answer 413 to bodies over ``max_bytes`` (by Content-Length, or while a chunked body streams in)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        from fastapi.responses import JSONResponse

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cl = dict(scope.get("headers") or []).get(b"content-length")
        if cl is not None and cl.strip().isdigit() and int(cl) > self.max_bytes:
            e = BodyTooLargeError(self.max_bytes)
            return await JSONResponse(e.body(), status_code=413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg.get("type") == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, detail=BodyTooLargeError(self.max_bytes).message)
            return msg

        await self.app(scope, limited, send)


def create_app(engine: AsyncEngine, served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, refuse_unknown_fields: bool = True,
               keys: KeyRing | None = None, admin_routes: bool = True) -> FastAPI:
    """Build the app around an :class:`AsyncEngine` (started and stopped with the app's lifespan).

    served_model_name: the id clients must send as ``model`` (or omit); default the engine's model name.
    max_body_bytes: larger request bodies get 413.  refuse_unknown_fields: a request field no schema
    declares gets 400 naming it (False: such fields are ignored).  keys: the API keys (None: none, every
    request is the local caller).  admin_routes: serve ``/admin/*`` here (False: they are served by
    :func:`create_admin_app` on another port).  Every request gets an access-log line
    when the ``kvkeeper.access`` logger is enabled (:func:`kvkeeper.api.common.access_log.configure_access_log`).
    """

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            flush_traces()

    app = FastAPI(title="kvkeeper", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(AccessLogMiddleware)  # outermost: 413s are logged too
    app.state.engine = engine
    app.state.keys = keys
    app.state.refuse_unknown_fields = refuse_unknown_fields
    engine.serve_as(served_model_name)  # handlers read engine.served (the engine thread's snapshot)
    app.state.model_name = engine.served.name
    app.state.created = int(time.time())
    app.state.allow_runtime_lora = False  # build_server sets --allow-runtime-lora
    install_error_handlers(app, EngineDeadError)
    app.include_router(public_router)
    for r in (chat_router, completions_router, models_router, responses_router, conversations_router):
        app.include_router(r, dependencies=[Depends(caller)])
    app.include_router(anthropic_router)  # its own caller dependency: x-api-key or Authorization: Bearer
    app.include_router(lora_router, dependencies=[Depends(admin_caller)])
    app.include_router(session_router, dependencies=[Depends(caller)])
    app.include_router(transfer_router)  # export: the caller's session
    if admin_routes:
        app.include_router(admin_router)
        app.include_router(import_router)
    return app


def create_admin_app(engine: AsyncEngine, keys: KeyRing | None = None) -> FastAPI:
    """The ``/admin/*`` routes alone, for ``serve --admin-port`` (bound to 127.0.0.1 by the server), with the
    same keys and error bodies.  It has no lifespan: the main app starts and stops ``engine``."""
    app = FastAPI(title="kvkeeper admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AccessLogMiddleware)
    app.state.engine = engine
    app.state.keys = keys
    install_error_handlers(app, EngineDeadError)
    app.include_router(admin_router)
    app.include_router(import_router)
    return app
