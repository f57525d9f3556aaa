"""The OpenAI-compatible endpoints: chat and text completions, models, tokenize, health and metrics.

Handlers read the server's parts from ``request.app.state``: ``engine`` (the
:class:`~kvkeeper.api.async_engine.AsyncEngine`), ``model_name``, ``created``, ``base_ns``,
``refuse_unknown_fields``.  Extension fields (vLLM's where it has one): ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``bad_words``, ``ignore_eos``, ``cache_salt``,
``return_token_ids`` (prompt and output token ids in the response), ``prompt_logprobs``,
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` / ``structured_outputs``,
``add_generation_prompt``, ``continue_final_message``, ``kv_compression``, ``context_policy`` /
``context_budget`` (a session's context policy, also as ``X-Context-Policy`` / ``X-Context-Budget``).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ..sampling.structured import StructuredOutput
from .access_log import record_usage
from .auth import Caller, caller
from .errors import APIError
from .metrics import CONTENT_TYPE
from .request_parsing import (check_fields, check_model, compression_of, context_of, loaded_adapters, messages_of,
                              namespace_of, refuse_context_headers, sampling_of, session_id_of, session_priority_of,
                              structured_of)
from .responses import Collected, Renderer, finish_reason, respond
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, _SamplingFields
from .streams import ChoiceDelta, GenerationRequest, RequestStream
from .tools import ChoiceCalls, ToolUse, finish_with_calls, tool_use_of

router = APIRouter()  # included behind the caller dependency (kvkeeper.api.auth): a key when keys are set
public_router = APIRouter()  # /health and /metrics: open to every client


def _request_fields(body: _SamplingFields, request: Request, who: Caller) -> dict:
    """The GenerationRequest fields both completions endpoints take from the caller, headers and extension fields."""
    st = request.app.state
    record_usage(request.scope, user=body.user or body.safety_identifier)
    return dict(namespace=namespace_of(body, request, st.base_ns, who.tenant), session_id=session_id_of(request),
                compression=compression_of(body), session_priority=session_priority_of(request), tenant=who.tenant,
                quota=who.quota)


def _include_usage(body: _SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _usage(got: Collected):
    return got.usage.to_dict() if got.usage else None


def vllm_prompt_logprobs(entries: list[dict] | None, k: int) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token
    ``{"token id": {"logprob", "rank", "decoded_token"}}`` for the prompt's token and the top ``k`` ones."""
    if entries is None:
        return None
    out: list[dict | None] = [None]
    for e in entries[1:]:
        d = {str(e["token_id"]): {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": e["token"]}}
        for r, t in enumerate(e["top_logprobs"][:k], 1):
            d.setdefault(str(t["token_id"]), {"logprob": t["logprob"], "rank": r, "decoded_token": t["token"]})
        out.append(d)
    return out


@public_router.get("/health")
async def health(request: Request):
    if not request.app.state.engine.alive:
        return JSONResponse({"status": "error", "detail": "the engine thread is not running"}, status_code=503)
    return {"status": "ok"}


@public_router.head("/health", include_in_schema=False)  # load balancers' probes (one OpenAPI operation: GET)
async def health_head(request: Request):
    return await health(request)


@public_router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.engine.metrics.render(), media_type=CONTENT_TYPE)


def _model_card(request: Request) -> dict:
    st = request.app.state
    ctx = st.engine.context_length
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "kvkeeper",
            "root": str(getattr(st.engine.engine, "model_path", st.model_name)), "parent": None,
            "context_length": ctx, "max_model_len": ctx}


def _adapter_card(request: Request, adapter) -> dict:
    """A LoRA adapter's card, as vLLM lists one: ``root`` its directory, ``parent`` the base model's id."""
    card = _model_card(request)
    return {**card, "id": adapter.name, "root": str(adapter.path), "parent": card["id"]}


