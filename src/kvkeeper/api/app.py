"""The OpenAI-compatible HTTP app (FastAPI): routes, error handlers, body-size limit.

Endpoints::

    GET    /health                  200 {"status": "ok"} while the engine thread runs, else 503
    GET    /metrics                 Prometheus text (see kvkeeper.api.metrics)
    GET    /v1/models               the served model, with context_length (tokens)
    POST   /v1/chat/completions     chat (messages through the model's chat template), SSE with stream=true
    POST   /v1/completions          raw text or token-id prompt
    POST   /tokenize                prompt token ids of a text or of messages (what a request would prefill)
    GET    /v1/sessions             open sessions: id, tokens, blocks, turns, tier (pool / host / disk)
    POST   /v1/sessions/{id}/offload?tier=host|disk   move an idle session's KV out of the pool
    DELETE /v1/sessions/{id}        close a session and free its blocks (404 if unknown)
    GET    /admin/kv                live KV block map page (HTML); /admin/kv.json its data (kvkeeper.api.admin)
    GET    /admin/kv/dump           ?session=ID[&layers=0,5&start=N&end=M]: the session's K/V (safetensors)

    GET    /admin/breaker           the KV circuit breaker: tier, trips, action counts, recent events

Headers: ``X-Session-ID`` pins a conversation's KV between requests (``X-Session-Priority``, an
integer, default 0: the circuit breaker trims lower priorities first; a response whose oldest
turns were left out says how many in ``X-KVKeeper-Trimmed-Turns``); ``X-Cache-Salt``
(or the body field ``cache_salt``) isolates a tenant's prefix cache.  Errors are
OpenAI-style JSON bodies (see :mod:`kvkeeper.api.errors`); no stack trace reaches a client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.sampling_params import SamplingParams
from ..errors import KVKeeperError, SessionNotFoundError
from ..kvcache.namespace import Namespace
from .async_engine import AsyncEngine, ChoiceDelta, EngineDeadError, GenerationRequest, RequestStream, Usage
from .errors import APIError, BodyTooLargeError, error_body, from_kvkeeper_error
from .metrics import CONTENT_TYPE
from .schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest, _SamplingFields

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB
_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 503: "server_overloaded"}


# ---- body size limit -------------------------------------------------------------------


class BodyLimitMiddleware:
    """Answer 413 to bodies over ``max_bytes`` (by Content-Length, or while a chunked body streams in)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
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


# ---- helpers ------------------------------------------------------------------------------


def _finish_reason(r: str | None) -> str | None:
    return r if r in (None, "stop", "length") else ("abort" if r == "abort" else "stop")


def _messages(body: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    out = []
    for i, m in enumerate(body.messages):
        c = m.content
        if c is None:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].content is missing", param=f"messages.{i}.content")
            c = ""
        elif isinstance(c, list):
            parts = []
            for j, p in enumerate(c):
                if p.type != "text" or p.text is None:
                    raise APIError(400, f"messages[{i}].content[{j}] has type {p.type!r}; only text parts "
                                        "({'type': 'text', 'text': ...}) are supported",
                                   param=f"messages.{i}.content.{j}")
                parts.append(p.text)
            c = "\n".join(parts)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": c})
    return out


