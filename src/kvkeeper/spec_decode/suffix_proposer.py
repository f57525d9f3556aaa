"""Suffix decoding (``method: "suffix"``): a table of the earlier requests of one cache namespace, drafts following
their most frequent continuation."""

from __future__ import annotations


class SuffixTable:
    """A suffix tree of the documents added (token lists), cut at depth ``n_max + 1`` and kept as the hash of its
    nodes: for each context of ``n_min``..``n_max`` tokens, the count of each token that followed it (SuffixDecoding,
    Oliaro et al., 2024, keeps the whole tree with such counts; a depth-limited walk re-matched after every drafted
    token reads the same counts).  :meth:`draft` follows the most frequent continuation of the longest context that
    occurs.  Adding or removing a document of n tokens costs O(n * (n_max - n_min + 1)) dict operations.
    """

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.next: dict[tuple, dict[int, int]] = {}
        self.docs = 0

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Count (``sign`` 1) or uncount (-1, a document leaving) every (context, next token) pair of ``tokens``."""
        self.docs += sign
        for i in range(1, len(tokens)):
            tok = tokens[i]
            for n in range(self.n_min, min(self.n_max, i) + 1):
                key = tuple(tokens[i - n:i])
                counts = self.next.get(key)
                if counts is None:
                    counts = self.next[key] = {}
                c = counts.get(tok, 0) + sign
                if c > 0:
                    counts[tok] = c
                else:
                    counts.pop(tok, None)
                    if not counts:
                        del self.next[key]

    def draft(self, context: list[int], k: int, min_prob: float) -> list[int]:
        """Up to ``k`` tokens continuing ``context``: at each step the most frequent successor of the longest suffix
        of (context + drafted tokens) that the table holds, while its count over the context's total is at least
        ``min_prob``; ``[]`` when no suffix of at least ``n_min`` tokens occurs."""
        ctx, out = list(context[-self.n_max:]), []
        while len(out) < k:
            counts = None
            for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
                counts = self.next.get(tuple(ctx[len(ctx) - n:]))
                if counts:
                    break
            if not counts:
                break
            tok, c = max(counts.items(), key=lambda kv: kv[1])
            if c < min_prob * sum(counts.values()):
                break
            out.append(tok)
            ctx = (ctx + [tok])[-self.n_max:]
        return out