@router.get("/v1/models")
async def models(request: Request):
    """The base model, then every loaded LoRA adapter (by name)."""
    loras = list(loaded_adapters(request).values())
    return {"object": "list", "data": [_model_card(request)] + [_adapter_card(request, a) for a in loras]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    st = request.app.state
    loras = loaded_adapters(request)
    check_model(model_id, st.model_name, loras)
    return _model_card(request) if model_id == st.model_name else _adapter_card(request, loras[model_id])


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


def _chat_renderer(base: dict, body: ChatCompletionRequest, tools: ToolUse | None) -> Renderer:
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
        return {**base, "object": "chat.completion", "choices": choices, "usage": _usage(got), **ids, **plp}

    return Renderer(base, chunk, first, whole)


def _chat_constraint(body: ChatCompletionRequest, tools: ToolUse | None) -> StructuredOutput | None:
    """The output's grammar: the tool calls' or the requested format's (both at once is a 400)."""
    fmt = structured_of(body)
    calls = tools.structured() if tools is not None else None
    if fmt is not None and calls is not None:
        raise APIError(400, f"{fmt.param} and tools (tool_choice {tools.choice}) both constrain the output; send "
                            "tool_choice \"none\" or drop the output format", param=fmt.param)
    return fmt or calls


def _check_chat(body: ChatCompletionRequest, request: Request) -> None:
    check_model(body.model, request.app.state.model_name, loaded_adapters(request))
    check_fields(body, request)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message continues the last message: send add_generation_prompt=false "
                            "with it", param="continue_final_message")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not streamed on chat; send stream=false, or use /v1/completions",
                       param="prompt_logprobs")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, who: Caller = Depends(caller)):
    st = request.app.state
    _check_chat(body, request)
    messages, tools = messages_of(body), tool_use_of(body)
    params = sampling_of(body, body.max_completion_tokens or body.max_tokens,
                         (body.top_logprobs or 0) if body.logprobs else None, _chat_constraint(body, tools),
                         body.prompt_logprobs)
    chat = dict(add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
                tools=tools.tools if tools is not None else None)
    rid = st.engine.new_request_id("chatcmpl")
    gen = GenerationRequest(rid, params, messages=messages, chat=chat, context=context_of(body, request),
                            **_request_fields(body, request, who))
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.model or st.model_name}
    return await respond(request, st.engine, gen, body.stream, _include_usage(body), _chat_renderer(base, body, tools))


def legacy_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The completions API's logprobs object (tokens, token_logprobs, top_logprobs, text_offset); an echoed
    prompt's first token has None for its logprob and top_logprobs."""
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else _top_with_chosen(e) for e in entries],
            "text_offset": offsets}


def _top_with_chosen(e: dict) -> dict:
    """An entry's ``{token: logprob}`` top dict plus the token itself (OpenAI: up to logprobs + 1 entries)."""
    top = {t["token"]: t["logprob"] for t in e["top_logprobs"]}
    top.setdefault(e["token"], e["logprob"])
    return top


class _CompletionChoices:
    """Per-choice state of a completions response: the echoed prompt (text, logprobs) each choice starts with."""

    def __init__(self, body: CompletionRequest):
        self.body = body
        self.want_lp, self.want_ids = body.logprobs is not None, body.return_token_ids
        self.offsets = [0] * body.n
        self.started: set[int] = set()
        self.prompt_lp: list[dict] | None = None

    def head(self, s: RequestStream, i: int) -> tuple[str, list[dict]]:
        """(text, logprob entries) of the echoed prompt before choice ``i``'s first output ('', [] without echo)."""
        if not self.body.echo:
            return "", []
        if not self.want_lp:
            return s.echo_text or "", []
        k = self.body.logprobs  # the prompt may have been scored with more (prompt_logprobs): each field its own
        return s.echo_text or "", [e if e["top_logprobs"] is None else {**e, "top_logprobs": e["top_logprobs"][:k]}
                                   for e in self.prompt_lp or []]

    def extras(self, s: RequestStream, i: int, token_ids: list[int], first: bool) -> dict:
        """``prompt_logprobs`` (vLLM) and, when asked, ``prompt_token_ids`` (first chunk only) and ``token_ids``."""
        out = {}
        if self.body.prompt_logprobs is not None and first:
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_lp, self.body.prompt_logprobs)
        if self.want_ids:
            out.update({"prompt_token_ids": s.prompt_token_ids} if first else {}, token_ids=token_ids)
        return out


