"""The OpenAI-compatible endpoints besides the completions (:mod:`kvkeeper.api.chat`,
:mod:`kvkeeper.api.completions`): models, tokenize, detokenize, health and metrics.

Handlers read ``request.app.state``: ``engine`` (the :class:`~kvkeeper.api.async_engine.AsyncEngine`: its
``served`` snapshot, its commands), ``created``, ``refuse_unknown_fields``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .errors import APIError
from .messages import messages_of
from .metrics import CONTENT_TYPE
from .protocol import check_body
from .request_parsing import served_context
from .schemas import DetokenizeRequest, TokenizeRequest
from .served import ServedAdapter, ServedModels

router = APIRouter()  # included behind the caller dependency (kvkeeper.api.auth): a key when keys are set
public_router = APIRouter()  # /health and /metrics: open to every client


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


def _model_card(served: ServedModels, created: int, adapter: ServedAdapter | None = None) -> dict:
    """The served model's card; a LoRA adapter's as vLLM lists one: ``root`` its directory, ``parent`` the
    base model's id."""
    ctx = served.max_model_len
    card = {"id": served.name, "object": "model", "created": created, "owned_by": "kvkeeper", "root": served.root,
            "parent": None, "context_length": ctx, "max_model_len": ctx}
    return card if adapter is None else {**card, "id": adapter.name, "root": adapter.path, "parent": served.name}


@router.get("/v1/models")
async def models(request: Request):
    """The base model, then every loaded LoRA adapter (by name)."""
    served, created = request.app.state.engine.served, request.app.state.created
    return {"object": "list", "data": [_model_card(served, created)] +
                                      [_model_card(served, created, a) for a in served.adapters]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    served = request.app.state.engine.served
    return _model_card(served, request.app.state.created, served.adapter(model_id))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """Token ids of a text ``prompt`` or of ``messages`` as the chat template renders them (the engine checks
    ``continue_final_message``), with ``max_model_len``."""
    ctx = served_context(request)
    check_body(body, ctx)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")
    chat_only = sorted({"tools", "add_generation_prompt", "continue_final_message"} & body.model_fields_set)
    if body.prompt is not None and chat_only:
        raise APIError(400, f"{chat_only[0]} applies to messages (the chat template), not to a text prompt: "
                            "send messages, or leave it out", param=chat_only[0])
    engine = request.app.state.engine
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        msgs = messages_of(body.messages)
        chat = dict(add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None)
        ids = await engine.encode_chat(msgs, **chat)  # as a chat request gets them, off the engine thread
    else:
        text = body.prompt
        ids = await engine.call(lambda eng: eng.tokenizer.encode(text))
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.served.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    """Token ids back to text (special tokens kept), as vLLM's ``/detokenize``; 400 for an id outside the
    vocabulary (no engine check covers decoding)."""
    ctx = served_context(request)
    check_body(body, ctx)
    ids, vocab = list(body.tokens), ctx.served.vocab_size
    bad = [t for t in ids if vocab is not None and not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    return {"prompt": await request.app.state.engine.call(lambda eng: eng.tokenizer.decode(ids))}
