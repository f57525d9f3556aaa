"""``POST /v1/completions``: the body converted into the engine's requests, one per prompt
(:func:`completion_request`, every rule checked once; several prompts: :func:`kvkeeper.api.common.streams.submit_all`;
the route and its rendering: :mod:`kvkeeper.api.completions.route`).

The extension fields are chat's (:mod:`kvkeeper.api.chat.route`) but for the chat-only ones; ``X-Context-Policy``
and ``X-Context-Budget`` are refused (a text completion has no messages for a policy to keep or drop).
"""

from __future__ import annotations

from ..common.context import RequestContext
from ..common.errors import APIError
from ..common.protocol import check_body, generation_fields, sampling_params, structured_output
from ..common.streams import GenerationRequest
from .protocol import CompletionRequest

MAX_PROMPTS = 128  # prompts in one request (each is an engine request: the queue's limit applies to all of them)


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    """The body's prompts: a string or a token-id list is one, a list of either is several (OpenAI's ``prompt``).
    Raises APIError for an empty prompt, an empty list or more than :data:`MAX_PROMPTS`."""
    p = body.prompt
    prompts = [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}: send them in several "
                            "requests", param="prompt")
    for k, one in enumerate(prompts):
        if not one:
            where = "the prompt is empty" if len(prompts) == 1 else f"prompt {k} of the list is empty"
            raise APIError(400, f"{where}: give at least one token or character", param="prompt")
    return prompts


def completion_request(body: CompletionRequest, ctx: RequestContext, request_id: str) -> list[GenerationRequest]:
    """The engine's requests for a text completion body: one per prompt (:func:`prompts_of`; with several, ids
    ``{request_id}-p{k}``).  The engine checks each prompt's token ids against the vocabulary and its length
    against the context window.  Raises APIError naming the field."""
    lora = check_body(body, ctx)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of must equal n ({body.n}): candidates are not ranked; ask for n choices instead",
                       param="best_of")
    prompts = prompts_of(body)
    if len(prompts) > 1 and ctx.session_id is not None:
        raise APIError(400, "X-Session-ID continues one conversation: send one prompt per request with it",
                       param="prompt")
    prompt_lp = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
        prompt_lp = max(prompt_lp or 0, body.logprobs)
    params = sampling_params(body, body.max_tokens, body.logprobs, structured_output(body), prompt_lp)
    fields = generation_fields(body, ctx, lora)
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-p{k}" for k in range(len(prompts))]
    return [GenerationRequest(rid, params, prompt=p, echo=body.echo, **fields) for rid, p in zip(ids, prompts)]
