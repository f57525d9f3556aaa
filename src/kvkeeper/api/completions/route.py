"""``POST /v1/completions``: the route, and how its output is rendered (text, legacy logprobs, the echoed prompt);
the body's conversion into the engine's requests: :mod:`kvkeeper.api.completions.serving`."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ..common.access_log import record_usage
from ..common.auth import Caller, caller
from ..common.context import request_context
from ..common.rendering import (Collected, Renderer, continuous_usage, finish_reason, include_usage, respond, usage_of,
                                vllm_prompt_logprobs)
from ..common.streams import ChoiceDelta, RequestStream
from .protocol import CompletionRequest
from .serving import completion_request

router = APIRouter()  # included behind the caller dependency (kvkeeper.api.common.auth): a key when keys are set


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, who: Caller = Depends(caller)):
    aeng = request.app.state.engine
    ctx = request_context(request, who, chat=False)
    rid = aeng.new_request_id("cmpl")
    gens = completion_request(body, ctx, rid)
    record_usage(request.scope, user=body.user or body.safety_identifier)
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": body.model or ctx.served.name}
    return await respond(request, aeng, gens if len(gens) > 1 else gens[0], body.stream, include_usage(body),
                         _renderer(base, body, len(gens)), continuous=continuous_usage(body))


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
    """Per-choice state of a completions response: the echoed prompt (text, logprobs) each choice starts with.
    Choice ``i`` belongs to prompt ``i // n`` (:func:`kvkeeper.api.common.streams.submit_all`); ``s.part(i)`` is
    that prompt's stream."""

    def __init__(self, body: CompletionRequest, prompts: int):
        self.body = body
        self.want_lp, self.want_ids = body.logprobs is not None, body.return_token_ids
        self.offsets = [0] * (body.n * prompts)
        self.started: set[int] = set()
        self.prompt_lp: dict[int, list[dict]] = {}  # by prompt

    def head(self, s: RequestStream, i: int) -> tuple[str, list[dict]]:
        """(text, logprob entries) of the echoed prompt before choice ``i``'s first output ('', [] without echo)."""
        if not self.body.echo:
            return "", []
        echo = s.part(i).echo_text or ""
        if not self.want_lp:
            return echo, []
        k = self.body.logprobs  # the prompt may have been scored with more (prompt_logprobs): each field its own
        return echo, [e if e["top_logprobs"] is None else {**e, "top_logprobs": e["top_logprobs"][:k]}
                      for e in self.prompt_lp.get(i // self.body.n) or []]

    def extras(self, s: RequestStream, i: int, token_ids: list[int], first: bool) -> dict:
        """``prompt_logprobs`` (vLLM) and, when asked, ``prompt_token_ids`` (first chunk only) and ``token_ids``."""
        out = {}
        if self.body.prompt_logprobs is not None and first:
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_lp.get(i // self.body.n),
                                                          self.body.prompt_logprobs)
        if self.want_ids:
            out.update({"prompt_token_ids": s.part(i).prompt_token_ids} if first else {}, token_ids=token_ids)
        return out


def _renderer(base: dict, body: CompletionRequest, prompts: int) -> Renderer:
    cc = _CompletionChoices(body, prompts)

    def chunk(s: RequestStream, d: ChoiceDelta) -> dict:
        if d.prompt_logprobs is not None:
            cc.prompt_lp[d.index // body.n] = d.prompt_logprobs
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
        cc.prompt_lp = {i // body.n: lp for i, lp in got.prompt_logprobs_at.items()}
        choices = []
        for i in range(body.n * prompts):
            text, entries = cc.head(s, i)
            choices.append({"index": i, "text": text + got.texts[i],
                            "logprobs": legacy_logprobs(entries + got.logprobs[i]) if cc.want_lp else None,
                            "finish_reason": finish_reason(got.reasons[i]),
                            **cc.extras(s, i, got.token_ids[i], True)})
        return {**base, "choices": choices, "usage": usage_of(got)}

    return Renderer(base, chunk, lambda s: [], whole)
