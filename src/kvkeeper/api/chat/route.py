"""``POST /v1/chat/completions``: the route, and how its output is rendered (messages, deltas, tool calls); the
body's conversion into the engine's request: :mod:`kvkeeper.api.chat.serving`."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ..common.access_log import record_usage
from ..common.auth import Caller, caller
from ..common.context import body_session, request_context
from ..common.rendering import (Collected, Renderer, continuous_usage, finish_reason, include_usage, respond, usage_of,
                                vllm_prompt_logprobs)
from ..common.streams import ChoiceDelta, RequestStream
from ..common.tools import ChoiceCalls, ToolUse, finish_with_calls
from .protocol import ChatCompletionRequest
from .serving import chat_request

router = APIRouter()  # included behind the caller dependency (kvkeeper.api.common.auth): a key when keys are set


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, who: Caller = Depends(caller)):
    aeng = request.app.state.engine
    ctx = body_session(request_context(request, who), body.conversation_id)
    gen, tools = chat_request(body, ctx, aeng.new_request_id("chatcmpl"))
    record_usage(request.scope, user=body.user or body.safety_identifier)
    base = {"id": gen.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.model or ctx.served.name}
    return await respond(request, aeng, gen, body.stream, include_usage(body), _renderer(base, body, tools),
                         continuous=continuous_usage(body))


def _chat_delta(d: ChoiceDelta, calls: list[ChoiceCalls] | None) -> tuple[dict, str | None]:
    """A streamed choice's ``delta`` and finish reason (tool calls split from the content when parsed)."""
    reason = finish_reason(d.finish_reason)
    if calls is None:
        return ({"content": d.text} if d.text else {}), reason
    content, tc = calls[d.index].feed(d.text, d.finish_reason is not None)
    delta = {**({"content": content} if content else {}), **({"tool_calls": tc} if tc else {})}
    return delta, finish_with_calls(reason, calls[d.index])


def _chat_message(text: str, reason: str | None, tools: ToolUse | None) -> tuple[dict, str | None]:
    """A whole choice's ``message`` and finish reason."""
    if tools is None or not tools.parses:
        return {"role": "assistant", "content": text}, finish_reason(reason)
    calls = ChoiceCalls()
    content, tc = calls.feed(text, True, streamed=False)
    msg = {"role": "assistant", "content": content or None, **({"tool_calls": tc} if tc else {})}
    return msg, finish_with_calls(finish_reason(reason), calls)


def _renderer(base: dict, body: ChatCompletionRequest, tools: ToolUse | None) -> Renderer:
    want_lp, want_ids = body.logprobs, body.return_token_ids
    calls = [ChoiceCalls() for _ in range(body.n)] if tools is not None and tools.parses else None

    def chunk(s: RequestStream, d: ChoiceDelta) -> dict | None:
        delta, reason = _chat_delta(d, calls)
        if calls is not None and not delta and reason is None and not (want_lp and d.logprobs) and not want_ids:
            return None  # text held back while it may open a tool call
        c = {"index": d.index, "delta": delta, "logprobs": {"content": d.logprobs} if want_lp and d.logprobs else None,
             "finish_reason": reason}
        return {**base, "choices": [{**c, "token_ids": d.token_ids} if want_ids else c]}

    def first(s: RequestStream) -> list[dict]:
        ids = {"prompt_token_ids": s.prompt_token_ids} if want_ids else {}
        return [{**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}], **(ids if i == 0 else {})} for i in range(body.n)]

    def whole(s: RequestStream, got: Collected) -> dict:
        choices = []
        for i in range(body.n):
            msg, reason = _chat_message(got.texts[i], got.reasons[i], tools)
            choices.append({"index": i, "message": msg, "logprobs": {"content": got.logprobs[i]} if want_lp else None,
                            "finish_reason": reason, **({"token_ids": got.token_ids[i]} if want_ids else {})})
        ids = {"prompt_token_ids": s.prompt_token_ids} if want_ids else {}
        plp = ({"prompt_logprobs": vllm_prompt_logprobs(got.prompt_logprobs, body.prompt_logprobs)}
               if body.prompt_logprobs is not None else {})
        return {**base, "object": "chat.completion", "choices": choices, "usage": usage_of(got), **ids, **plp}

    return Renderer(base, chunk, first, whole)
