"""Verification: a sequence's verify rows (the token before k drafts, then each draft) give tokens exactly as plain
decoding would until one differs from its draft (see the package docstring); and the split of a step's logits into
plain rows and verify rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sequence import Sequence
from ..sampling.sampler import NO_TOKEN, sample, speculative_sample


def split_rows(logits: torch.Tensor, seqs: list[Sequence]
               ) -> tuple[torch.Tensor, list[Sequence], list[tuple[Sequence, torch.Tensor]]]:
    """logits: (rows, vocab), one row per sequence and 1 + k rows for one carrying k drafts, in ``seqs`` order ->
    (the plain rows (P, vocab), their P sequences, [(a sequence carrying drafts, its (1 + k, vocab) rows)])."""
    if not any(s.spec_tokens for s in seqs):
        return logits, seqs, []
    plain_rows, plain, verifying, row = [], [], [], 0
    for seq in seqs:
        k = len(seq.spec_tokens)
        if k:
            verifying.append((seq, logits[row: row + k + 1]))
        else:
            plain_rows.append(row)
            plain.append(seq)
        row += k + 1
    return logits[torch.tensor(plain_rows, dtype=torch.int64, device=logits.device)], plain, verifying


@dataclass
class Verified:
    """What :func:`verify` did: tokens emitted, drafts accepted, finished sequences (this one or none)."""

    emitted: int
    accepted: int
    finished: list[Sequence]


def verify(seq: Sequence, logits: torch.Tensor, drafts: list[int], processor) -> Verified:
    """Take ``seq``'s tokens from its verify rows: row i (logits of the token before draft i) gives a token exactly
    as plain decoding would (greedy: the processors' argmax; sampling: :func:`speculative_sample` of draft i, the
    bonus row a plain sample); the next row is read only while the token equals its draft and the sequence has not
    finished (stop string, EOS, max_tokens, no allowed token).

    logits: (k + 1, vocab) float32, the rows of the token before the drafts and of each draft.  processor: the
    engine's :class:`~kvkeeper.engine.output_processor.OutputProcessor` (it appends, detokenizes, checks stops).
    """
    p, gen, procs = seq.params, seq.generator, seq.processors
    fast = p.greedy and p.logprobs is None and procs is None
    greedy_ids = logits.argmax(-1).tolist() if fast else None
    emitted = accepted = 0
    for i in range(len(drafts) + 1):
        if fast:
            tok, lp = greedy_ids[i], None
        elif p.greedy or i == len(drafts):
            ids, lps = sample(logits[i:i + 1], [p], [gen], [procs])
            tok, lp = ids[0], lps[0]
        else:
            tok, lp = speculative_sample(logits[i], p, gen, procs, drafts[i])
        done = processor.process([seq], [tok], [lp])
        emitted += tok != NO_TOKEN
        hit = i < len(drafts) and tok == drafts[i]
        accepted += hit
        if done or not hit:
            return Verified(emitted, accepted, done)
    return Verified(emitted, accepted, [])