def _sampling(body: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> list[SamplingParams]:
    """One SamplingParams per choice; seeds seed, seed+1, ... when a seed is given."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported (only 0)", param=name)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 16:
        raise APIError(400, f"at most 16 stop strings, got {len(stop)}", param="stop")
    kw = dict(temperature=1.0 if body.temperature is None else body.temperature,
              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, max_tokens=max_tokens,
              stop=stop, ignore_eos=body.ignore_eos, logprobs=logprobs)
    try:
        return [SamplingParams(seed=None if body.seed is None else body.seed + i, **kw) for i in range(body.n)]
    except KVKeeperError as e:
        raise APIError(400, str(e)) from None


def _choice_error(d: ChoiceDelta) -> APIError:
    return APIError(400, d.error or "the request failed", code="request_failed")


# ---- app factory --------------------------------------------------------------------------


def create_app(engine: AsyncEngine, served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """Build the app around an :class:`AsyncEngine` (started and stopped with the app's lifespan).

    served_model_name: the id clients must send as ``model`` (or omit); default the engine's model name.
    max_body_bytes: larger request bodies get 413.
    """
    name = served_model_name or engine.model_name
    base_ns: Namespace = engine.engine.namespace  # frozen: safe to read from any thread
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="kvkeeper", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.state.engine = engine

    # ---- error handlers ----
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(KVKeeperError)
    async def _kvk_error(request: Request, e: KVKeeperError):
        a = from_kvkeeper_error(e)
        return JSONResponse(a.body(), status_code=a.status, headers=a.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        msgs, param = [], None
        for err in e.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                msgs.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', 'decode error')}")
                continue
            where = ".".join(loc)
            param = param or where or None
            msgs.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse(error_body("; ".join(msgs) or "invalid request", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        typ = _STATUS_TYPES.get(e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error")
        return JSONResponse(error_body(str(e.detail), typ), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        log.error("request failed: %s", e)
        return JSONResponse(error_body("the engine failed; see the server log", "server_error"), status_code=500)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error; see the server log", "server_error"), status_code=500)

    # ---- shared request plumbing ----
    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def namespace(body: _SamplingFields, request: Request) -> Namespace | None:
        salt = body.cache_salt if body.cache_salt is not None else request.headers.get("x-cache-salt")
        if salt is None:
            return None
        if not salt or len(salt) > 256:
            raise APIError(400, "cache salt must be 1 to 256 characters", param="cache_salt")
        return Namespace(base_ns.model_revision, adapter=base_ns.adapter, tenant_salt=salt, kv_dtype=base_ns.kv_dtype)

    def compression(body: _SamplingFields):
        if body.kv_compression is None:
            return None
        from ..kvcache.compression import KVCompression

        return KVCompression(body.kv_compression.policy, body.kv_compression.ratio)

    def session_id(request: Request) -> str | None:
        sid = request.headers.get("x-session-id")
        if sid is not None and not _SESSION_ID_RE.match(sid):
            raise APIError(400, "X-Session-ID must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
                           param="X-Session-ID")
        return sid

    def session_priority(request: Request) -> int | None:
        raw = request.headers.get("x-session-priority")
        if raw is None:
            return None
        p = int(raw) if re.fullmatch(r"\s*[+-]?[0-9]{1,5}\s*", raw) else None  # no "1_0", "0x10", "1e2"
        if p is None or not -1000 <= p <= 1000:
            raise APIError(400, f"X-Session-Priority must be an integer from -1000 to 1000, got {raw!r}",
                           param="X-Session-Priority")
        return p

    def trim_headers(stream: RequestStream) -> dict[str, str]:
        return {"X-KVKeeper-Trimmed-Turns": str(stream.trimmed_turns)} if stream.trimmed_turns else {}

    async def watch_disconnect(request: Request, stream: RequestStream) -> None:
        while not stream.finished:
            if await request.is_disconnected():
                log.info("client went away; aborting %s", stream.request_id)
                stream.abort()
                return
            await asyncio.sleep(0.25)

    async def collect(request: Request, stream: RequestStream, n: int):
        """Run a request to the end; returns per-choice (text, logprob entries, finish reason) and usage."""
        texts, lps, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        usage: Usage | None = None
        watcher = asyncio.create_task(watch_disconnect(request, stream))
        try:
            async for out in stream:
                for d in out.deltas:
                    if d.finish_reason == "error":
                        raise _choice_error(d)
                    texts[d.index] += d.text
                    lps[d.index].extend(d.logprobs)
                    if d.finish_reason:
                        reasons[d.index] = d.finish_reason
                if out.finished:
                    usage = out.usage
        finally:
            watcher.cancel()
            stream.abort()
        return texts, lps, reasons, usage

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def sse_response(gen, extra_headers: dict[str, str] | None = None) -> StreamingResponse:
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          **(extra_headers or {})})

    async def stream_events(stream: RequestStream, make_chunk, first_chunks, include_usage: bool, base: dict):
        try:
            for c in first_chunks:
                yield sse(c)
            async for out in stream:
                for d in out.deltas:
                    if d.finish_reason == "error":
                        yield sse(_choice_error(d).body())
                        yield "data: [DONE]\n\n"
                        return
                    yield sse(make_chunk(d))
                if out.finished and include_usage:
                    yield sse({**base, "choices": [], "usage": out.usage.to_dict()})
            yield "data: [DONE]\n\n"
        except EngineDeadError as e:
            log.error("stream %s failed: %s", stream.request_id, e)
            yield sse(error_body("the engine failed; see the server log", "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()  # no-op when finished; frees the blocks when the client went away

    # ---- routes ----
    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "error", "detail": "the engine thread is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvkeeper",
                "context_length": engine.context_length, "max_model_len": engine.context_length}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        messages = _messages(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        want_lp = body.logprobs
        params = _sampling(body, max_tokens, (body.top_logprobs or 0) if want_lp else None)
        rid = engine.new_request_id("chatcmpl")
        stream = await engine.submit(GenerationRequest(rid, params, messages=messages, namespace=namespace(body, request),
                                                       session_id=session_id(request), compression=compression(body),
                                                       session_priority=session_priority(request)))
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            extra = {"usage": None} if include_usage else {}

            def make_chunk(d: ChoiceDelta) -> dict:
                delta = {"content": d.text} if d.text else {}
                return {**base, "choices": [{"index": d.index, "delta": delta,
                                             "logprobs": {"content": d.logprobs} if want_lp and d.logprobs else None,
                                             "finish_reason": _finish_reason(d.finish_reason)}], **extra}

            first = [{**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], **extra}
                     for i in range(body.n)]
            return sse_response(stream_events(stream, make_chunk, first, include_usage, base), trim_headers(stream))
        texts, lps, reasons, usage = await collect(request, stream, body.n)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": base["created"], "model": name,
                             "choices": [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                                          "logprobs": {"content": lps[i]} if want_lp else None,
                                          "finish_reason": _finish_reason(reasons[i])} for i in range(body.n)],
                             "usage": usage.to_dict() if usage else None}, headers=trim_headers(stream))

    def legacy_logprobs(entries: list[dict], offset: int = 0) -> dict:
        offsets, pos = [], offset
        for e in entries:
            offsets.append(pos)
            pos += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        want_lp = body.logprobs is not None
        params = _sampling(body, body.max_tokens, body.logprobs)
        rid = engine.new_request_id("cmpl")
        stream = await engine.submit(GenerationRequest(rid, params, prompt=prompt, namespace=namespace(body, request),
                                                       session_id=session_id(request), compression=compression(body),
                                                       session_priority=session_priority(request)))
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            extra = {"usage": None} if include_usage else {}
            offsets = [0] * body.n

            def make_chunk(d: ChoiceDelta) -> dict:
                lp = None
                if want_lp and d.logprobs:
                    lp = legacy_logprobs(d.logprobs, offsets[d.index])
                offsets[d.index] += sum(len(e["token"]) for e in d.logprobs)
                return {**base, "choices": [{"index": d.index, "text": d.text, "logprobs": lp,
                                             "finish_reason": _finish_reason(d.finish_reason)}], **extra}

            return sse_response(stream_events(stream, make_chunk, [], include_usage, base))
        texts, lps, reasons, usage = await collect(request, stream, body.n)
        return {"id": rid, "object": "text_completion", "created": base["created"], "model": name,
                "choices": [{"index": i, "text": texts[i], "logprobs": legacy_logprobs(lps[i]) if want_lp else None,
                             "finish_reason": _finish_reason(reasons[i])} for i in range(body.n)],
                "usage": usage.to_dict() if usage else None}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages is empty: give at least one message", param="messages")
            msgs, agp = _messages(body), body.add_generation_prompt
            ids = await engine.call(lambda eng: eng.encode_chat(msgs, add_generation_prompt=agp))
        else:
            text = body.prompt
            ids = await engine.call(lambda eng: eng.tokenizer.encode(text))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context_length}

    @app.get("/v1/sessions")
    async def list_sessions():
        def ls(eng):
            return [{"id": s.id, "object": "session", "tokens": s.num_tokens, "blocks": s.num_blocks,
                     "turns": len(s.turns), "tier": s.tier} for s in eng.sessions.values()]

        return {"object": "list", "data": await engine.call(ls)}

    @app.get("/admin/breaker")
    async def breaker_state():
        def snap(eng):
            br = getattr(eng, "breaker", None)
            return br.snapshot() if br is not None else {"tier": 0, "enabled": False}

        return await engine.call(snap)

    @app.delete("/v1/sessions/{sid}")
    async def delete_session(sid: str):
        def close(eng):
            s = eng.sessions.get(sid)
            if s is None:
                raise SessionNotFoundError(f"no open session {sid!r}")
            blocks = s.num_blocks
            s.close()
            return blocks

        blocks = await engine.call(close)
        return {"id": sid, "object": "session", "deleted": True, "freed_blocks": blocks}

    @app.post("/v1/sessions/{sid}/offload")
    async def offload_session(sid: str, tier: str = "host"):
        def off(eng):
            s = eng.sessions.get(sid)
            if s is None:
                raise SessionNotFoundError(f"no open session {sid!r}")
            freed = s.offload(tier)
            return freed, s.tier

        freed, now = await engine.call(off)
        return {"id": sid, "object": "session", "tier": now, "freed_blocks": freed}

    @app.get("/admin/kv/dump")
    async def kv_dump(session: str, layers: str | None = None, start: int | None = None, end: int | None = None):
        """A session's K/V as a safetensors file (kvkeeper.diagnostics.kvdump), built on the engine thread."""
        from ..diagnostics.kvdump import dump_session, to_bytes

        data = await engine.call(lambda eng: to_bytes(*dump_session(eng, session, layers, start, end)))
        return Response(content=data, media_type="application/octet-stream",
                        headers={"Content-Disposition": 'attachment; filename="kv-dump.safetensors"'})

    from .admin import add_admin_routes

    add_admin_routes(app, engine)
    return app
