"""What the server serves: ``/v1/models`` (the model and its LoRA adapters), ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` (vLLM's).

Handlers read ``request.app.state``: ``engine`` (the :class:`~kvkeeper.api.engine_client.async_engine.AsyncEngine`: its
``served`` snapshot, its commands), ``created``, ``refuse_unknown_fields``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..common.context import served_context
from ..common.errors import APIError
from ..common.messages import messages_of
from ..common.protocol import check_body
from ..common.served import ServedAdapter, ServedModels
from .protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()  # included behind the caller dependency (kvkeeper.api.common.auth): a key when keys are set


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
    ``continue_final_message``), with ``max_model_len``.  ``add_special_tokens`` (vLLM's): a prompt's ids with
    the tokenizer's own special tokens (e.g. a BOS; the default, as a completion's prompt is encoded) or without;
    true is refused for messages, whose special tokens come from the chat template."""
    ctx = served_context(request)
    check_body(body, ctx)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")
    chat_only = sorted({"tools", "add_generation_prompt", "continue_final_message"} & body.model_fields_set)
    if body.prompt is not None and chat_only:
        raise APIError(400, f"{chat_only[0]} applies to messages (the chat template), not to a text prompt: "
                            "send messages, or leave it out", param=chat_only[0])
    engine = request.app.state.engine
    if body.messages is not None and body.add_special_tokens:
        raise APIError(400, "add_special_tokens: the chat template itself adds the special tokens of messages; send "
                            "false or leave it out (it applies to a text prompt)", param="add_special_tokens")
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        msgs = messages_of(body.messages)
        chat = dict(add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None)
        ids = await engine.encode_chat(msgs, **chat)  # as a chat request gets them, off the engine thread
    else:
        text, special = body.prompt, body.add_special_tokens is not False  # vLLM's default for a prompt: true
        ids = await engine.encode_text(text, special)  # off the engine thread too
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


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """vLLM's ``GET /tokenizer_info``: the tokenizer's configuration (its ``tokenizer_config.json`` fields, special
    tokens as their text, without file paths), ``tokenizer_class`` and the ``chat_template`` requests are rendered
    with.  lm-eval's remote tokenizer reads ``eos_token`` / ``bos_token`` / ``pad_token`` and the template."""
    return await request.app.state.engine.call(lambda eng: _tokenizer_info(eng.tokenizer))


_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")  # server paths stay private


def _tokenizer_info(tok) -> dict:
    cfg = {k: _plain(v) for k, v in dict(getattr(tok, "init_kwargs", None) or {}).items() if k not in _PATH_FIELDS}
    cfg["tokenizer_class"] = cfg.get("tokenizer_class") or type(tok).__name__
    if getattr(tok, "chat_template", None):
        cfg["chat_template"] = tok.chat_template
    return cfg


def _plain(v):
    """A tokenizer config value as JSON: an ``AddedToken`` as its text, containers item by item."""
    if hasattr(v, "content"):
        return v.content
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)
