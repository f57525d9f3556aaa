"""Prompt lookup (``method: "ngram"``): an incremental index of a growing token list's n-grams, the longest suffix
n-gram looked up among its earlier occurrences (also the prediction pointer's re-synchronisation)."""

from __future__ import annotations

import bisect


class NgramIndex:
    """Where each n-gram (n_min <= n <= n_max tokens) of a growing token list ends, kept up to date incrementally.

    ``ends[gram]``: the ascending end positions (exclusive) of its occurrences among the indexed ones.
    :meth:`latest` and :meth:`first_from` look up the longest suffix n-gram of the list among its *earlier*
    occurrences (an occurrence ending at the list's end is not indexed yet).
    """

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.ends: dict[tuple, list[int]] = {}
        self.upto = 0  # n-grams ending at or before this position are indexed

    def sync(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end after ``self.upto`` and at or before ``upto``."""
        for end in range(self.upto + 1, upto + 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.ends.setdefault(tuple(tokens[end - n:end]), []).append(end)
        self.upto = max(self.upto, upto)

    def latest(self, key_tokens: list[int], room: int = 0) -> int | None:
        """End of the latest indexed occurrence of the longest suffix n-gram of ``key_tokens`` (None: none); with
        ``room``, the latest one followed by ``room`` tokens of ``key_tokens`` when there is one (an occurrence just
        before the end leaves a short continuation)."""
        for n in range(min(self.n_max, len(key_tokens)), self.n_min - 1, -1):
            hit = self.ends.get(tuple(key_tokens[len(key_tokens) - n:]))
            if hit:
                limit = len(key_tokens) - room
                for end in reversed(hit[-4:]):  # a few of the latest: the lookup stays O(1) per token
                    if end <= limit:
                        return end
                return hit[-1]
        return None

    def first_from(self, key_tokens: list[int], start: int) -> int | None:
        """End of the first indexed occurrence at or after ``start`` of the longest suffix n-gram that has one."""
        for n in range(min(self.n_max, len(key_tokens)), self.n_min - 1, -1):
            hit = self.ends.get(tuple(key_tokens[len(key_tokens) - n:]))
            if hit:
                i = bisect.bisect_left(hit, start)
                if i < len(hit):
                    return hit[i]
        return None
