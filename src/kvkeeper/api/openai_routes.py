"""The OpenAI-compatible endpoints: chat and text completions, models, tokenize, health and metrics.

Handlers read the server's parts from ``request.app.state``: ``engine`` (the
:class:`~kvkeeper.api.async_engine.AsyncEngine`), ``model_name``, ``created``, ``base_ns``.
Extension fields (vLLM's where it has one): ``top_k``, ``ignore_eos``, ``cache_salt``,
``return_token_ids`` (prompt and output token ids in the response), ``kv_compression``.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .errors import APIError
from .metrics import CONTENT_TYPE
from .request_parsing import (check_model, compression_of, messages_of, namespace_of, sampling_of,
                              session_id_of, session_priority_of)
from .responses import Collected, Renderer, finish_reason, respond
from .schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest, _SamplingFields
from .streams import ChoiceDelta, GenerationRequest, RequestStream

router = APIRouter()


def _request_fields(body: _SamplingFields, request: Request) -> dict:
    """The GenerationRequest fields both completions endpoints take from headers and extension fields."""
    st = request.app.state
    return dict(namespace=namespace_of(body, request, st.base_ns), session_id=session_id_of(request),
                compression=compression_of(body), session_priority=session_priority_of(request))


def _include_usage(body: _SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _usage(got: Collected):
    return got.usage.to_dict() if got.usage else None


@router.get("/health")
async def health(request: Request):
    if not request.app.state.engine.alive:
        return JSONResponse({"status": "error", "detail": "the engine thread is not running"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.engine.metrics.render(), media_type=CONTENT_TYPE)


def _model_card(request: Request) -> dict:
    st = request.app.state
    ctx = st.engine.context_length
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "kvkeeper",
            "context_length": ctx, "max_model_len": ctx}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    check_model(model_id, request.app.state.model_name)
    return _model_card(request)


def _chat_renderer(base: dict, body: ChatCompletionRequest) -> Renderer:
    want_lp, want_ids = body.logprobs, body.return_token_ids

    def chunk(s: RequestStream, d: ChoiceDelta) -> dict:
        c = {"index": d.index, "delta": {"content": d.text} if d.text else {},
             "logprobs": {"content": d.logprobs} if want_lp and d.logprobs else None,
             "finish_reason": finish_reason(d.finish_reason)}
        return {**base, "choices": [{**c, "token_ids": d.token_ids} if want_ids else c]}

    def first(s: RequestStream) -> list[dict]:
        ids = {"prompt_token_ids": s.prompt_token_ids} if want_ids else {}
        return [{**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}], **(ids if i == 0 else {})} for i in range(body.n)]

    def whole(s: RequestStream, got: Collected) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": got.texts[i]},
                    "logprobs": {"content": got.logprobs[i]} if want_lp else None,
                    "finish_reason": finish_reason(got.reasons[i]),
                    **({"token_ids": got.token_ids[i]} if want_ids else {})} for i in range(body.n)]
        ids = {"prompt_token_ids": s.prompt_token_ids} if want_ids else {}
        return {**base, "object": "chat.completion", "choices": choices, "usage": _usage(got), **ids}

    return Renderer(base, chunk, first, whole)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    st = request.app.state
    check_model(body.model, st.model_name)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    params = sampling_of(body, body.max_completion_tokens or body.max_tokens,
                         (body.top_logprobs or 0) if body.logprobs else None)
    rid = st.engine.new_request_id("chatcmpl")
    gen = GenerationRequest(rid, params, messages=messages_of(body), **_request_fields(body, request))
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": st.model_name}
    return await respond(request, st.engine, gen, body.stream, _include_usage(body), _chat_renderer(base, body))


def legacy_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The completions API's logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _completion_renderer(base: dict, body: CompletionRequest) -> Renderer:
    want_lp, want_ids = body.logprobs is not None, body.return_token_ids
    offsets = [0] * body.n

    prompt_sent: set[int] = set()

    def ids_of(s: RequestStream, i: int, token_ids: list[int], streamed: bool = False) -> dict:
        """``prompt_token_ids`` (streamed: in a choice's first chunk only) and ``token_ids`` when asked for."""
        if not want_ids:
            return {}
        first = not streamed or i not in prompt_sent
        prompt_sent.add(i)
        return {**({"prompt_token_ids": s.prompt_token_ids} if first else {}), "token_ids": token_ids}

    def chunk(s: RequestStream, d: ChoiceDelta) -> dict:
        lp = legacy_logprobs(d.logprobs, offsets[d.index]) if want_lp and d.logprobs else None
        offsets[d.index] += sum(len(e["token"]) for e in d.logprobs)
        return {**base, "choices": [{"index": d.index, "text": d.text, "logprobs": lp,
                                     "finish_reason": finish_reason(d.finish_reason),
                                     **ids_of(s, d.index, d.token_ids, streamed=True)}]}

    def whole(s: RequestStream, got: Collected) -> dict:
        return {**base, "choices": [{"index": i, "text": got.texts[i],
                                     "logprobs": legacy_logprobs(got.logprobs[i]) if want_lp else None,
                                     "finish_reason": finish_reason(got.reasons[i]),
                                     **ids_of(s, i, got.token_ids[i])} for i in range(body.n)],
                "usage": _usage(got)}

    return Renderer(base, chunk, lambda s: [], whole)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    st = request.app.state
    check_model(body.model, st.model_name)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    params = sampling_of(body, body.max_tokens, body.logprobs)
    rid = st.engine.new_request_id("cmpl")
    gen = GenerationRequest(rid, params, prompt=prompt, **_request_fields(body, request))
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": st.model_name}
    return await respond(request, st.engine, gen, body.stream, _include_usage(body), _completion_renderer(base, body))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    engine = request.app.state.engine
    check_model(body.model, request.app.state.model_name)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        msgs, agp = messages_of(body), body.add_generation_prompt
        ids = await engine.call(lambda eng: eng.encode_chat(msgs, add_generation_prompt=agp))
    else:
        text = body.prompt
        ids = await engine.call(lambda eng: eng.tokenizer.encode(text))
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.context_length}
