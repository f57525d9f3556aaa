"""The cost model of draft lengths: a decode step's time as ``base + per_row * rows``, fitted online, and the draft
length that makes a step's tokens per second highest (see the package docstring)."""

from __future__ import annotations

ROW_COST = 0.12  # per_row / (base + per_row) until the step timings tell it (measured: 2.6 ms of 21.6 ms)


class StepCost:
    """The time of a decode-only step as ``base + per_row * rows`` (seconds), by least squares over the recent steps
    (sums decayed by ``decay`` per step); until steps of two sizes were seen, ``per_row / (base + per_row)`` is
    :data:`ROW_COST`."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows * seconds
        self.base, self.per_row = 1.0 - ROW_COST, ROW_COST

    def observe(self, rows: int, seconds: float) -> None:
        """Count one decode-only step of ``rows`` rows that ran in ``seconds``."""
        w, x, y, xx, xy = (v * self.decay for v in self.sums)
        self.sums = [w + 1, x + rows, y + seconds, xx + rows * rows, xy + rows * seconds]
        w, x, y, xx, xy = self.sums
        var = xx * w - x * x
        if var > 1e-6 * w * w:  # steps of several sizes: a fit
            slope = (xy * w - x * y) / var
            base = (y - slope * x) / w
            if slope > 0 and base > 0:
                self.base, self.per_row = base, slope


def best_length(rate: float, cost: StepCost, batch: int, max_k: int) -> int:
    """The draft length that makes the step's tokens per second highest: k in 0..``max_k`` maximising
    (S - 1 + E(k)) / (base + per_row * (S + k)), E(k) = 1 + a + ... + a^k the expected tokens of this row with k
    drafts (a = ``rate``, 0..1), S = ``batch`` sequences each making at least one token."""
    a, c, n = rate, cost, max(1, batch)
    best_k, best = 0, n / (c.base + c.per_row * n)
    e = term = 1.0
    for k in range(1, max_k + 1):
        term *= a
        e += term
        v = (n - 1 + e) / (c.base + c.per_row * (n + k))
        if v > best:
            best_k, best = k, v
    return best_k