def _completion_renderer(base: dict, body: CompletionRequest) -> Renderer:
    cc = _CompletionChoices(body)

    def chunk(s: RequestStream, d: ChoiceDelta) -> dict:
        if d.prompt_logprobs is not None:
            cc.prompt_lp = d.prompt_logprobs
        first = d.index not in cc.started
        cc.started.add(d.index)
        text, entries = cc.head(s, d.index) if first else ("", [])
        entries = entries + d.logprobs
        lp = legacy_logprobs(entries, cc.offsets[d.index]) if cc.want_lp and entries else None
        cc.offsets[d.index] += sum(len(e["token"]) for e in entries)
        return {**base, "choices": [{"index": d.index, "text": text + d.text, "logprobs": lp,
                                     "finish_reason": finish_reason(d.finish_reason),
                                     **cc.extras(s, d.index, d.token_ids, first)}]}

    def whole(s: RequestStream, got: Collected) -> dict:
        cc.prompt_lp = got.prompt_logprobs
        choices = []
        for i in range(body.n):
            text, entries = cc.head(s, i)
            choices.append({"index": i, "text": text + got.texts[i],
                            "logprobs": legacy_logprobs(entries + got.logprobs[i]) if cc.want_lp else None,
                            "finish_reason": finish_reason(got.reasons[i]),
                            **cc.extras(s, i, got.token_ids[i], True)})
        return {**base, "choices": choices, "usage": _usage(got)}

    return Renderer(base, chunk, lambda s: [], whole)


def _completion_prompt(body: CompletionRequest, request: Request) -> str | list[int]:
    check_model(body.model, request.app.state.model_name, loaded_adapters(request))
    check_fields(body, request)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of must equal n ({body.n}): candidates are not ranked; ask for n choices instead",
                       param="best_of")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    return prompt


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, who: Caller = Depends(caller)):
    st = request.app.state
    refuse_context_headers(request)
    prompt = _completion_prompt(body, request)
    prompt_lp = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
        prompt_lp = max(prompt_lp or 0, body.logprobs)
    params = sampling_of(body, body.max_tokens, body.logprobs, structured_of(body), prompt_lp)
    rid = st.engine.new_request_id("cmpl")
    gen = GenerationRequest(rid, params, prompt=prompt, echo=body.echo, **_request_fields(body, request, who))
    base = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": body.model or st.model_name}
    return await respond(request, st.engine, gen, body.stream, _include_usage(body), _completion_renderer(base, body))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    engine = request.app.state.engine
    check_model(body.model, request.app.state.model_name, loaded_adapters(request))
    check_fields(body, request)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")
    chat_only = sorted({"tools", "add_generation_prompt", "continue_final_message"} & body.model_fields_set)
    if body.prompt is not None and chat_only:
        raise APIError(400, f"{chat_only[0]} applies to messages (the chat template), not to a text prompt: "
                            "send messages, or leave it out", param=chat_only[0])
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        msgs = messages_of(body)
        chat = dict(add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None)
        ids = await engine.call(lambda eng: eng.encode_chat(msgs, **chat))
    else:
        text = body.prompt
        ids = await engine.call(lambda eng: eng.tokenizer.encode(text))
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.context_length}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    """Token ids back to text (special tokens kept), as vLLM's ``/detokenize``; 400 for an id outside the vocabulary."""
    engine = request.app.state.engine
    check_model(body.model, request.app.state.model_name, loaded_adapters(request))
    check_fields(body, request)
    ids = list(body.tokens)

    def decode(eng) -> str:
        vocab = eng.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return eng.tokenizer.decode(ids)

    return {"prompt": await engine.call(decode)}
