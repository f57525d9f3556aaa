"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API on the chat path.

::

    POST /v1/messages               a message; stream=true: Anthropic's SSE events (message_start, ping,
                                    content_block_start / _delta / _stop, message_delta, message_stop)
    POST /v1/messages/count_tokens  {"input_tokens": N}: the prompt's tokens as /v1/messages would prefill them

Keys: ``x-api-key`` (the ``anthropic`` SDK's) or ``Authorization: Bearer`` (the same keys and tenants,
:mod:`kvkeeper.api.common.auth`).  ``anthropic-version``, ``anthropic-beta`` and the query ``?beta=true`` are accepted (the
answer does not depend on them).  Errors have Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``.

Response headers: ``X-KVKeeper-Max-Tokens-Clamped`` (``<asked> -> <served>``: ``max_tokens`` was more than the
context left after the prompt, as llama.cpp clamps it), ``X-KVKeeper-Not-Applied`` (the accepted fields that
change nothing: :data:`~kvkeeper.api.anthropic.protocol.NOT_APPLIED`), ``X-KVKeeper-Tools-Not-Offered`` (the tools
marked ``defer_loading``, not offered to the model: there is no tool search), and the chat route's
``X-KVKeeper-Trimmed-Turns`` / ``X-KVKeeper-Context``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import KVKeeperError
from ...sessions.session import common_prefix
from ..common.access_log import record_usage
from ..common.auth import LOCAL, Caller, unauthorized, caller
from ..common.rendering import clamped_header, miss_header
from ..chat.serving import chat_request
from ..common.errors import APIError, validation_body, from_kvkeeper_error
from ..common.context import request_context
from ..common.streams import EngineDeadError, GenerationRequest, RequestStream
from .protocol import CountTokensRequest, MessagesRequest
from .serving import Rendered, breakpoint_ttl, chat_body, check_fields, deferred_tools, message_id, usage_of

log = logging.getLogger("kvkeeper.api")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """Anthropic's error body: ``{"type": "error", "error": {"type": ..., "message": ...}}``."""
    typ = _ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": typ, "message": message}}, status_code=status,
                        headers=headers)


def _error_response(e: Exception) -> JSONResponse:
    if isinstance(e, KVKeeperError):
        e = from_kvkeeper_error(e, "messages")
    if isinstance(e, APIError):
        return anthropic_error(e.status, e.message, e.headers)
    if isinstance(e, RequestValidationError):
        return anthropic_error(400, validation_body(e)["error"]["message"])
    if isinstance(e, StarletteHTTPException):  # e.g. a body that is not UTF-8: "There was an error parsing the body"
        return anthropic_error(e.status_code, str(e.detail), e.headers)
    if isinstance(e, EngineDeadError):
        log.error("request failed: %s", e)
        return anthropic_error(500, "the engine failed; see the server log")
    log.exception("unhandled error on an Anthropic route")
    return anthropic_error(500, "internal server error; see the server log")


