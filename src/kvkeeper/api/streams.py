"""What crosses between the HTTP handlers (asyncio) and the engine thread: requests in, step outputs out."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from ..sampling.params import SamplingParams
from ..kvcache.namespace import Namespace


class EngineDeadError(RuntimeError):
    """The engine thread failed or stopped; requests in flight are ended with this error."""


@dataclass
class GenerationRequest:
    """One HTTP request: ``messages`` (chat) or ``prompt`` (text or token ids), ``n`` sampling params."""

    request_id: str
    params: list[SamplingParams]
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    prompt_ids: list[int] | None = None  # the prompt's checked token ids, tokenized off the engine thread (or None)
    namespace: Namespace | None = None  # the cache namespace (None: the engine's own), before the adapter's
    lora: str | None = None  # the LoRA adapter ``model`` names: the engine thread puts the namespace under it
    session_id: str | None = None
    compression: Any = None  # kvkeeper.kvcache.compression.KVCompression
    session_priority: int | None = None  # X-Session-Priority: higher is trimmed later by the circuit breaker
    chat: dict = field(default_factory=dict)  # how messages are rendered: add_generation_prompt, tools...
    context: tuple[str | None, int | None] | None = None  # (policy, budget) a session's turn runs under
    session_compression: tuple[str | None, float | None] | None = None  # (policy, ratio): kvkeeper.sessions.compress
    echo: bool = False  # completions: the prompt's text comes back before each choice's text
    tenant: str | None = None  # the caller's tenant (kvkeeper.api.auth): owns the session it names
    quota: Any = None  # the tenant's kvkeeper.sessions.manager.TenantQuota (None: no limits)


@dataclass
class ChoiceDelta:
    """What one choice produced since the last :class:`StepOutput`.

    token_ids: the new token ids.  logprobs: entries ``{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}]}`` when the request asked for them.
    finish_reason: "stop", "length", "abort" or "error" (then ``error`` says why), None while running.
    prompt_logprobs: once, on the first choice's first delta when the request asked for them: per prompt
    token an entry as in ``logprobs`` plus ``token_id`` and ``rank`` (``logprob`` None for the first token).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict]
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[dict] | None = None
    stop_string: str | None = None  # the stop string that ended the choice (finish_reason "stop"), None for another end


@dataclass
class Usage:
    """Token counts of a whole request (the prompt counted once whatever ``n``).  accepted_prediction_tokens /
    rejected_prediction_tokens: with a ``prediction`` (OpenAI's Predicted Outputs), the draft tokens taken from it
    that verification accepted / rejected, over all choices (None without a prediction)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    session_compression: dict | None = None  # a session turn's compression report (kvkeeper.sessions.compress)

    def to_dict(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.accepted_prediction_tokens is not None:
            out["completion_tokens_details"] = {"accepted_prediction_tokens": self.accepted_prediction_tokens,
                                                "rejected_prediction_tokens": self.rejected_prediction_tokens}
        if self.session_compression is not None:  # extension: what the session's KV kept, per layer
            out["session_compression"] = self.session_compression
        return out


@dataclass
class StepOutput:
    deltas: list[ChoiceDelta]
    finished: bool = False
    usage: Usage | None = None


@dataclass
class Accepted:
    """What the engine thread answers when it takes a request: prompt ids and turns the breaker trimmed."""

    prompt_token_ids: list[int]
    trimmed_turns: int = 0
    echo_text: str | None = None  # the prompt's text, when the request echoes it
    context: str | None = None  # a session turn's context report (the X-KVKeeper-Context header)


class RequestStream:
    """The asynchronous output of one accepted request: iterate for :class:`StepOutput` objects.

    prompt_token_ids: the ids the request prefills (a session turn's, which reuse its own tokens);
    trimmed_turns: oldest turns the circuit breaker left out of a degraded session's prompt.
    """

    def __init__(self, request_id: str, accepted: Accepted, q: asyncio.Queue, abort: Callable[[str], None]):
        self.request_id = request_id
        self.prompt_token_ids = accepted.prompt_token_ids
        self.prompt_tokens = len(accepted.prompt_token_ids)
        self.trimmed_turns = accepted.trimmed_turns
        self.echo_text = accepted.echo_text
        self.context = accepted.context
        self.finished = False
        self._q = q
        self._abort = abort

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def part(self, index: int) -> "RequestStream":
        """The stream of the prompt choice ``index`` belongs to: this one (a merged stream of several
        prompts answers the prompt's own, :class:`kvkeeper.api.batch.MergedStream`)."""
        return self

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)
