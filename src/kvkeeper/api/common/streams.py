"""What crosses between the HTTP handlers (asyncio) and the engine thread: requests in, step outputs out.

Several prompts in one request (:func:`submit_all`; OpenAI's ``prompt`` as a list of strings or of token-id lists)
are one engine request per prompt, their streams merged into one (:class:`MergedStream`).
Choice ``i`` of prompt ``k`` is the response's choice ``k * n + i`` (OpenAI's and vLLM's numbering); the usage
is the prompts' summed (each prompt counted once whatever ``n``).  Streamed, each chunk carries one choice, as
with one prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from ...kvcache.namespace import Namespace
from ...sampling.params import SamplingParams


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
    tenant: str | None = None  # the caller's tenant (kvkeeper.api.common.auth): owns the session it names
    quota: Any = None  # the tenant's kvkeeper.sessions.manager.TenantQuota (None: no limits)
    # a retention hold on the prompt's head: (tokens, None for the whole prompt; seconds), None for none
    # (kvkeeper.kvcache.retention: cache_control breakpoints, prompt_cache_retention "24h")
    retention: tuple[int | None, float] | None = None
    cache_key: str | None = None  # the body's prompt_cache_key (kvkeeper.api.engine_client.cache_miss keys on it)


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
    cache_miss: Any = None  # why the request read less than its predecessor (cache_miss.CacheMiss), not in to_dict
    cache_write_tokens: int = 0  # prompt tokens it computed and left in the cache (tracker._cache_written)

    def to_dict(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens,
                                         "cache_write_tokens": self.cache_write_tokens}}
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
        prompts answers the prompt's own, :class:`kvkeeper.api.common.streams.MergedStream`)."""
        return self

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class MergedStream:
    """The streams of a request's prompts (``parts``, ``n`` choices each) as one :class:`RequestStream`-like
    stream: iterate for :class:`StepOutput` objects whose deltas carry the merged choice indices; the last one
    (``finished``) comes once every prompt's stream has ended, with their usage summed.  An error of one
    prompt's stream (``EngineDeadError``) is raised as that stream raises it; :meth:`abort` ends them all."""

    def __init__(self, request_id: str, parts: list[RequestStream], n: int):
        self.request_id, self.parts, self.n = request_id, parts, n
        self.prompt_token_ids = parts[0].prompt_token_ids
        self.prompt_tokens = sum(p.prompt_tokens for p in parts)
        self.trimmed_turns, self.context, self.echo_text = 0, None, None  # no session turns with several prompts
        self.finished = False
        self._next: dict[asyncio.Future, int] = {}
        self._usage: list[Usage | None] = [None] * len(parts)
        self._started = False

    def part(self, index: int) -> RequestStream:
        """The stream of the prompt that merged choice ``index`` belongs to."""
        return self.parts[index // self.n]

    def __aiter__(self):
        return self

    def _ask(self, k: int) -> None:
        self._next[asyncio.ensure_future(self.parts[k].__anext__())] = k

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        if not self._started:
            self._started = True
            for k in range(len(self.parts)):
                self._ask(k)
        done, _ = await asyncio.wait(self._next, return_when=asyncio.FIRST_COMPLETED)
        deltas = []
        for fut in sorted(done, key=self._next.__getitem__):  # prompt order within one step
            k = self._next.pop(fut)
            try:
                out = fut.result()
            except BaseException:
                self.abort()
                raise
            deltas += [dataclasses.replace(d, index=k * self.n + d.index) for d in out.deltas]
            if out.finished:
                self._usage[k] = out.usage
            else:
                self._ask(k)
        if self._next:
            return StepOutput(deltas)
        self.finished = True
        return StepOutput(deltas, True, _summed(self._usage))

    def abort(self) -> None:
        """Abort every prompt's request still running (no-op for those that finished)."""
        self.finished = True
        for fut in self._next:
            fut.cancel()
        self._next = {}
        for p in self.parts:
            p.abort()


def _summed(usages: list[Usage | None]) -> Usage:
    got = [u for u in usages if u is not None]
    return Usage(sum(u.prompt_tokens for u in got), sum(u.completion_tokens for u in got),
                 sum(u.cached_tokens for u in got), cache_write_tokens=sum(u.cache_write_tokens for u in got))


async def submit_all(engine, gens) -> MergedStream:
    """Submit one request per prompt (``gens``, the same ``n`` each) and merge their streams; a prompt the engine
    refuses (a 400 for its length or ids, a full queue) aborts those already accepted and raises as
    :meth:`~kvkeeper.api.engine_client.async_engine.AsyncEngine.submit` does."""
    parts: list[RequestStream] = []
    try:
        for g in gens:
            parts.append(await engine.submit(g))
    except BaseException:
        for p in parts:
            p.abort()
        raise
    return MergedStream(gens[0].request_id.rsplit("-p", 1)[0], parts, len(gens[0].params))
