"""Token sampling: logits processors, then greedy or temperature, min-p, top-k, top-p, with a per-request generator.

Each request that samples has its own ``torch.Generator`` (seeded from
``SamplingParams.seed`` when given), so its draws do not depend on which other
requests share the batch.  Top-p follows Holtzman et al., "The Curious Case of
Neural Text Degeneration" (2020): keep the smallest set of tokens whose
probability mass reaches p.  Min-p follows Nguyen et al., "Turning Up the Heat:
Min-p Sampling" (2024), as vLLM applies it (after the temperature, before top-k
and top-p): drop tokens whose probability is below ``min_p`` times the largest.
Penalties, logit biases, banned words and grammars are logits processors
(:mod:`kvkeeper.sampling.processors`), applied batched to the rows that have them.  Tokens only a multimodal
input can produce (:mod:`kvkeeper.text.multimodal`) are never picked for a text request (:class:`TokenMask`).
"""

from __future__ import annotations

import torch

from .params import SamplingParams
from .processors import RequestProcessors, apply_processors


NO_TOKEN = -1  # sample()'s pick for a row whose processors exclude every token


class TokenMask:
    """Token ids no row may pick unless its request names them in ``logit_bias`` with a positive bias (then the
    bias applies as to any token): ids, e.g. a model's multimodal placeholders
    (:func:`kvkeeper.text.multimodal.multimodal_token_ids`).  Empty: masks nothing, costs nothing."""

    def __init__(self, ids):
        self.ids = sorted({int(i) for i in ids})
        self._set = frozenset(self.ids)
        self._tensors: dict[torch.device, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.ids)

    def allowed(self, p: SamplingParams) -> list[int]:
        """The masked ids request ``p`` asks for (a positive ``logit_bias``)."""
        return [t for t, b in p.logit_bias.items() if b > 0 and t in self._set] if p.logit_bias else []

    def apply(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """A copy of ``logits`` (B, V) with the masked ids at -inf in every row, but those a row's request
        asks for (:meth:`allowed`)."""
        idx = self._tensors.get(logits.device)
        if idx is None:
            idx = self._tensors[logits.device] = torch.tensor(self.ids, dtype=torch.int64, device=logits.device)
        out = logits.index_fill(-1, idx, float("-inf"))
        for i, p in enumerate(params):
            keep = self.allowed(p)
            if keep:
                k = torch.tensor(keep, dtype=torch.int64, device=logits.device)
                out[i, k] = logits[i, k]
        return out


def make_generator(params: SamplingParams, device="cpu") -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(int(params.seed))
    else:
        g.seed()
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits (V,) float32, already divided by the temperature -> logits with excluded tokens at -inf."""
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        remove = (cum - probs) >= top_p  # tokens after the mass already reached p
        remove[0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(0, idx, remove), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    processors: list[RequestProcessors | None] | None = None, mask: TokenMask | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Pick one token per row.

    logits: (B, V) float32, on any device (greedy rows are picked there: only the ids cross to the
    host; rows that sample, return logprobs or have processors are copied to the CPU, where the
    generators live).  processors: per row its :class:`RequestProcessors` or None; rows that have
    them are changed (in a copy) before the pick.  mask: tokens no row picks (:class:`TokenMask`: a text request
    never gets a multimodal placeholder) unless its ``logit_bias`` asks for them.
    Returns (token ids, per-row log-softmax (V,) of the unmodified logits when that row asked for
    logprobs, else None).  A row whose processors allow no token at all (e.g. a grammar whose only
    continuations are banned by ``bad_words`` or a -100 ``logit_bias``) gets :data:`NO_TOKEN`.
    """
    out: list[int] = []
    logps: list = []
    pick = mask.apply(logits, params) if mask else logits  # raw logits stay for the logprobs
    greedy_ids = pick.argmax(-1).tolist()
    processed = apply_processors(pick, processors) if processors is not None and any(processors) else {}
    for i, row in processed.items():
        greedy_ids[i] = int(row.argmax()) if bool(torch.isfinite(row.max())) else NO_TOKEN
    for i, p in enumerate(params):
        if greedy_ids[i] == NO_TOKEN:
            out.append(NO_TOKEN)
            logps.append(None)
            continue
        if p.greedy and p.logprobs is None:
            out.append(int(greedy_ids[i]))
            logps.append(None)
            continue
        raw = logits[i].cpu()
        logps.append(torch.log_softmax(raw, -1) if p.logprobs is not None else None)
        if p.greedy:
            out.append(int(greedy_ids[i]))
            continue
        probs = _probs(processed.get(i, raw if pick is logits else pick[i].cpu()), p)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out, logps


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampling request draws from: row (V,) float32 logits (processed) -> (V,) probabilities
    after the temperature, min-p, top-k and top-p."""
    # shifted by the max first: a tiny temperature (1e-270) sends the others to -inf, never to inf/NaN
    return _filter((row - row.max()) / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)


def speculative_sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None,
                       processors: RequestProcessors | None, draft: int) -> tuple[int, torch.Tensor | None]:
    """One token of a sampling request at a position where ``draft`` was proposed: the speculative sampling rule of
    Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative Decoding" (ICML 2023,
    Algorithm 1) and Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling" (2023):
    accept a draft x drawn from q with probability min(1, p(x) / q(x)), else draw from norm(max(0, p - q)).  Drafts
    here are deterministic (n-gram lookup, a prediction): q is one-hot at ``draft``, so the draft is accepted with
    probability p(draft) and a rejection draws from p with the draft removed and renormalised; either way the
    token is distributed as p, the distribution :func:`sample` draws from (processors, temperature, min-p, top-k,
    top-p).

    logits: (V,) float32, the row's raw logits; generator: the request's.  Returns (token id, (V,) log-softmax of
    the raw logits when the request asked for logprobs, else None); :data:`NO_TOKEN` when the processors allow
    no token.
    """
    raw = logits.cpu()
    row = apply_processors(raw[None], [processors])[0] if processors is not None else raw
    logp = torch.log_softmax(raw, -1) if p.logprobs is not None else None
    if not bool(torch.isfinite(row.max())):
        return NO_TOKEN, None
    probs = _probs(row, p)
    if float(torch.rand((), generator=generator)) < float(probs[draft]):
        return draft, logp
    residual = probs.clone()
    residual[draft] = 0.0
    if not float(residual.sum()) > 0:  # p(draft) == 1 up to rounding: the draft is the only token
        return draft, logp
    return int(torch.multinomial(residual, 1, generator=generator).item()), logp


def prompt_logprob_entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict]:
    """Log-probabilities of prompt tokens (vLLM's ``prompt_logprobs``).

    logits: (n, V) float32 of positions ``p .. p+n-1``; targets: the n tokens at ``p+1 .. p+n`` (what each
    position predicts).  Returns per target ``{"token_id", "logprob", "rank", "top": [(id, logprob)] * k}``;
    rank is 1 + the number of tokens more likely than the target (as vLLM's).
    """
    lp = torch.log_softmax(logits.float(), -1)
    tgt = torch.tensor(targets, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, tgt[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    top = torch.topk(lp, k) if k else None
    chosen, ranks = chosen.cpu().tolist(), ranks.cpu().tolist()
    tops = [[]] * len(targets) if top is None else [
        list(zip(ids, vals)) for ids, vals in zip(top.indices.cpu().tolist(), top.values.cpu().tolist())]
    return [{"token_id": t, "logprob": c, "rank": r, "top": tp} for t, c, r, tp in zip(targets, chosen, ranks, tops)]
