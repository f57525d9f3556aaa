"""The KV block pool: fixed-size blocks with refcounts, a free list and a prefix cache.

Every KV block belongs to the pool; sequences only hold block ids in their
block tables.  A block is *free* when its refcount is 0.  A free block may
still hold valid KV of a full block registered in the prefix cache (*cached*):
it is reused by a later prefix hit, or evicted (least recently freed first)
when an allocation finds no never-cached free block.  This follows vLLM's v1
block pool and nano-vllm's block manager; a hit also compares the stored token
ids, namespace and parent hash, so handing out wrong KV would need a 64-bit
collision of the parent chain's hash on top of identical tokens.

Prefix-cache keys are chained: ``hash(parent_hash, namespace, token_ids)``
(blake2b, 64 bits), so a block matches only when every block before it did.

Hybrid KV cache (models whose sliding-window layers attend to the last ``window`` tokens only, Gemma 3): with
``window_blocks`` set, the pool also keeps a second, smaller set of *window blocks*, the sliding layers'
storage.  Every block a sequence is given comes with a window block (``window_id``); the full-attention layers
use the block id, the sliding layers its window block.  Once a block lies wholly before a sequence's window,
:meth:`release_window` gives its window block back while the block itself (the full layers' KV, and its
prefix-cache entry) stays.  A cached free block keeps its window block until a window allocation needs it
(least recently freed first), so a prefix hit can still use it as the last window of the matched prefix.
This follows vLLM's hybrid KV cache manager (sliding-window blocks outside the window go back to the free
list), with one window block per block instead of vLLM's separate block tables per layer group.

Retention holds (:mod:`kvkeeper.kvcache.retention`): a cached free block whose hash is under a live hold sits on a
third free list, ``_free_held``, which eviction reaches only when the never-cached and unheld cached blocks are gone
(then the oldest hold with a block there gives way).  Held blocks count as free (:attr:`BlockPool.num_free`): a
hold never makes an allocation fail.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from .namespace import Namespace
from .retention import Hold, RetentionHolds


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than asked for (the scheduler preempts instead of crashing)."""


