"""KV surgery on the paged store: compressing a prompt's KV and compacting the pool.

Both move raw K/V between blocks through the :class:`~kvkeeper.kvcache.store.KVStore`
(every layer) and rewrite block tables; neither changes a value (quantized blocks move with their scales).
Call them between engine steps only.  The surgery that does change values, the cache "hotfixes" (a layer's KV of a
finished sentence reset, refreshed or rescaled), is :mod:`kvkeeper.eval.intervention`.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

from .block_pool import BlockPool
from .compression import PrefillObserver, select
from .store import KVStore

log = logging.getLogger(__name__)


@torch.inference_mode()
def compress_prompt(seq, pool: BlockPool, store: KVStore, reclaim: Callable[[int], int] | None = None) -> bool:
    """Keep the tokens ``seq.compression`` selects from its just-prefilled prompt; returns True when applied.

    seq: a sequence whose ``observer`` (a :class:`~kvkeeper.kvcache.compression.PrefillObserver`) saw its
    whole prompt.  The kept K/V (per layer and KV head, ``k = compression.n_keep(L)`` tokens) go to
    fresh blocks; the prompt's blocks are released (their full blocks stay in the prefix cache, which
    still holds the uncompressed KV); ``seq.kv_offset`` records the tokens dropped, so later tokens keep
    their true RoPE positions.  When the pool has no room even after ``reclaim(n_blocks)`` the KV stays
    whole (logged) and False is returned.
    """
    obs, comp = seq.observer, seq.compression
    seq.observer, seq.compressed = None, True
    L = obs.length
    k = comp.n_keep(L)
    if k >= L:
        return False
    bs = pool.block_size
    need = -(-k // bs)
    if need > pool.num_free and reclaim is not None:
        reclaim(need - pool.num_free)
    if need > pool.num_free:
        log.warning("no free blocks to compress %s into; its KV stays whole", seq.request_id)
        return False
    new = pool.allocate(need)
    old = torch.tensor(seq.block_table[: -(-L // bs)], dtype=torch.int64)
    j = torch.arange(k)
    dst = torch.tensor(new, dtype=torch.int64)[j // bs] * bs + j % bs
    for layer in range(store.num_layers):
        keys = store.gather_keys(layer, old, L, torch.float32)
        idx = select(comp, obs, layer, keys)  # (KVH, k)
        store.copy_tokens(layer, old[idx // bs] * bs + idx % bs, dst)
    pool.free_all(seq.block_table)
    seq.block_table, seq.block_hashes = new, []
    seq.kv_offset = L - k
    seq.num_kv_dropped += L - k
    return True


@torch.inference_mode()
def compact(pool: BlockPool, tables: Iterable[list[int]], store: KVStore, evict_cache: bool = False) -> dict:
    """Renumber owned blocks to ids ``0..k-1``, then the prefix cache's unreferenced blocks (LRU order).

    tables: every block table holding blocks (each owner's, in order; the same list object
    may appear more than once).  Each owner's blocks become contiguous in table order; their K/V
    move with them (raw copy, every layer of ``store``) and the tables are rewritten in place.
    The cached blocks keep their KV and prefix-cache entries (moved as well): they are allocatable
    already, so evicting them would reclaim no memory and only lose prefix hits.  ``evict_cache``:
    drop them first instead (as ``BlockPool.reset_prefix_cache``; fewer bytes moved).
    Returns ``{"evicted": cached blocks dropped, "moved": blocks whose id changed (owned and cached)}``.
    """
    evicted = pool.evict_cached() if evict_cache else 0
    unique: list[list[int]] = []
    seen_tables: set[int] = set()
    order: list[int] = []
    seen: set[int] = set()
    for t in tables:
        if id(t) in seen_tables:
            continue
        seen_tables.add(id(t))
        unique.append(t)
        for b in t:
            if b not in seen:
                seen.add(b)
                order.append(b)
    keep = len(order) + pool.num_cached_free  # owned, then unreferenced cached blocks: the ids whose KV matters
    mapping = pool.defragment(order)
    moved = [(o, n) for o, n in mapping.items() if o != n and n < keep]
    if moved:
        src = torch.tensor([o for o, _ in moved], dtype=torch.int64, device=store.device)
        dst = torch.tensor([n for _, n in moved], dtype=torch.int64, device=store.device)
        store.move_blocks(src, dst)
    for t in unique:
        t[:] = [mapping[b] for b in t]
    return {"evicted": evicted, "moved": len(moved)}


def overwrite_slots(store: KVStore, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new K and V (each (n, KVH, D), any float dtype: rounded to the store's format) into ``slots`` (n,)
    int64 of one ``layer`` of ``store``, in place (an intervention on held KV).  The caller makes sure no other
    owner references those blocks."""
    store.layer(layer).write(k, v, slots)


def observe_prefills(scheduled, num_layers: int, num_kv_heads: int) -> None:
    """Give each scheduled sequence that asks for prompt compression (``seq.compression``) and has none yet a
    :class:`~kvkeeper.kvcache.compression.PrefillObserver` over its prompt (``num_layers`` layers of
    ``num_kv_heads`` KV heads), before the step's forward pass.  scheduled: (sequence, tokens) pairs."""
    for seq, _ in scheduled:
        if seq.compression is not None and seq.observer is None and not seq.compressed:
            seq.observer = PrefillObserver(seq.compression, len(seq.token_ids) - seq.kv_offset, num_layers,
                                           num_kv_heads)


def compress_observed_prefills(scheduled, pool: BlockPool, store: KVStore,
                               reclaim: Callable[[int], int] | None = None) -> None:
    """After a step: compress (:func:`compress_prompt`) the prompt of every scheduled, unfinished sequence whose
    observer has now seen all of it."""
    for seq, _ in scheduled:
        obs = seq.observer
        if obs is not None and not seq.finished and seq.num_computed - seq.kv_offset >= obs.length:
            compress_prompt(seq, pool, store, reclaim)
