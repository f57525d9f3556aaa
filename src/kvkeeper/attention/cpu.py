"""Attention on CPU that reads the paged KV cache in place (the C++ kernels of csrc/cpu/attention.cpp).

:func:`decode_attention` has the contract of :func:`kvkeeper.attention.reference.decode_attention` (the
reference, which gathers every block of every sequence into a padded tensor each step): qd (B, H, D) ->
(B, H, D) in qd's dtype, for sequences whose KV lengths are ``meta.decode_context_lens`` and whose blocks
are ``meta.decode_block_tables``; with ``meta.window`` (sliding-window layers) a query at KV index i reads
keys (i - window, i] only, in both kernels.  The kernel walks each sequence's blocks where they lie, dequantizing
int8 / fp8 tokens on the fly (value * float16 scale, as :func:`kvkeeper.kvcache.formats.int8.dequantize`),
with an online softmax (Milakov & Gimelshein, 2018); the context is cut into chunks of
:data:`SPLIT_BLOCKS` blocks that run in parallel and are combined at the end (flash-decoding, Dao et al.,
2023).  The chunking depends only on each sequence's own length, so a sequence's result does not depend
on the other sequences of the batch.  Computed in float32 (a bfloat16/float16 query is converted).

:func:`paged_attention` is the whole step with the contract of :func:`kvkeeper.attention.reference.paged_attention`:
the new K/V are written, prefill spans go through ``extend_attention`` (causal, FlashAttention-2 style tiles of
16 queries times the GQA group, over the blocks in place: no gather of the context), decode tokens through
:func:`decode_attention`.  Every token, new ones included, is attended to as the cache holds it.  A span whose
prefill collects attention statistics for KV compression hands its observer the same queries and keys as the
reference does; its output does not depend on whether it is observed.

A KIVI int4 / int2 cache (:class:`kvkeeper.kvcache.formats.kivi.KiviPagedKV`) goes through ``kivi_attention`` (section 2c of
csrc/cpu/attention.cpp) for prefill spans and decode tokens alike (a decode token is a span of one query): packed
codes and the 16-bit window read in place, a query's own block from the window (the own-block rule of
:class:`kvkeeper.kvcache.formats.kivi.KiviPagedKV`), 16 keys converted at a time for every query lane that reads them,
scales folded into the query and the softmax weights; invariant by construction (the same in both modes of
``set_invariant_attention``).
"""

from __future__ import annotations

import torch

from ..kvcache.formats.base import PagedKV
from ..kernels import cpu as cpu_kernels
from .metadata import AttentionMetadata

SPLIT_BLOCKS = 16  # blocks per parallel work item (256 tokens at the default block size)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
_EMPTY = torch.empty(0, dtype=torch.float16)


def supported(cache: PagedKV) -> bool:
    """Whether the kernel reads this cache's storage dtype (float32, bfloat16, float16, int8, fp8 e4m3, KIVI)."""
    return (cache.k.dtype in _KIND or cache.fmt.kivi) and cache.k.device.type == "cpu"


