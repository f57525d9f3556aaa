"""The engine's KV-facing methods (a mixin of :class:`~kvkeeper.engine.llm_engine.LLMEngine`, over its ``pool``,
``kv``, ``runner``, ``scheduler`` and ``holders``): what sessions, diagnostics and the server call to hold, move and
measure KV.  Sizes in blocks and bytes; block ids index the pool."""

from __future__ import annotations

import json
from typing import Iterator

from ..errors import InvalidRequestError
from ..kvcache.surgery import compact, compress_prompt
from ..kvcache.telemetry import pool_stats
from .handle import KVHolder
from .sequence import Sequence


class EngineKV:
    """KV holders, the KV store handle, block allocation for holders, compaction and pool figures."""

    def require_uniform_kv(self, what: str) -> None:
        """Raise InvalidRequestError when ``what`` (reading or moving all layers' KV by block id) meets hybrid KV."""
        if self.runner.window_blocks:
            raise InvalidRequestError(f"{what} is not supported with the hybrid KV cache of a sliding-window model "
                                      "(its sliding layers keep KV per window); start the engine with "
                                      "--no-hybrid-kv-cache (hybrid_kv_cache=False) to use it")

    def kv_numerics(self) -> dict:
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
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    @property
    def kv_store(self):
        """The :class:`~kvkeeper.kvcache.store.KVStore` of every layer's KV (blocks: the methods below)."""
        return self.runner.kv_store

    def add_kv_holder(self, holder: KVHolder) -> None:
        """Register something that holds KV between requests (a session manager)."""
        self.holders.append(holder)

    def reclaim(self, n_blocks: int) -> int:
        """Ask the KV holders to release about ``n_blocks`` pool blocks; returns how many they released."""
        return self.holders.reclaim(n_blocks)

    def kv_holdings(self) -> Iterator[tuple[str, Sequence]]:
        """(owner, sequence) of every block table: running and waiting requests, then holders' (``session:<id>``)."""
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            yield seq.request_id, seq
        yield from self.holders.kv_holdings()

    def offloaded_blocks(self) -> int:
        """Blocks' worth of KV the holders keep outside the pool (host memory and disk tiers)."""
        return self.holders.offloaded_blocks()

    def compact(self, evict_cache: bool = False) -> dict:
        """Defragment the pool between steps (:func:`kvkeeper.kvcache.surgery.compact`); evict_cache: drop the
        unreferenced cached blocks first.  Returns ``{"evicted", "moved"}`` (blocks)."""
        self.require_uniform_kv("defragmenting the KV pool (compact)")
        return compact(self.pool, (seq.block_table for _, seq in self.kv_holdings()), self.kv_store, evict_cache)

    def evict_cached(self) -> int:
        """Drop every unreferenced block from the prefix cache; returns how many."""
        return self.pool.evict_cached()

    def free_kv(self, seq: Sequence) -> int:
        """Release a sequence's blocks (its full blocks stay in the prefix cache as cached-free); returns the blocks
        returned to the pool's free list (a block another owner, e.g. a fork, still references is not)."""
        before = self.pool.num_used
        self.kv.free(seq)
        return before - self.pool.num_used

    def truncate_kv(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of a sequence's first ``num_tokens`` tokens only (freeing the blocks past them)."""
        self.kv.truncate(seq, num_tokens)

    def commit_kv(self, seq: Sequence) -> None:
        """Register a sequence's full blocks in the prefix cache under their chained hashes."""
        self.kv.commit(seq)

    def compress_prompt_kv(self, seq: Sequence) -> bool:
        """Apply ``seq.compression`` to its observed prompt (:func:`kvkeeper.kvcache.surgery.compress_prompt`)."""
        return compress_prompt(seq, self.pool, self.kv_store, self.reclaim)

    def allocate_kv_blocks(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, the holders asked to reclaim room first if needed; None when there is none."""
        if n > self.pool.num_free:
            self.reclaim(n - self.pool.num_free)
        return self.pool.allocate(n) if n <= self.pool.num_free else None

    def share_kv_blocks(self, block_ids: list[int]) -> list[int]:
        """Take one more reference on each block (a copy-on-write fork, a hold); returns the same ids."""
        return self.pool.fork(block_ids)

    def free_kv_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference on each block (from :meth:`allocate_kv_blocks` or :meth:`share_kv_blocks`)."""
        self.pool.free_all(block_ids)

    def shared_kv_blocks(self, block_ids: list[int]) -> list[int]:
        """Those of ``block_ids`` that more than one owner references."""
        return [b for b in block_ids if self.pool.blocks[b].ref_count > 1]

    @property
    def num_free_blocks(self) -> int:
        """Pool blocks free now (never-cached and cached-unreferenced)."""
        return self.pool.num_free

    def pool_stats(self):
        """Block states and fragmentation figures now (a :class:`kvkeeper.kvcache.telemetry.PoolStats`)."""
        return pool_stats(self.pool, self.kv_holdings(), self.offloaded_blocks())

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted for reuse since the start (prefix-cache pressure)."""
        return self.pool.evictions