class AnthropicRoute(APIRoute):
    """A route whose errors (body validation, keys, field rules, the engine's) have Anthropic's shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request):
            try:
                return await handler(request)
            except Exception as e:  # every error a client of this route sees, in Anthropic's shape
                return _error_response(e)

        return handle


def anthropic_caller(request: Request) -> Caller:
    """:func:`kvkeeper.api.common.auth.caller`, with Anthropic's ``x-api-key`` header read as ``Authorization: Bearer``
    (401 for an unknown key)."""
    ring = getattr(request.app.state, "keys", None)
    key = request.headers.get("x-api-key")
    if ring is None or key is None or request.headers.get("authorization"):
        return caller(request) if ring is not None else LOCAL
    who = ring.lookup(key.strip())
    if who is None:
        raise unauthorized("the API key (x-api-key) is not valid for this server")
    return who


router = APIRouter(route_class=AnthropicRoute)


async def _breakpoint_end(aeng, gen: GenerationRequest, ids: list[int], last: int) -> int:
    """Tokens of the prompt up to the end of message ``last`` (the last cache breakpoint's; 0 for -1): the common
    prefix of ``ids`` and the conversation rendered up to it (0 when the template cannot render that part)."""
    if last < 0:
        return 0
    try:
        part = await aeng.encode_chat(gen.messages[:last + 1], **{**gen.chat, "add_generation_prompt": False})
    except KVKeeperError:
        return 0
    return common_prefix(ids, part)


async def _plan(request: Request, body: MessagesRequest, who: Caller) -> tuple[GenerationRequest, Rendered, dict, int]:
    """(the engine's request, its renderer, the response headers, the breakpoint's end in tokens)."""
    aeng, ctx = request.app.state.engine, request_context(request, who)
    not_applied = check_fields(body, ctx)
    chat, last = chat_body(body, body.max_tokens)
    gen, tools = chat_request(chat, ctx, aeng.new_request_id("msg"))
    record_usage(request.scope, user=chat.user)
    ids = await aeng.encode_chat(gen.messages, **gen.chat)
    headers = {"X-KVKeeper-Not-Applied": ", ".join(not_applied)} if not_applied else {}
    if deferred := deferred_tools(body):
        headers["X-KVKeeper-Tools-Not-Offered"] = ", ".join(deferred)
    room = ctx.served.max_model_len - len(ids)
    if 0 < room < body.max_tokens:  # as llama.cpp: the reply may use the context left, and the response says so
        headers |= clamped_header([gen], ids, ctx.served.max_model_len)
        gen.params = [dataclasses.replace(p, max_tokens=room) for p in gen.params]
    bp, ttl = await _breakpoint_end(aeng, gen, ids, last), breakpoint_ttl(body)
    if bp and ttl is not None:  # the prefix up to the last breakpoint stays in the cache for the ttl
        gen.retention = (bp, ttl)
    return gen, Rendered(tools), headers, bp


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request, who: Caller = Depends(anthropic_caller)):
    aeng = request.app.state.engine
    gen, r, headers, bp = await _plan(request, body, who)
    s = await aeng.submit(gen)
    if s.trimmed_turns:
        headers["X-KVKeeper-Trimmed-Turns"] = str(s.trimmed_turns)
    if s.context is not None:
        headers["X-KVKeeper-Context"] = s.context
    msg = {"id": message_id(), "type": "message", "role": "assistant", "model": body.model or aeng.served.name}
    if body.stream:
        return StreamingResponse(_sse(_events(request, s, r, msg, bp)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    final = None
    async for name, data in _events(request, s, r, msg, bp):
        if name == "error":
            status = 500 if data["error"]["type"] == "api_error" else 400
            raise APIError(status, data["error"]["message"], code="request_failed")
        final = data if name == "message_delta" else final
    if final is None:
        raise APIError(400, "the request was aborted before it finished", code="request_aborted")
    return JSONResponse({**msg, "content": r.blocks, **final["delta"], "usage": final["usage"]},
                        headers={**headers, **miss_header(r.usage)})


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, who: Caller = Depends(anthropic_caller)):
    """``{"input_tokens": N}``: the tokens of the prompt ``/v1/messages`` would render for the same body (the
    cache split is known only when a request runs: its usage's three input counts add up to N)."""
    aeng, ctx = request.app.state.engine, request_context(request, who)
    check_fields(body, ctx, count_only=True)
    chat, _ = chat_body(body, None)
    gen, _tools = chat_request(chat, ctx, aeng.new_request_id("count"))
    return {"input_tokens": len(await aeng.encode_chat(gen.messages, **gen.chat))}


async def _sse(events: AsyncIterator[tuple[str, dict]]) -> AsyncIterator[str]:
    async for name, data in events:
        yield f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _watch(request: Request, s: RequestStream) -> None:
    while not s.finished:
        if await request.is_disconnected():
            s.abort()
            return
        await asyncio.sleep(0.25)


async def _events(request: Request, s: RequestStream, r: Rendered, msg: dict, bp: int
                  ) -> AsyncIterator[tuple[str, dict]]:
    """The message's events in Anthropic's order; an ``error`` event (Anthropic's error body) ends a failed one."""
    start = {**msg, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": s.prompt_tokens, "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    yield "ping", {"type": "ping"}
    reason = stop = usage = None
    watcher = asyncio.create_task(_watch(request, s))
    try:
        async for out in s:
            for d in out.deltas:
                if d.finish_reason == "error":
                    yield "error", {"type": "error", "error": {"type": "invalid_request_error",
                                                               "message": d.error or "the request failed"}}
                    return
                for ev in r.feed(d.text, d.finish_reason is not None):
                    yield ev
                reason, stop = d.finish_reason or reason, d.stop_string or stop
            if out.finished:
                usage = r.usage = out.usage
                record_usage(request.scope, usage)
        if usage is None:  # aborted (the client went away): nothing more to send
            return
        u = usage_of(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, bp)
        yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": r.stop_reason(reason, stop),
                                                                   "stop_sequence": stop}, "usage": u}
        yield "message_stop", {"type": "message_stop"}
    except EngineDeadError as e:
        log.error("stream %s failed: %s", s.request_id, e)
        yield "error", {"type": "error", "error": {"type": "api_error", "message": "the engine failed; see the server log"}}
    finally:
        watcher.cancel()
        s.abort()
