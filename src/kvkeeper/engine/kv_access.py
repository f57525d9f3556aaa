"""The engine's KV (``engine.kv``, a :class:`KVAccess` the engine owns: its block pool, KV manager and KV holders,
over the model runner's store and the scheduler's requests): what the engine's step, sessions, diagnostics and the
server call to hold, move and measure KV.  Sizes in blocks and bytes; block ids index the pool.  What the layers
above may call on it: :class:`kvkeeper.engine.handle.KVHandle`."""

from __future__ import annotations

import json
from typing import Iterator

import torch

from ..errors import InvalidRequestError
from ..kvcache.block_pool import BlockPool
from ..kvcache.manager import KVCacheManager
from ..kvcache.namespace import Namespace
from ..kvcache.surgery import compact, compress_prompt
from ..kvcache.telemetry import PoolStats, pool_stats
from ..model_config import ModelConfig
from ..worker.runner import ModelRunner
from .config import EngineConfig
from .handle import KVHolder, KVHolders
from .scheduler import Scheduler
from .sequence import Sequence


class KVAccess:
    """KV holders, the KV store, sequences' KV, block allocation for holders, compaction and pool figures.

    ``KVAccess(runner, config, model_config)`` builds ``pool`` (the :class:`~kvkeeper.kvcache.block_pool.BlockPool`
    of the runner's blocks: ``config.block_size`` tokens each, prefix caching and a hybrid pool's window blocks as
    configured), ``manager`` (the :class:`~kvkeeper.kvcache.manager.KVCacheManager` over it) and ``holders`` (the
    registered :class:`~kvkeeper.engine.handle.KVHolder` s).  The engine sets ``scheduler`` once it is built (its
    running and waiting requests hold KV too)."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, model_config: ModelConfig):
        window_blocks = runner.window_blocks
        self.pool = BlockPool(runner.num_blocks, config.block_size, config.enable_prefix_caching, window_blocks,
                              config.kv_hold_share)
        self.manager = KVCacheManager(self.pool, model_config.sliding_window if window_blocks else None)
        runner.window_of = self.pool.window_id if window_blocks else None  # which window block a slot's block has
        self.runner, self.config, self.model_config = runner, config, model_config
        self.holders = KVHolders()  # what holds KV between requests (kvkeeper.engine.handle)
        self.scheduler: Scheduler | None = None

    def require_uniform(self, what: str) -> None:
        """Raise InvalidRequestError when ``what`` (reading or moving all layers' KV by block id) meets hybrid KV."""
        if self.runner.window_blocks:
            raise InvalidRequestError(f"{what} is not supported with the hybrid KV cache of a sliding-window model "
                                      "(its sliding layers keep KV per window); start the engine with "
                                      "--no-hybrid-kv-cache (hybrid_kv_cache=False) to use it")

    def numerics(self) -> dict:
        """Every setting besides the model revision, KV dtype, block size and KV shapes that changes the bytes of a
        K/V entry (saved KV is continued only under the same): the weight format, the activation dtype, the KIVI
        value group, RoPE (base, local base, scaling, per-frequency factors), the sliding window and whether the
        cache is hybrid, the attention backend and the kernels' invariant mode.  JSON values (str, int, float,
        bool, None) that compare equal after a JSON round trip."""
        r, m = self.runner, self.model_config
        freqs = None if m.rope_freq_factors is None else json.dumps([float(f) for f in m.rope_freq_factors])
        return {"weight_format": r.weight_format, "activation_dtype": str(r.dtype).removeprefix("torch."),
                "kivi_group": r.kv_format.group_v, "rope_theta": float(m.rope_theta),
                "rope_local_theta": float(m.rope_local_theta),
                "rope_scaling": None if m.rope_scaling is None else json.dumps(m.rope_scaling, sort_keys=True),
                "rope_freq_factors": freqs, "sliding_window": m.sliding_window, "hybrid_kv": bool(r.window_blocks),
                "attention_backend": r.attention_backend, "invariant_kernels": bool(self.config.invariant_kernels)}

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes in the pool, every layer (scales included)."""
        return self.runner.kv_bytes_per_token

    @property
    def store(self):
        """The :class:`~kvkeeper.kvcache.store.KVStore` of every layer's KV (blocks: the methods below)."""
        return self.runner.kv_store

    # ---- holders ---------------------------------------------------------
    def add_holder(self, holder: KVHolder) -> None:
        """Register something that holds KV between requests (a session manager)."""
        self.holders.append(holder)

    def reclaim(self, n_blocks: int) -> int:
        """Ask the KV holders to release about ``n_blocks`` pool blocks; returns how many they released."""
        return self.holders.reclaim(n_blocks)

    def holdings(self) -> Iterator[tuple[str, Sequence]]:
        """(owner, sequence) of every block table: running and waiting requests, then holders' (``session:<id>``)."""
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            yield seq.request_id, seq
        yield from self.holders.kv_holdings()

    def offloaded_blocks(self) -> int:
        """Blocks' worth of KV the holders keep outside the pool (host memory and disk tiers)."""
        return self.holders.offloaded_blocks()

    # ---- a sequence's KV -------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Extend a sequence's block table for ``num_new_tokens`` more tokens (an evaluation's own sequence,
        outside the scheduler: :meth:`KVCacheManager.allocate`); False (nothing taken) when the pool is short."""
        return self.manager.allocate(seq, num_new_tokens)

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back the window blocks of a sequence's blocks wholly before its next token's sliding window
        (hybrid pools: :meth:`KVCacheManager.release_out_of_window`); returns how many."""
        return self.manager.release_out_of_window(seq)

    def free(self, seq: Sequence) -> int:
        """Release a sequence's blocks (its full blocks stay in the prefix cache as cached-free); returns the blocks
        returned to the pool's free list (a block another owner, e.g. a fork, still references is not)."""
        before = self.pool.num_used
        self.manager.free(seq)
        return before - self.pool.num_used

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of a sequence's first ``num_tokens`` tokens only (freeing the blocks past them)."""
        self.manager.truncate(seq, num_tokens)

    def commit(self, seq: Sequence) -> None:
        """Register a sequence's full blocks in the prefix cache under their chained hashes."""
        self.manager.commit(seq)

    def release(self, seq: Sequence) -> None:
        """A finished sequence's blocks: to its ``kv_holder`` when it has one (a session takes them over), else
        freed (:meth:`free`)."""
        if seq.kv_holder is not None:
            seq.kv_holder(seq)
        else:
            self.free(seq)

    def write_outside_scheduler(self, seq: Sequence, n: int, logits: str = "none") -> torch.Tensor | None:
        """One forward pass over ``seq``'s ``n`` tokens from ``seq.num_computed`` on, writing their KV into its block
        table's slots, for a sequence the scheduler does not hold (a session compression's reconstruction, an
        evaluation's prefill: blocks from :meth:`allocate`).  The caller owns the blocks and advances
        ``num_computed``.  logits: "none" (returns None) or "prompt" (the (n, vocab) logits of every token).  Raises
        what the model runner raises."""
        return self.runner.forward(self.runner.build_batch([(seq, n)]), logits)

    def compress_prompt(self, seq: Sequence) -> bool:
        """Apply ``seq.compression`` to its observed prompt (:func:`kvkeeper.kvcache.surgery.compress_prompt`)."""
        return compress_prompt(seq, self.pool, self.store, self.reclaim)

    # ---- blocks held outside sequences -----------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Pool blocks free now (never-cached and cached-unreferenced)."""
        return self.pool.num_free

    def allocate_blocks(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, the holders asked to reclaim room first if needed; None when there is none."""
        if n > self.pool.num_free:
            self.reclaim(n - self.pool.num_free)
        return self.pool.allocate(n) if n <= self.pool.num_free else None

    def share_blocks(self, block_ids: list[int]) -> list[int]:
        """Take one more reference on each block (a copy-on-write fork, a hold); returns the same ids."""
        return self.pool.fork(block_ids)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference on each block (from :meth:`allocate_blocks` or :meth:`share_blocks`)."""
        self.pool.free_all(block_ids)

    def shared_blocks(self, block_ids: list[int]) -> list[int]:
        """Those of ``block_ids`` that more than one owner references."""
        return [b for b in block_ids if self.pool.blocks[b].ref_count > 1]

    # ---- the pool: compaction, the prefix cache, figures -----------------
    def compact(self, evict_cache: bool = False) -> dict:
        """Defragment the pool between steps (:func:`kvkeeper.kvcache.surgery.compact`); evict_cache: drop the
        unreferenced cached blocks first.  Returns ``{"evicted", "moved"}`` (blocks)."""
        self.require_uniform("defragmenting the KV pool (compact)")
        return compact(self.pool, (seq.block_table for _, seq in self.holdings()), self.store, evict_cache)

    def evict_cached(self) -> int:
        """Drop every unreferenced block from the prefix cache; returns how many."""
        return self.pool.evict_cached()

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted for reuse since the start (prefix-cache pressure)."""
        return self.pool.evictions

    def hold_prefix(self, namespace: Namespace, token_ids: list[int], ttl_s: float) -> int:
        """Keep the full blocks of ``token_ids`` under ``namespace`` from LRU eviction for ``ttl_s`` seconds (a
        cache breakpoint's prefix; :meth:`BlockPool.hold`, rules in :mod:`kvkeeper.kvcache.retention`); returns
        the blocks held (0 with holds off).  Engine thread only."""
        return self.pool.hold(namespace, token_ids, ttl_s)

    def prefix_tokens(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, of them found there: KV reused) since the start."""
        return self.manager.query_tokens, self.manager.hit_tokens

    def stats(self) -> dict:
        """The pool's and prefix cache's counters now: blocks (total, used, cached, window), usage (0..1), prefix
        query and hit tokens, bytes per token and the KV cache's bytes."""
        pool, (query, hit) = self.pool, self.prefix_tokens()
        return {"kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used,
                "kv_blocks_cached": pool.num_cached, "kv_usage": pool.usage(),
                "prefix_query_tokens": query, "prefix_hit_tokens": hit,
                "kv_bytes_per_token": self.bytes_per_token,
                "kv_cache_bytes": self.runner.kv_cache_bytes, "kv_window_blocks_total": pool.window_blocks or 0,
                "kv_window_blocks_free": pool.num_window_free, **self.hold_stats()}

    def hold_stats(self) -> dict:
        """Retention holds now: ``kv_held_blocks`` (distinct blocks under a live hold, the share bound's count),
        ``kv_holds`` (live holds), and the counters (holds) ``kv_holds_expired``, ``kv_holds_gave_way`` (to
        allocation pressure) and ``kv_holds_displaced`` (by a newer hold, over the share bound)."""
        pool = self.pool
        pool.expire_holds()
        h = pool.holds
        return {"kv_held_blocks": h.num_blocks, "kv_holds": h.num_holds, "kv_holds_expired": h.expired,
                "kv_holds_gave_way": h.gave_way, "kv_holds_displaced": h.displaced}

    def describe(self) -> str:
        """The load line's KV part: format, bytes per token, blocks and their size, a hybrid pool's window blocks."""
        pool = self.pool
        windows = f" ({pool.window_blocks} window blocks)" if pool.window_blocks else ""
        return (f"KV {self.runner.kv_format.name} at {self.bytes_per_token:,} bytes/token, "
                f"{pool.num_blocks} KV blocks of {pool.block_size} tokens{windows}")

    def pool_stats(self) -> PoolStats:
        """Block states and fragmentation figures now (a :class:`kvkeeper.kvcache.telemetry.PoolStats`)."""
        return pool_stats(self.pool, self.holdings(), self.offloaded_blocks())
