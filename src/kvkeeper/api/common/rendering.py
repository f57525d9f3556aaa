"""Turning a request's stream into an HTTP response: collected JSON, or server-sent events.

The chat and text completions' rendering: both go through :func:`respond`, each with its own chunk and body
builders (:class:`Renderer`); the Responses API collects its stream with :func:`collect` and renders its own events
(:mod:`kvkeeper.api.responses.events`).  A client that goes away mid-request aborts it (its blocks are freed).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .access_log import record_usage
from .errors import APIError, error_body
from .streams import submit_all
from .streams import ChoiceDelta, EngineDeadError, GenerationRequest, RequestStream, Usage

log = logging.getLogger(__name__)


def finish_reason(r: str | None) -> str | None:
    """The OpenAI finish reason of an engine one ("abort" stays, "error" never reaches here)."""
    return r if r in (None, "stop", "length", "abort") else "stop"


def include_usage(body) -> bool:
    """Whether a streamed response ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def continuous_usage(body) -> bool:
    """Whether every streamed chunk carries its choice's usage so far (vLLM's
    ``stream_options.continuous_usage_stats``, which needs ``include_usage``: checked by the protocol)."""
    return include_usage(body) and bool(body.stream_options.continuous_usage_stats)


def usage_of(got: "Collected") -> dict | None:
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


def choice_error(d: ChoiceDelta) -> APIError:
    return APIError(400, d.error or "the request failed", code="request_failed")


@dataclass
class Collected:
    """A whole request's output, per choice: text, logprob entries, token ids, finish reason; and its usage."""

    n: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[list[dict]] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    usage: Usage | None = None
    prompt_logprobs: list[dict] | None = None
    prompt_logprobs_at: dict[int, list[dict]] = field(default_factory=dict)  # by the choice they came with

    def __post_init__(self):
        self.texts, self.reasons = [""] * self.n, [None] * self.n
        self.logprobs, self.token_ids = [[] for _ in range(self.n)], [[] for _ in range(self.n)]

    def add(self, d: ChoiceDelta) -> None:
        self.texts[d.index] += d.text
        self.logprobs[d.index].extend(d.logprobs)
        self.token_ids[d.index].extend(d.token_ids)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
            self.prompt_logprobs_at[d.index] = d.prompt_logprobs
        if d.finish_reason:
            self.reasons[d.index] = d.finish_reason


async def _watch_disconnect(request: Request, stream: RequestStream) -> None:
    while not stream.finished:
        if await request.is_disconnected():
            log.info("client went away; aborting %s", stream.request_id)
            stream.abort()
            return
        await asyncio.sleep(0.25)