def kivi_attention(q: torch.Tensor, cache, starts: torch.Tensor, q_lens: torch.Tensor, ctxs: torch.Tensor,
                   block_tables: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Spans of queries over a KIVI cache, read in place: q (T, H, D) float (any float dtype, computed in
    float32); starts, q_lens, ctxs (S,) int64, block_tables (S, W) int64 -> (T, H, D) float32 (rows outside
    every span zero).  Raises RuntimeError when the kernels are not loaded."""
    mod = cpu_kernels.load()
    if mod is None:
        raise RuntimeError(f"the CPU kernels are unavailable ({cpu_kernels.unavailable_reason()})")
    return mod.kivi_attention(q if q.dtype == torch.float32 else q.float(), cache.k, cache.v, cache.k_scale,
                              cache.k_min, cache.v_scale, cache.v_min, cache.res_of, cache.res_k, cache.res_v,
                              starts, q_lens, ctxs, block_tables, scale, cache.fmt.bits, window or 0)


def _kivi_inputs(meta: AttentionMetadata):
    """Per step (built once, shared by all layers): prefill spans and decode tokens as spans, int64 tensors."""
    cached = getattr(meta, "_cpu_kivi", None)
    if cached is not None:
        return cached
    spans = list(meta.prefills)
    starts = [p.start for p in spans]
    qlens = [p.q_len for p in spans]
    ctxs = [p.context_len for p in spans]
    width = max([int(p.block_table.numel()) for p in spans] + [0])
    nd = 0
    if meta.decode_indices is not None and meta.decode_indices.numel():
        nd = meta.decode_indices.numel()
        starts += meta.decode_indices.tolist()
        qlens += [1] * nd
        ctxs += meta.decode_context_lens.tolist()
        width = max(width, meta.decode_block_tables.shape[1])
    bt = torch.zeros(len(starts), width, dtype=torch.int64)
    for i, p in enumerate(spans):
        bt[i, : p.block_table.numel()] = p.block_table
    if nd:
        bt[len(spans):, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
    res = (torch.tensor(starts, dtype=torch.int64), torch.tensor(qlens, dtype=torch.int64),
           torch.tensor(ctxs, dtype=torch.int64), bt)
    meta._cpu_kivi = res
    return res


def _kivi_step(q, k, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The whole step over a KIVI cache: prefill spans and decode tokens in one kernel call."""
    out = kivi_attention(q, cache, *_kivi_inputs(meta), scale, meta.window)
    for p in meta.prefills:  # attention statistics for KV compression, with the reference's inputs
        if p.observer is not None:
            keys = cache.gather_keys(p.block_table, p.context_len, q.dtype)
            p.observer.observe(cache.layer_idx, q[p.start: p.start + p.q_len], keys, p.context_len - p.q_len, scale)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _kv_args(cache: PagedKV):
    k, v = cache.k, cache.v
    kind = _KIND[k.dtype]
    if kind == 4:  # float8 bytes (the kernels decode e4m3 themselves)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    ks = cache.k_scale if cache.k_scale is not None else _EMPTY
    vs = cache.v_scale if cache.v_scale is not None else _EMPTY
    return k, v, ks, vs, kind


def _extend_inputs(meta: AttentionMetadata):
    """Per step (built once, shared by all layers): the prefill spans as int64 tensors."""
    cached = getattr(meta, "_cpu_extend", None)
    if cached is not None:
        return cached
    spans = meta.prefills
    width = max(p.block_table.numel() for p in spans)
    bt = torch.zeros(len(spans), width, dtype=torch.int64)
    for i, p in enumerate(spans):
        bt[i, : p.block_table.numel()] = p.block_table
    res = (torch.tensor([p.start for p in spans], dtype=torch.int64),
           torch.tensor([p.q_len for p in spans], dtype=torch.int64),
           torch.tensor([p.context_len for p in spans], dtype=torch.int64), bt)
    meta._cpu_extend = res
    return res


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q (T, H, D), k and v (T, KVH, D) of the step's new tokens -> (T, H, D) in q's dtype (see the module
    docstring).  Raises RuntimeError when the kernels are not loaded."""
    mod = cpu_kernels.load()
    if mod is None:
        raise RuntimeError(f"the CPU kernels are unavailable ({cpu_kernels.unavailable_reason()})")
    cache.write(k, v, meta.slot_mapping)
    if cache.fmt.kivi:
        return _kivi_step(q, k, cache, meta, scale)
    if meta.decode_only:
        return decode_attention(q, cache, meta, scale)
    kc, vc, ks, vs, kind = _kv_args(cache)
    starts, qlens, ctxs, bt = _extend_inputs(meta)
    qf = q if q.dtype == torch.float32 else q.float()
    out = mod.extend_attention(qf, kc, vc, ks, vs, starts, qlens, ctxs, bt, scale, kind, meta.window or 0)
    if meta.decode_indices is not None and meta.decode_indices.numel():
        qd = qf.index_select(0, meta.decode_indices)
        out.index_copy_(0, meta.decode_indices, decode_attention(qd, cache, meta, scale))
    for p in meta.prefills:  # attention statistics for KV compression, with the reference's inputs
        if p.observer is not None:
            qs = q[p.start: p.start + p.q_len]
            if p.context_len == p.q_len and not cache.fmt.quantized:
                p.observer.observe(cache.layer_idx, qs, k[p.start: p.start + p.q_len], 0, scale)
            else:
                keys = cache.gather_keys(p.block_table, p.context_len, q.dtype)
                p.observer.observe(cache.layer_idx, qs, keys, p.context_len - p.q_len, scale)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def decode_attention(qd: torch.Tensor, cache: PagedKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """qd (B, H, D) float -> (B, H, D) in qd's dtype; raises RuntimeError when the kernels are not loaded."""
    mod = cpu_kernels.load()
    if mod is None:
        raise RuntimeError(f"the CPU kernels are unavailable ({cpu_kernels.unavailable_reason()})")
    if cache.fmt.kivi:
        n = qd.shape[0]
        ar = torch.arange(n, dtype=torch.int64)
        out = kivi_attention(qd, cache, ar, torch.ones(n, dtype=torch.int64), meta.decode_context_lens.to(torch.int64),
                             meta.decode_block_tables.to(torch.int64), scale, meta.window)
        return out if qd.dtype == torch.float32 else out.to(qd.dtype)
    k, v, ks, vs, kind = _kv_args(cache)
    out = mod.decode_attention(qd if qd.dtype == torch.float32 else qd.float(), k, v, ks, vs,
                               meta.decode_block_tables, meta.decode_context_lens, scale, kind, SPLIT_BLOCKS,
                               meta.window or 0)
    return out if qd.dtype == torch.float32 else out.to(qd.dtype)
