"""Several prompts in one ``/v1/completions`` request (OpenAI's ``prompt`` as a list of strings or of token-id
lists): one engine request per prompt, their streams merged into one.

Choice ``i`` of prompt ``k`` is the response's choice ``k * n + i`` (OpenAI's and vLLM's numbering); the usage
is the prompts' summed (each prompt counted once whatever ``n``).  Streamed, each chunk carries one choice, as
with one prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses

from .streams import RequestStream, StepOutput, Usage


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
                 sum(u.cached_tokens for u in got))


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
