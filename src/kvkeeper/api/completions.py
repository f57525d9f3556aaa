"""``POST /v1/completions``: the body converted into the engine's request (:func:`completion_request`, every
rule checked once), the route, and how its output is rendered (text, legacy logprobs, the echoed prompt).

The extension fields are chat's (:mod:`kvkeeper.api.chat`) but for the chat-only ones; ``X-Context-Policy``
and ``X-Context-Budget`` are refused (a text completion has no messages for a policy to keep or drop).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from .access_log import record_usage
from .auth import Caller, caller
from .errors import APIError
from .protocol import check_body, generation_fields, sampling_params, structured_output
from .request_parsing import RequestContext, request_context
from .responses import Collected, Renderer, finish_reason, include_usage, respond, usage_of, vllm_prompt_logprobs
from .schemas import CompletionRequest
from .streams import ChoiceDelta, GenerationRequest, RequestStream

router = APIRouter()  # included behind the caller dependency (kvkeeper.api.auth): a key when keys are set


def completion_request(body: CompletionRequest, ctx: RequestContext, request_id: str) -> GenerationRequest:
    """The engine's request for a text completion body.  The engine checks the prompt's token ids against
    the vocabulary and its length against the context window.  Raises APIError naming the field."""
    lora = check_body(body, ctx)
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
    prompt_lp = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
        prompt_lp = max(prompt_lp or 0, body.logprobs)
    params = sampling_params(body, body.max_tokens, body.logprobs, structured_output(body), prompt_lp)
    return GenerationRequest(request_id, params, prompt=prompt, echo=body.echo, **generation_fields(body, ctx, lora))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, who: Caller = Depends(caller)):
    aeng = request.app.state.engine
    ctx = request_context(request, who, chat=False)
    gen = completion_request(body, ctx, aeng.new_request_id("cmpl"))
    record_usage(request.scope, user=body.user or body.safety_identifier)
    base = {"id": gen.request_id, "object": "text_completion", "created": int(time.time()),
            "model": body.model or ctx.served.name}
    return await respond(request, aeng, gen, body.stream, include_usage(body), _renderer(base, body))


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


def _renderer(base: dict, body: CompletionRequest) -> Renderer:
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
        return {**base, "choices": choices, "usage": usage_of(got)}

    return Renderer(base, chunk, lambda s: [], whole)
