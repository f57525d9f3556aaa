"""KV held outside requests: the protocol of a *KV holder* (a session manager) and the engine's list of them.

The engine asks its holders to release blocks under pressure (the scheduler's ``reclaim``) and lists
their blocks for the validators and telemetry.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol

from .sequence import Sequence


class KVHolder(Protocol):
    """Something that holds KV blocks between requests (``kvkeeper.sessions.SessionManager``)."""

    def kv_holdings(self) -> Iterable[tuple[str, Sequence]]:
        """(owner name, sequence) for every block table it holds."""

    def reclaim(self, n_blocks: int) -> int:
        """Release about ``n_blocks`` pool blocks (offload or unpin idle state); returns how many it released."""

    def offloaded_blocks(self) -> int:
        """Blocks' worth of KV it keeps outside the pool (host memory, disk)."""


class KVHolders(list):
    """The registered holders, in registration order (a list of :class:`KVHolder`)."""

    def reclaim(self, n_blocks: int) -> int:
        """Ask the holders, in order, to release about ``n_blocks`` pool blocks; returns how many they released."""
        freed = 0
        for h in self:
            if freed >= n_blocks:
                break
            freed += h.reclaim(n_blocks - freed)
        return freed

    def kv_holdings(self) -> Iterator[tuple[str, Sequence]]:
        """(owner name, sequence) of every holder's block tables (``session:<id>``)."""
        for h in self:
            yield from h.kv_holdings()

    def offloaded_blocks(self) -> int:
        """Blocks' worth of KV the holders keep outside the pool (host memory and disk tiers)."""
        return sum(h.offloaded_blocks() for h in self)
