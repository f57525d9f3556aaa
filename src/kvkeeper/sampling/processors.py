"""Logits processors: one small object per feature and request, applied batched before sampling.

Each processor holds its request's state (token counts, the output so far, a grammar's
matcher), advances it in :meth:`accept` with every token the request accepts, and changes
the logits of the rows that use it in a class method ``apply(logits, procs)``: logits
``(k, V)`` float32 on the CPU (one row per request using the feature), changed in place.
:func:`apply_processors` groups a batch's rows by feature, so a feature costs one batched
operation per step, and rows without processors are never touched or copied.

Order (as vLLM's): logit bias, penalties, banned words, min_tokens, then the grammar mask.  Sources:

* ``logit_bias``: OpenAI API (``logit_bias``: a bias from -100 to 100 added to the logit of a
  token before sampling; -100 bans it in practice, +100 makes it near certain).
* ``presence_penalty``, ``frequency_penalty``: OpenAI API ("Penalties" in the text generation
  guide): ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``, counts over the tokens
  generated so far (not the prompt), as vLLM applies them.
* ``repetition_penalty``: Keskar et al., 2019, "CTRL" (section 4.1), as transformers and vLLM
  apply it: a token seen in the prompt or the output has a positive logit divided by the penalty
  and a negative one multiplied by it.
* ``bad_words``: vLLM's ``bad_words``: each word tokenized alone and after a space; its last token
  is banned when the output ends with its other tokens (a one-token word is always banned).
* ``min_tokens``: vLLM's ``min_tokens`` (its ``MinTokensLogitsProcessor``): the stop token ids (EOS, unless
  ``ignore_eos``, and ``stop_token_ids``) are masked to -inf until the request has generated ``min_tokens``
  tokens.
* the grammar: :class:`kvkeeper.sampling.structured.GrammarMask`.
"""

from __future__ import annotations

from typing import Callable

import torch

from .params import SamplingParams
from .structured import GrammarMask

NEG_INF = float("-inf")


class LogitBias:
    """Adds ``bias[token]`` to the logits (OpenAI's ``logit_bias``); no state."""

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(list(bias), dtype=torch.int64)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def accept(self, token: int) -> None:
        pass

    @classmethod
    def apply(cls, logits: torch.Tensor, procs: list["LogitBias"]) -> None:
        rows = torch.cat([torch.full((len(p.ids),), i, dtype=torch.int64) for i, p in enumerate(procs)])
        cols = torch.cat([p.ids for p in procs])
        logits.index_put_((rows, cols), torch.cat([p.values for p in procs]), accumulate=True)


class Penalties:
    """Presence, frequency (OpenAI) and repetition (CTRL) penalties of one request.

    prompt_ids: the prompt's tokens (seen by the repetition penalty); vocab_size: the logits' width.
    State: per-token counts of the output (int32, (V,)).
    """

    def __init__(self, presence: float, frequency: float, repetition: float, prompt_ids: list[int], vocab_size: int):
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.counts = torch.zeros(vocab_size, dtype=torch.int32)
        self.prompt_seen = None
        if repetition != 1:
            self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool)
            ids = torch.tensor([t for t in prompt_ids if 0 <= t < vocab_size], dtype=torch.int64)
            self.prompt_seen[ids] = True

    def accept(self, token: int) -> None:
        if 0 <= token < self.counts.numel():
            self.counts[token] += 1

    @classmethod
    def apply(cls, logits: torch.Tensor, procs: list["Penalties"]) -> None:
        counts = torch.stack([p.counts for p in procs]).to(torch.float32)
        seen_out = counts > 0
        reps = [p for p in procs if p.prompt_seen is not None]
        if reps:
            rep = torch.tensor([[p.repetition] for p in procs])
            seen = torch.stack([p.prompt_seen if p.prompt_seen is not None else torch.zeros_like(seen_out[0])
                                for p in procs]) | seen_out
            seen &= rep != 1
            logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits))
        freq = torch.tensor([[p.frequency] for p in procs])
        pres = torch.tensor([[p.presence] for p in procs])
        logits.sub_(counts * freq + seen_out.to(torch.float32) * pres)


