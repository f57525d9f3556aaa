"""Retention holds: a cached prefix kept against LRU eviction until a deadline (prompt-cache TTLs).

A *hold* names a chain of full blocks by their chained hashes (:func:`kvkeeper.kvcache.block_pool.block_hash`: the
namespace is part of every hash, so a hold is a tenant's), from the first block of a prompt to the block where a
cache breakpoint ends, and a *deadline* (seconds of a monotonic clock).  Anthropic's ``cache_control`` ``ttl``
("5m", the default, or "1h") and OpenAI's ``prompt_cache_retention: "24h"`` place one (the API routes, through
``engine.kv.hold_prefix``); ``"in_memory"`` places none (plain LRU).

Rules (units: blocks and seconds):

- While its hold is live, a cached block that no request references is skipped by LRU eviction:
  :class:`~kvkeeper.kvcache.block_pool.BlockPool` keeps it on a list of its own, after the unheld cached blocks.
- **Bound.**  At most ``max_blocks`` distinct blocks are held at once (``kv_hold_share`` of the pool; 0 turns holds
  off).  A new hold that would pass the bound makes the oldest holds (by placement or renewal) give way first
  (*displaced*); a hold longer than the bound alone holds its first ``max_blocks`` blocks.
- **Never refusing a request.**  Held blocks stay allocatable: when an allocation finds no never-cached and no
  unheld cached block, the oldest hold with an unreferenced block gives way (*gave way*) and its blocks are evicted
  least recently freed first.  Their KV is dropped, not offloaded (the host tier keeps sessions' KV, not
  prefix-cache blocks); the counter says how often.
- **Expiry** is lazy: checked when the pool allocates, looks up or places a hold (no timer thread); a hold past its
  deadline ends (*expired*) and its blocks become ordinary cached blocks, first in line for eviction.
- **Renewal.**  Placing a hold on the same chain again (the same last block hash) renews it: its deadline becomes
  the later of the old one and ``now + ttl`` and it becomes the newest hold.

Counters (monotonic): ``expired``, ``gave_way``, ``displaced`` (holds).  Gauges: :attr:`RetentionHolds.num_blocks`
(distinct blocks held: what the bound counts, whether in the pool now or still being computed),
:attr:`RetentionHolds.num_holds`.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass
class Hold:
    """One hold: its chain of block hashes (first block first) and its deadline (clock seconds)."""

    hashes: tuple[int, ...]
    deadline: float


class RetentionHolds:
    """The live holds of one pool.  ``max_blocks``: the bound (0: holds off); ``clock``: monotonic seconds
    (``time.monotonic``; tests pass a fake).  The methods that change holds return the block hashes whose held
    state changed, for the pool to move those blocks between its free lists."""

    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.monotonic):
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self.clock = clock
        self._holds: OrderedDict[int, Hold] = OrderedDict()  # by last hash; oldest placement or renewal first
        self._count: dict[int, int] = {}  # block hash -> holds covering it
        self._next_deadline = math.inf
        self.expired = self.gave_way = self.displaced = 0

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held (the bound counts these)."""
        return len(self._count)

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    def held(self, h: int) -> bool:
        """Whether block hash ``h`` is under a hold (live until :meth:`expire` ends it)."""
        return h in self._count

    def holds(self) -> list[Hold]:
        """The holds, oldest first."""
        return list(self._holds.values())

    # ---- changes: each returns the hashes whose held state flipped -------------------------------------
    def _drop(self, key: int, changed: dict[int, bool]) -> None:
        for h in self._holds.pop(key).hashes:
            changed.setdefault(h, True)
            self._count[h] -= 1
            if not self._count[h]:
                del self._count[h]

    def _add(self, key: int, hold: Hold, changed: dict[int, bool]) -> None:
        self._holds[key] = hold
        for h in hold.hashes:
            changed.setdefault(h, False)
            self._count[h] = self._count.get(h, 0) + 1
        self._next_deadline = min(self._next_deadline, hold.deadline)

    def _flipped(self, changed: dict[int, bool]) -> tuple[list[int], list[int]]:
        """(hashes now held that were not, hashes no longer held) of the ``changed`` ones (hash -> held before)."""
        gained = [h for h, before in changed.items() if not before and h in self._count]
        lost = [h for h, before in changed.items() if before and h not in self._count]
        return gained, lost

    def place(self, hashes: Iterable[int], ttl_s: float) -> tuple[list[int], list[int]]:
        """Hold the chain ``hashes`` (first block first) for ``ttl_s`` seconds from now, or renew its hold.

        Returns (hashes newly held, hashes released: of displaced holds).  Nothing happens with holds off or an
        empty chain.  Raises ValueError for a negative ``ttl_s``."""
        if ttl_s < 0:
            raise ValueError(f"a hold's ttl is >= 0 seconds, got {ttl_s}")
        hashes = tuple(hashes)[: self.max_blocks]
        if not hashes:
            return [], []
        changed: dict[int, bool] = {}
        now, key = self.clock(), hashes[-1]
        deadline = now + ttl_s
        old = self._holds.get(key)
        if old is not None:
            deadline = max(deadline, old.deadline)
            self._drop(key, changed)
        while self._holds and len(self._count) + sum(h not in self._count for h in set(hashes)) > self.max_blocks:
            self._drop(next(iter(self._holds)), changed)  # the oldest hold gives way to the bound
            self.displaced += 1
        self._add(key, Hold(hashes, deadline), changed)
        return self._flipped(changed)

    def expire(self) -> list[int]:
        """End the holds whose deadline has passed; returns the hashes no longer held.  O(1) before the next
        deadline, O(holds) when one passed."""
        now = self.clock()
        if now < self._next_deadline:
            return []
        changed: dict[int, bool] = {}
        for key in [k for k, hold in self._holds.items() if hold.deadline <= now]:
            self._drop(key, changed)
            self.expired += 1
        self._next_deadline = min((hold.deadline for hold in self._holds.values()), default=math.inf)
        return self._flipped(changed)[1]

    def give_way(self, useful: Callable[[Hold], bool]) -> list[int]:
        """End the oldest hold for which ``useful(hold)`` is true (the pool asks: does it hold an unreferenced
        block?); returns the hashes no longer held ([] when no hold is useful)."""
        for key, hold in self._holds.items():
            if useful(hold):
                changed: dict[int, bool] = {}
                self._drop(key, changed)
                self.gave_way += 1
                return self._flipped(changed)[1]
        return []

    def clear(self) -> list[int]:
        """End every hold (the prefix cache was reset); returns the hashes no longer held."""
        lost = list(self._count)
        self._holds.clear()
        self._count.clear()
        self._next_deadline = math.inf
        return lost

    def check(self) -> None:
        """Raise AssertionError if the counts disagree with the holds or the bound is passed."""
        count: dict[int, int] = {}
        for key, hold in self._holds.items():
            assert hold.hashes and hold.hashes[-1] == key, "a hold is filed under its last hash"
            for h in hold.hashes:
                count[h] = count.get(h, 0) + 1
        assert count == self._count, "held counts disagree with the holds"
        assert len(self._count) <= self.max_blocks, f"{len(self._count)} blocks held, bound {self.max_blocks}"
