"""Which replica holds which KV block: an index fed by the replicas' KV events (:mod:`kvkeeper.kvcache.kv_events.wire`).

For each replica the index keeps the block hashes its prefix cache holds (with each block's parent hash), and
for each block hash the replicas that hold it.  :meth:`KVIndex.match` gives, for a prompt's chained block
hashes, how many leading blocks each replica holds: the cached prefix a replica would reuse (a chain breaks
at its first miss, as the replica's own prefix match does).  This is the indexer of llm-d's precise prefix
scorer and of Dynamo's KV router, fed by vLLM-schema events.

Cost: :meth:`apply` O(blocks in the batch); :meth:`match` O(prompt blocks x replicas holding them).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

from ..kvcache.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

_ABSENT = object()


class KVIndex:
    """block hash -> replicas, from event batches applied per replica (``replica``: any id string)."""

    def __init__(self):
        self._holders: dict[int, set[str]] = defaultdict(set)
        self._blocks: dict[str, dict[int, int | None]] = {}  # replica -> {hash: parent hash}
        self.namespaces: dict[str, dict[str, int]] = {}  # replica -> {namespace digest: blocks stored}

    def apply(self, replica: str, batch: EventBatch) -> None:
        """Apply one batch of ``replica``'s events, in order."""
        for ev in batch.events:
            self.apply_event(replica, ev)

    def apply_event(self, replica: str, ev) -> None:
        """Apply one event (BlockStored, BlockRemoved, AllBlocksCleared).  Raises TypeError for anything else."""
        mine = self._blocks.setdefault(replica, {})
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            ns = self.namespaces.setdefault(replica, {})
            ns[ev.namespace] = ns.get(ev.namespace, 0) + len(ev.block_hashes)
            for h in ev.block_hashes:
                mine[h] = parent
                self._holders[h].add(replica)
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                if mine.pop(h, _ABSENT) is not _ABSENT:
                    self._drop(h, replica)
        elif isinstance(ev, AllBlocksCleared):
            self.remove_replica(replica)
            self._blocks[replica] = {}
        else:
            raise TypeError(f"not a KV cache event: {type(ev).__name__}")

    def _drop(self, h: int, replica: str) -> None:
        s = self._holders.get(h)
        if s is not None:
            s.discard(replica)
            if not s:
                del self._holders[h]

    def remove_replica(self, replica: str) -> None:
        """Forget everything of ``replica`` (it left the cluster, or its cache was cleared)."""
        for h in self._blocks.pop(replica, {}):
            self._drop(h, replica)
        self.namespaces.pop(replica, None)

    def blocks(self, replica: str) -> dict[int, int | None]:
        """``{block hash: parent hash}`` of what ``replica`` holds (a copy)."""
        return dict(self._blocks.get(replica, {}))

    def num_blocks(self, replica: str) -> int:
        """Block hashes ``replica`` holds (0 for a replica the index has no events of)."""
        return len(self._blocks.get(replica, ()))

    @property
    def replicas(self) -> list[str]:
        return list(self._blocks)

    def __len__(self) -> int:
        """Distinct block hashes held by some replica."""
        return len(self._holders)

    def holders(self, h: int) -> frozenset[str]:
        return frozenset(self._holders.get(h, ()))

    def match(self, hashes: Sequence[int], replicas: Iterable[str] | None = None) -> dict[str, int]:
        """``{replica: leading blocks of hashes it holds}`` for the replicas holding at least the first block
        (restricted to ``replicas`` when given); replicas absent from the result hold none."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        alive = set(self._holders.get(hashes[0], ()))
        if replicas is not None:
            alive &= set(replicas)
        i = 0
        for i, h in enumerate(hashes):
            held = self._holders.get(h)
            nxt = alive & held if held else set()
            for r in alive - nxt:
                out[r] = i
            alive = nxt
            if not alive:
                break
        else:
            i = len(hashes)
        for r in alive:
            out[r] = i
        return out