class BadWords:
    """vLLM's ``bad_words`` for one request: word_ids, the token ids of each banned word (both spellings)."""

    def __init__(self, word_ids: list[list[int]]):
        self.words = [w for w in word_ids if w]
        self.output: list[int] = []

    def accept(self, token: int) -> None:
        self.output.append(token)

    def banned(self) -> list[int]:
        out = self.output
        return [w[-1] for w in self.words if len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1]]

    @classmethod
    def apply(cls, logits: torch.Tensor, procs: list["BadWords"]) -> None:
        for i, p in enumerate(procs):
            ids = p.banned()
            if ids:
                logits[i, ids] = NEG_INF


class MinTokens:
    """vLLM's ``min_tokens`` for one request: ``stop_ids`` (token ids) masked to -inf while fewer than
    ``min_tokens`` tokens have been generated.  State: the number generated so far."""

    def __init__(self, min_tokens: int, stop_ids: list[int]):
        self.min_tokens, self.generated = min_tokens, 0
        self.ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64)

    def accept(self, token: int) -> None:
        self.generated += 1

    @classmethod
    def apply(cls, logits: torch.Tensor, procs: list["MinTokens"]) -> None:
        for i, p in enumerate(procs):
            if p.generated < p.min_tokens and len(p.ids):
                logits[i, p.ids] = NEG_INF


ORDER = (LogitBias, Penalties, BadWords, MinTokens, GrammarMask)


class RequestProcessors:
    """The logits processors of one request (at most one per kind), advanced with each accepted token."""

    def __init__(self, procs: list):
        self.procs = procs

    def accept(self, token: int) -> None:
        """The request accepted ``token`` (called as it is appended to the sequence)."""
        for p in self.procs:
            p.accept(token)


def build_processors(params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                     bad_word_ids: list[list[int]] | None = None,
                     grammar: Callable[[], GrammarMask] | None = None,
                     eos_token_ids: list[int] | set[int] = ()) -> RequestProcessors | None:
    """The processors ``params`` asks for, or None when it asks for none (the fast path).

    bad_word_ids: the token ids of ``params.bad_words`` (tokenized by the caller); grammar: makes the
    request's :class:`GrammarMask` (called only when ``params.structured`` is set); eos_token_ids: the ids
    that end generation (masked by ``params.min_tokens`` with ``params.stop_token_ids``, unless ignore_eos).
    """
    if not params.has_processors:
        return None
    procs: list = []
    if params.logit_bias:
        procs.append(LogitBias(params.logit_bias))
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        procs.append(Penalties(params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                               prompt_ids, vocab_size))
    if bad_word_ids:
        procs.append(BadWords(bad_word_ids))
    if params.min_tokens:
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        procs.append(MinTokens(params.min_tokens, [t for t in stop_ids if 0 <= t < vocab_size]))
    if params.structured is not None and grammar is not None:
        procs.append(grammar())
    return RequestProcessors(procs) if procs else None


def apply_processors(logits: torch.Tensor, processors: list[RequestProcessors | None]) -> dict[int, torch.Tensor]:
    """The processed logits of the rows that have processors: {row: (V,) float32 on the CPU}.

    logits: (B, V) on any device (left unchanged: the first-token hooks and logprobs read it raw).
    """
    rows = [i for i, p in enumerate(processors) if p is not None]
    if not rows:
        return {}
    sub = logits[torch.tensor(rows, device=logits.device)].to("cpu", torch.float32)
    for kind in ORDER:
        idx, procs = [], []
        for j, i in enumerate(rows):
            for p in processors[i].procs:
                if type(p) is kind:
                    idx.append(j)
                    procs.append(p)
        if not procs:
            continue
        if len(idx) == len(rows):
            kind.apply(sub, procs)
        else:
            part = sub[idx]
            kind.apply(part, procs)
            sub[idx] = part
    return {i: sub[j] for j, i in enumerate(rows)}
