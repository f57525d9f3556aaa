"""Token sampling: greedy, temperature, top-k, top-p, with a per-request generator.

Each request that samples has its own ``torch.Generator`` (seeded from
``SamplingParams.seed`` when given), so its draws do not depend on which other
requests share the batch.  Top-p follows Holtzman et al., "The Curious Case of
Neural Text Degeneration" (2020): keep the smallest set of tokens whose
probability mass reaches p.
"""

from __future__ import annotations

import torch

from .params import SamplingParams


def make_generator(params: SamplingParams, device="cpu") -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(int(params.seed))
    else:
        g.seed()
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits (V,) float32 -> logits with excluded tokens at -inf."""
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
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[torch.Tensor]]:
    """Pick one token per row.

    logits: (B, V) float32, on any device (greedy rows are picked there: only the ids cross to the
    host; rows that sample or return logprobs are copied to the CPU, where the generators live).
    Returns (token ids, per-row log-softmax (V,) of the unmodified logits when that row asked for
    logprobs, else None).
    """
    out: list[int] = []
    logps: list = []
    greedy_ids = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy and p.logprobs is None:
            out.append(int(greedy_ids[i]))
            logps.append(None)
            continue
        row = logits[i].cpu()
        logps.append(torch.log_softmax(row, -1) if p.logprobs is not None else None)
        if p.greedy:
            out.append(int(greedy_ids[i]))
            continue
        # shifted by the max first: a tiny temperature (1e-270) sends the others to -inf, never to inf/NaN
        filt = _filter((row - row.max()) / p.temperature, p.top_k, p.top_p)
        probs = filt.softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out, logps