def block_hash(parent: int | None, namespace: "Namespace | str", token_ids) -> int:
    """Chained 64-bit content hash of one full block (a signed int).

    blake2b (8-byte digest) over the parent block's hash (-1 for the first block), the namespace's
    :attr:`~kvkeeper.kvcache.namespace.Namespace.digest` (a Namespace or that digest string: a router that
    learned the digest from KV events computes the same hashes) and the block's token ids (int64 each).
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent is None else parent))
    h.update((namespace if isinstance(namespace, str) else namespace.digest).encode())
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while registered in the prefix cache
    parent: int | None = None  # hash of the previous block in the chain (None for the first)
    token_ids: tuple[int, ...] | None = None
    namespace: Namespace | None = None
    window: int | None = None  # its window block (hybrid pools), None when it has none


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots each.

    Counter (monotonic): ``evictions`` (cached blocks dropped for reuse).  Prefix-cache
    hit statistics are kept in tokens by :class:`~kvkeeper.kvcache.manager.KVCacheManager`.
    Raises :class:`NoFreeBlocksError` when an allocation cannot be met.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window_blocks: int | None = None, hold_share: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        """window_blocks: size of the sliding layers' window-block set (hybrid KV cache), None for none.
        hold_share: the share of the pool that retention holds may keep (0..1; 0: holds off), ``clock`` their
        monotonic seconds (:mod:`kvkeeper.kvcache.retention`).  Raises ValueError for a share outside 0..1."""
        if not 0.0 <= hold_share <= 1.0:
            raise ValueError(f"hold_share is a share of the pool, 0..1 (got {hold_share})")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        if window_blocks is not None and window_blocks < 1:
            raise ValueError(f"a hybrid pool needs at least one window block (got {window_blocks})")
        self.window_blocks = window_blocks
        self._win_free: list[int] = list(range(window_blocks or 0))[::-1]  # a stack: lowest id first
        self._win_reclaimable: OrderedDict[int, None] = OrderedDict()  # cached free blocks holding one (LRU)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._free_held: OrderedDict[int, None] = OrderedDict()  # cached free blocks under a live hold
        self.holds = RetentionHolds(int(hold_share * num_blocks) if enable_prefix_caching else 0, clock)
        self._by_hash: dict[int, int] = {}
        self.evictions = 0
        self.events = None  # a kvkeeper.kvcache.kv_events.wire.EventRecorder when KV events are on (attach_events)

    def attach_events(self, recorder) -> None:
        """Report every prefix-cache store and removal to ``recorder`` (an
        :class:`~kvkeeper.kvcache.kv_events.wire.EventRecorder`) from now on: first ``AllBlocksCleared``, then one
        ``BlockStored`` per block the cache holds already (parents before children), so a follower starts exact."""
        recorder.cleared()
        held = {b.hash: b for b in self.blocks if b.hash is not None and self._by_hash.get(b.hash) == b.block_id}
        done: set[int] = set()

        for b in held.values():
            chain = []  # b and its ancestors not yet emitted, child first
            while b is not None and b.hash not in done:
                chain.append(b)
                b = held.get(b.parent)
            for c in reversed(chain):
                recorder.stored(c.hash, c.parent, c.namespace.digest, c.token_ids)
                done.add(c.hash)
        self.events = recorder

    # ---- sizes -----------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocatable now: refcount 0, including evictable cached ones; in a hybrid pool no more than
        the window blocks that are free or held by cached free blocks (each new block takes one)."""
        n = len(self._free_plain) + len(self._free_cached) + len(self._free_held)
        if self.window_blocks is not None:
            n = min(n, len(self._win_free) + len(self._win_reclaimable))
        return n

    @property
    def hybrid(self) -> bool:
        return self.window_blocks is not None

    @property
    def num_window_free(self) -> int:
        """Window blocks held by no block (hybrid pools; 0 otherwise)."""
        return len(self._win_free)

    def window_id(self, bid: int) -> int | None:
        """The window block of block ``bid`` (hybrid pools), None when it has none."""
        return self.blocks[bid].window

    def _drop_window(self, b: Block) -> None:
        if b.window is not None:
            self._win_free.append(b.window)
            b.window = None
            self._win_reclaimable.pop(b.block_id, None)

    def _take_window(self) -> int:
        if not self._win_free:  # the least recently freed cached block gives its window block up
            bid, _ = self._win_reclaimable.popitem(last=False)
            self._drop_window(self.blocks[bid])
        return self._win_free.pop()

    def release_window(self, bid: int) -> bool:
        """Give back block ``bid``'s window block when one owner alone holds the block (it moved past it);
        True when released.  The block keeps its full-layer KV and prefix-cache entry."""
        b = self.blocks[bid]
        if b.window is None or b.ref_count != 1:
            return False
        self._drop_window(b)
        return True

    @property
    def num_used(self) -> int:
        """Blocks referenced by some owner (refcount > 0)."""
        return self.num_blocks - len(self._free_plain) - len(self._free_cached) - len(self._free_held)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self._by_hash)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks no owner references (held ones included): allocatable, reused by a prefix hit until then."""
        return len(self._free_cached) + len(self._free_held)

    @property
    def num_held_free(self) -> int:
        """Cached blocks no owner references that a live retention hold keeps from eviction."""
        return len(self._free_held)

    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence or session (0..1)."""
        return self.num_used / self.num_blocks

    # ---- allocation ------------------------------------------------------
    def _evict(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.hash is not None and self._by_hash.get(b.hash) == bid:
            del self._by_hash[b.hash]
            if self.events is not None:
                self.events.removed(b.hash)
        b.hash = b.parent = b.token_ids = b.namespace = None
        self._drop_window(b)
        self.evictions += 1

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks (refcount becomes 1); never-cached blocks go first, then LRU cached ones, then
        held ones (the oldest hold gives way: :mod:`kvkeeper.kvcache.retention`)."""
        self.expire_holds()
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free_plain:
                bid, _ = self._free_plain.popitem(last=False)
            else:
                if not self._free_cached:
                    self._give_way()
                bid, _ = self._free_cached.popitem(last=False)
                self._evict(bid)
            self.blocks[bid].ref_count = 1
            if self.window_blocks is not None:
                self.blocks[bid].window = self._take_window()
            out.append(bid)
        return out

    def incref(self, bid: int) -> None:
        """Add a reference (fork, prefix hit, session pin)."""
        b = self.blocks[bid]
        if b.ref_count == 0:
            if b.hash is not None:
                del (self._free_cached if bid in self._free_cached else self._free_held)[bid]
                self._win_reclaimable.pop(bid, None)
            else:
                del self._free_plain[bid]
        b.ref_count += 1

    def free(self, bid: int) -> None:
        """Drop one reference; at zero the block becomes free (kept as cached if registered)."""
        b = self.blocks[bid]
        if b.ref_count <= 0:
            raise RuntimeError(f"block {bid} freed with refcount {b.ref_count}: double free")
        b.ref_count -= 1
        if b.ref_count == 0:
            if b.hash is not None:
                # most recently used at the end
                (self._free_held if self.holds.held(b.hash) else self._free_cached)[bid] = None
                if b.window is not None:
                    self._win_reclaimable[bid] = None
            else:
                self._free_plain[bid] = None
                self._drop_window(b)

    def free_all(self, bids) -> None:
        # free in reverse so that a sequence's tail blocks are evicted before its head
        for bid in reversed(list(bids)):
            self.free(bid)

    def fork(self, bids) -> list[int]:
        """Share blocks with another owner: one more reference each; returns the same ids."""
        for bid in bids:
            self.incref(bid)
        return list(bids)

    # ---- prefix cache ----------------------------------------------------
    def lookup(self, parent: int | None, namespace: Namespace, token_ids) -> tuple[int | None, int]:
        """Find the cached block for this chained key; returns (block id or None, its hash).

        Does not add a reference: call :meth:`incref` to keep it.
        """
        self.expire_holds()
        h = block_hash(parent, namespace, token_ids)
        if not self.enable_prefix_caching:
            return None, h
        bid = self._by_hash.get(h)
        if bid is None:
            return None, h
        b = self.blocks[bid]
        if b.namespace != namespace or b.parent != parent or b.token_ids != tuple(token_ids):
            return None, h  # hash collision: never hand out foreign KV
        return bid, h

    def register(self, bid: int, parent: int | None, namespace: Namespace, token_ids) -> int:
        """Mark a full, computed, referenced block as reusable under its chained hash; returns the hash."""
        b = self.blocks[bid]
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks ({self.block_size} tokens) are cached, got {len(token_ids)}")
        if b.ref_count <= 0:
            raise RuntimeError(f"block {bid} registered while free")
        h = block_hash(parent, namespace, token_ids)
        if not self.enable_prefix_caching or b.hash is not None:
            return h
        if h not in self._by_hash:
            self._by_hash[h] = bid
            b.hash, b.parent, b.token_ids, b.namespace = h, parent, tuple(token_ids), namespace
            if self.events is not None:
                self.events.stored(h, parent, namespace.digest, b.token_ids)
        return h

    def evict_cached(self, n: int | None = None) -> int:
        """Evict up to ``n`` (default all) unreferenced cached blocks, LRU first, held ones last (their holds give
        way, oldest first); returns how many."""
        k = 0
        while (self._free_cached or self._free_held) and (n is None or k < n):
            if not self._free_cached:
                self._give_way()
            bid, _ = self._free_cached.popitem(last=False)
            self._evict(bid)
            self._free_plain[bid] = None
            k += 1
        return k

    def defragment(self, order) -> dict[int, int]:
        """Renumber blocks so that the owned ones occupy ids ``0..k-1`` in the given order.

        order: every owned block id (refcount > 0) exactly once, in the order wanted
        (owners' tables one after another keep each owner's blocks contiguous).  Cached
        free blocks follow in LRU order, then the never-cached free blocks.  Refcounts,
        prefix-cache registrations and free lists move with their blocks.

        Returns the permutation ``{old id: new id}``; the caller must move the KV
        contents of every owned or cached block whose id changes and rewrite every
        block table.  Raises ValueError (nothing changed) when ``order`` is not
        exactly the owned blocks.
        """
        order = list(order)
        owned = {b.block_id for b in self.blocks if b.ref_count > 0}
        if len(order) != len(set(order)) or set(order) != owned:
            missing, extra = sorted(owned - set(order)), sorted(set(order) - owned)
            raise ValueError(f"defragment needs every owned block once: missing {missing[:8]}, not owned {extra[:8]}, "
                             f"{len(order) - len(set(order))} repeated")
        seq = order + list(self._free_cached) + list(self._free_held) + list(self._free_plain)
        mapping = {old: new for new, old in enumerate(seq)}
        old_blocks = self.blocks
        self.blocks = []
        for new, old in enumerate(seq):
            b = old_blocks[old]
            b.block_id = new
            self.blocks.append(b)
        self._free_cached = OrderedDict((mapping[i], None) for i in self._free_cached)
        self._free_held = OrderedDict((mapping[i], None) for i in self._free_held)
        self._free_plain = OrderedDict((mapping[i], None) for i in self._free_plain)
        self._by_hash = {h: mapping[bid] for h, bid in self._by_hash.items()}
        self._win_reclaimable = OrderedDict((mapping[i], None) for i in self._win_reclaimable)
        return mapping

    def reset_prefix_cache(self) -> None:
        self._release(self.holds.clear())
        self.evict_cached()

    # ---- retention holds ---------------------------------------------------
    def chain_hashes(self, namespace: Namespace, token_ids, n_blocks: int | None = None) -> list[int]:
        """The chained hashes of the first ``n_blocks`` (default: all) full blocks of ``token_ids`` under
        ``namespace``: the keys the prefix cache files them under."""
        bs, parent, out = self.block_size, None, []
        full = len(token_ids) // bs if n_blocks is None else min(n_blocks, len(token_ids) // bs)
        for i in range(full):
            parent = block_hash(parent, namespace, token_ids[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def hold(self, namespace: Namespace, token_ids, ttl_s: float) -> int:
        """Hold the full blocks of ``token_ids`` (a prompt's head, up to a cache breakpoint) under ``namespace``
        against eviction for ``ttl_s`` seconds, or renew their hold (rules: :mod:`kvkeeper.kvcache.retention`).
        Blocks not computed yet are held once they are.  Returns the blocks held (0 with holds off; at most the
        bound).  Raises ValueError for a negative ``ttl_s``."""
        if not self.holds.enabled:
            return 0
        self.expire_holds()
        hashes = self.chain_hashes(namespace, token_ids)[: self.holds.max_blocks]
        gained, lost = self.holds.place(hashes, ttl_s)
        self._release(lost)
        for h in gained:
            bid = self._by_hash.get(h)
            if bid is not None and bid in self._free_cached:
                del self._free_cached[bid]
                self._free_held[bid] = None
        return len(hashes)

    def expire_holds(self) -> None:
        """End the holds past their deadline (lazily: :meth:`allocate` and :meth:`lookup` call it)."""
        self._release(self.holds.expire())

    def _release(self, hashes) -> None:
        """Blocks whose hold ended: back among the unheld cached blocks, first in line for eviction."""
        for h in hashes:
            bid = self._by_hash.get(h)
            if bid is not None and bid in self._free_held:
                del self._free_held[bid]
                self._free_cached[bid] = None
                self._free_cached.move_to_end(bid, last=False)

    def _has_free_block(self, hold: Hold) -> bool:
        return any(self._by_hash.get(h) in self._free_held for h in hold.hashes)

    def _give_way(self) -> None:
        """No unheld cached block left: holds with an unreferenced block give way, oldest first (each counted), until
        one of their blocks is held by no other hold."""
        while not self._free_cached and self._free_held:
            self._release(self.holds.give_way(self._has_free_block))

    # ---- invariants --------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        free_ids = set(self._free_plain) | set(self._free_cached) | set(self._free_held)
        assert len(free_ids) == len(self._free_plain) + len(self._free_cached) + len(self._free_held), \
            "block in two free lists"
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} refcount {b.ref_count}"
            assert (b.ref_count == 0) == (b.block_id in free_ids), f"block {b.block_id} free-list mismatch"
            if b.block_id in self._free_cached:
                assert b.hash is not None and not self.holds.held(b.hash), f"held block {b.block_id} not on the held list"
            if b.block_id in self._free_held:
                assert b.hash is not None and self.holds.held(b.hash), f"block {b.block_id} on the held list, unheld"
            if b.hash is not None:
                assert self._by_hash.get(b.hash) == b.block_id
        for h, bid in self._by_hash.items():
            assert self.blocks[bid].hash == h
        assert len(free_ids) + self.num_used == self.num_blocks
        self.holds.check()
        assert self.num_free <= len(free_ids)
        if self.window_blocks is not None:
            held = [b.window for b in self.blocks if b.window is not None]
            assert len(set(held)) == len(held), "a window block held twice"
            assert not set(held) & set(self._win_free), "a held window block is also free"
            assert len(held) + len(self._win_free) == self.window_blocks, "window blocks lost"
            for b in self.blocks:
                if b.window is not None:
                    assert b.ref_count > 0 or b.block_id in self._free_cached or b.block_id in self._free_held, \
                        f"free block {b.block_id} holds one"
                assert (b.block_id in self._win_reclaimable) == (b.ref_count == 0 and b.window is not None)