async def collect(request: Request, stream: RequestStream, n: int) -> Collected:
    """Run a request to the end; raises :class:`APIError` (400) when a choice failed."""
    out = Collected(n)
    watcher = asyncio.create_task(_watch_disconnect(request, stream))
    try:
        async for step in stream:
            for d in step.deltas:
                if d.finish_reason == "error":
                    raise choice_error(d)
                out.add(d)
            if step.finished:
                out.usage = step.usage
                record_usage(request.scope, step.usage)
    finally:
        watcher.cancel()
        stream.abort()
    return out


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(stream: RequestStream, make_chunk: Callable[[ChoiceDelta], dict | None], first_chunks: list[dict],
                  include_usage: bool, base: dict, scope: dict) -> AsyncIterator[str]:
    try:
        for c in first_chunks:
            yield sse(c)
        async for out in stream:
            for d in out.deltas:
                if d.finish_reason == "error":
                    yield sse(choice_error(d).body())
                    yield "data: [DONE]\n\n"
                    return
                chunk = make_chunk(d)
                if chunk is not None:
                    yield sse(chunk)
            if out.finished:
                record_usage(scope, out.usage)
            if out.finished and include_usage:
                yield sse({**base, "choices": [], "usage": out.usage.to_dict()})
        yield "data: [DONE]\n\n"
    except EngineDeadError as e:
        log.error("stream %s failed: %s", stream.request_id, e)
        yield sse(error_body("the engine failed; see the server log", "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        stream.abort()  # no-op when finished; frees the blocks when the client went away


@dataclass
class Renderer:
    """How an endpoint renders its output.

    base: the fields every chunk or body carries (id, object, created, model).
    chunk(stream, delta) -> one streamed chunk (None: nothing to send yet, e.g. text held back while it may
    start a tool call); first(stream) -> chunks sent before any output;
    body(stream, collected) -> the non-streamed JSON body.
    """

    base: dict
    chunk: Callable[[RequestStream, ChoiceDelta], dict | None]
    first: Callable[[RequestStream], list[dict]]
    body: Callable[[RequestStream, Collected], dict]


async def respond(request: Request, engine, gen: GenerationRequest | list[GenerationRequest], stream: bool,
                  include_usage: bool, render: Renderer, continuous: bool = False):
    """Submit ``gen`` (a list: one request per prompt, their streams merged by
    :func:`~kvkeeper.api.common.streams.submit_all`) and answer with SSE (``stream``) or one JSON body; ``continuous``:
    every chunk carries its choice's usage so far (:func:`continuous_usage`).  A degraded session's trimmed turns
    are named in ``X-KVKeeper-Trimmed-Turns``, a session turn's context report in ``X-KVKeeper-Context``, why a
    whole response's prompt read less from the cache than its predecessor in ``X-KVKeeper-Cache-Miss``
    (:func:`miss_header`)."""
    gens = gen if isinstance(gen, list) else [gen]
    s = await engine.submit(gen) if not isinstance(gen, list) else await submit_all(engine, gens)
    n = sum(len(g.params) for g in gens)
    headers = {"X-KVKeeper-Trimmed-Turns": str(s.trimmed_turns)} if s.trimmed_turns else {}
    headers |= clamped_header(gens, s.prompt_token_ids if len(gens) == 1 else None, engine.served.max_model_len)
    if s.context is not None:
        headers["X-KVKeeper-Context"] = s.context
    if stream:
        usage = _ChunkUsage(s, n, include_usage, continuous)

        def chunk(d: ChoiceDelta) -> dict | None:
            c = render.chunk(s, d)
            usage.count(d)
            return None if c is None else usage.add(c)

        events = _events(s, chunk, [usage.add(c) for c in render.first(s)], include_usage, render.base, request.scope)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    got = await collect(request, s, n)
    return JSONResponse(render.body(s, got), headers={**headers, **miss_header(got.usage)})


def clamped_header(gens: list[GenerationRequest], prompt_ids: list[int] | None, context: int) -> dict:
    """``{"X-KVKeeper-Max-Tokens-Clamped": "<asked> -> <served>"}`` when one prompt's ``max_tokens`` is more than
    the room its prompt leaves in the ``context`` window, which the reply is cut to (as llama.cpp's server does;
    Qwen Code sends 32000 for a model it does not know; the OpenAI routes refuse a value of the whole window or
    more, the Messages route cuts every value), else empty."""
    asked = gens[0].params[0].max_tokens
    if prompt_ids is None or asked is None or asked <= context - len(prompt_ids):
        return {}
    return {"X-KVKeeper-Max-Tokens-Clamped": f"{asked} -> {context - len(prompt_ids)}"}


def miss_header(usage: Usage | None) -> dict:
    """``{"X-KVKeeper-Cache-Miss": ...}`` when the request read less than its session's or cache key's predecessor
    (:mod:`kvkeeper.api.engine_client.cache_miss`), else empty.  Whole responses only: a stream's headers leave
    before its prompt is read (the admin endpoint ``/admin/cache/misses`` has every explanation)."""
    miss = getattr(usage, "cache_miss", None)
    return {"X-KVKeeper-Cache-Miss": miss.header()} if miss is not None else {}


class _ChunkUsage:
    """The ``usage`` of streamed chunks: null with ``include_usage`` (OpenAI), or with ``continuous`` the
    chunk's choice's counts so far (vLLM: its prompt's tokens, the tokens the choice has generated, their sum)."""

    def __init__(self, s: RequestStream, n: int, include_usage: bool, continuous: bool):
        self.s, self.include, self.continuous = s, include_usage, continuous
        self.generated = [0] * n

    def count(self, d: ChoiceDelta) -> None:
        self.generated[d.index] += len(d.token_ids)

    def add(self, chunk: dict) -> dict:
        if not self.include:
            return chunk
        if not self.continuous or not chunk.get("choices"):
            return {**chunk, "usage": None}
        i = chunk["choices"][0]["index"]
        prompt, done = self.s.part(i).prompt_tokens, self.generated[i]
        return {**chunk, "usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}
