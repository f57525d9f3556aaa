"""Triton kernels for the paged attention path on CUDA (and under Triton's interpreter on CPU).

Three kernels over the paged KV cache of :mod:`kvkeeper.kvcache.formats` (one layer's K and V are
``(num_blocks, block_size, KVH, D)`` contiguous tensors; a token's slot is
``block_id * block_size + offset``; int8 / fp8 caches carry float16 scales ``(num_blocks,
block_size, KVH)`` for K and for V):

* :func:`store_kv` writes the new tokens' K/V (T, KVH, D) into their slots (T,) int64; a negative
  slot (padding rows of a CUDA graph batch) is skipped.  Quantized formats are quantized in PyTorch
  (:func:`kvkeeper.kvcache.formats.int8.quantize`, so values and scales are bit-identical to the CPU path)
  and the kernel scatters values and scales.
* :func:`decode_attention`: one query token per sequence, q (B, H, D), over each sequence's blocks
  (block_tables (B, W) int, context_lens (B,) int).  Split-K "flash-decoding" (Dao et al., 2023):
  the grid is (B, KVH, num_splits); each program takes one KV head and *all* of its GQA group's
  query heads (the group is padded to 16 rows for ``tl.dot``), walks its share of the KV length
  with an online softmax (Milakov & Gimelshein, 2018) and writes an unnormalized partial output plus
  its running max and sum; a second kernel combines the splits.  A sequence of length 0 (padding)
  gets zeros.
* :func:`extend_attention`: several new tokens per sequence (prefill, a prefill chunk, or decode
  tokens of a mixed step) over the cached blocks plus themselves, causally (FlashAttention-2 style
  tiling, Dao 2023): query ``i`` of a sequence with ``q_len`` new tokens and ``context_len`` tokens
  of KV sits at position ``context_len - q_len + i`` and sees keys at positions ``<=`` its own.
  The new tokens are read back from the cache, so a quantized cache is attended to exactly as it
  holds the tokens (the PyTorch reference does the same).

Quantized blocks are dequantized in the kernel: ``value.to(float32) * scale``, then cast to the query
dtype before the product, as the reference (:mod:`kvkeeper.attention.reference`) does.

Only this module imports ``triton``, and only the dispatch (:mod:`kvkeeper.attention.selector`), the
start-up check (:mod:`kvkeeper.worker.kernel_check`) and the CUDA graphs import this module, lazily; it imports
no other attention module.  Importing it without triton installed fails with ImportError, so callers check
:func:`kvkeeper.attention.selector.triton_available` first.
The kernels run on CPU tensors when ``TRITON_INTERPRET=1`` is set before this module is imported
(``triton.jit`` reads it when the kernels are defined; the CI tests do that).

``BT_FAULT`` (a constexpr, 0 in production) adds an offset to every block-table index; it exists
only so that a test can break the kernels on purpose and see the comparison fail.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..kvcache.formats.base import PagedKV
from ..kvcache.formats.int8 import quantize


def _dot_f32(dtype: torch.dtype) -> bool:
    """Under the interpreter, tl.dot on bf16/fp16 operands is wrong (numpy has no bfloat16), so the
    operands, already rounded to the compute dtype, are multiplied as float32: the same products
    (a bf16 x bf16 or fp16 x fp16 product is exact in float32) with float32 accumulation."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and dtype != torch.float32


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---- store -------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ksn_ptr, vsn_ptr, ksc_ptr, vsc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, KVH, D,
                     HAS_SCALES: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_d = tl.arange(0, BLOCK_D)
        md = offs_d < D
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d, mask=md)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d, mask=md)
        dst = slot * KVH * D + h * D + offs_d
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=md)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=md)
        if HAS_SCALES:
            tl.store(ksc_ptr + slot * KVH + h, tl.load(ksn_ptr + t * KVH + h))
            tl.store(vsc_ptr + slot * KVH + h, tl.load(vsn_ptr + t * KVH + h))


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: PagedKV, slots: torch.Tensor) -> None:
    """Write k, v (T, KVH, D) into ``cache`` at slots (T,) int64; slots < 0 are skipped.

    Quantized formats: values and float16 scales come from :func:`kvkeeper.kvcache.formats.int8.quantize`.
    """
    T, KVH, D = k.shape
    if T == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()  # the kernel walks rows and heads by stride, D densely
    v = v if v.stride(-1) == 1 else v.contiguous()
    if cache.fmt.quantized:
        qk, sk = quantize(k, cache.fmt)
        qv, sv = quantize(v, cache.fmt)
        k, v = qk.contiguous(), qv.contiguous()
        sk, sv = sk.contiguous(), sv.contiguous()
        ksc, vsc = cache.k_scale, cache.v_scale
    else:
        sk = sv = ksc = vsc = k  # unused placeholders (HAS_SCALES=False)
    kc, vc = cache.k, cache.v
    if kc.element_size() == 1 and kc.dtype != torch.int8:  # fp8: copy the bytes (no fp8 arithmetic needed)
        k, v, kc, vc = k.view(torch.uint8), v.view(torch.uint8), kc.view(torch.uint8), vc.view(torch.uint8)
    _store_kv_kernel[(T, KVH)](
        k, v, kc, vc, sk, sv, ksc, vsc, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), KVH, D,
        HAS_SCALES=cache.fmt.quantized, BLOCK_D=_next_pow2(D),
    )


# ---- shared tile helpers -------------------------------------------------------------------------


@triton.jit
def _kv_tile(bt_row, toks, mt, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, kvh, offs_d, md, like, KVH, D, BS,
             HAS_SCALES: tl.constexpr, BT_FAULT: tl.constexpr):
    """K and V of tokens ``toks`` (mask ``mt``) of KV head ``kvh``, read through the block-table row
    ``bt_row``, dequantized with their scales when the cache has them, in ``like``'s dtype: each (N, BLOCK_D)."""
    blk = tl.load(bt_row + toks // BS + BT_FAULT, mask=mt, other=0).to(tl.int64)
    slot = blk * BS + toks % BS
    off = slot[:, None] * (KVH * D) + kvh * D + offs_d[None, :]
    mkv = mt[:, None] & md[None, :]
    k = tl.load(kc_ptr + off, mask=mkv, other=0.0)
    v = tl.load(vc_ptr + off, mask=mkv, other=0.0)
    if HAS_SCALES:
        ks = tl.load(ksc_ptr + slot * KVH + kvh, mask=mt, other=0.0).to(tl.float32)
        vs = tl.load(vsc_ptr + slot * KVH + kvh, mask=mt, other=0.0).to(tl.float32)
        k = k.to(tl.float32) * ks[:, None]
        v = v.to(tl.float32) * vs[:, None]
    return k.to(like.dtype), v.to(like.dtype)


@triton.jit
def _scores(q, k, scale, DOT_F32: tl.constexpr):
    """q (R, D) x k (N, D)^T * scale -> (R, N) float32 (in float32 throughout when DOT_F32)."""
    if DOT_F32:
        sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    return sc


@triton.jit
def _weighted_values(p, v, DOT_F32: tl.constexpr):
    """p (R, N) x v (N, D) -> (R, D) float32."""
    if DOT_F32:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v, input_precision="ieee")
    return pv


# ---- decode (split-K) --------------------------------------------------------------------------


@triton.jit
def _softmax_update(sc, m_i, l_i):
    """One key tile of the online softmax (Milakov & Gimelshein, 2018): scores sc (R, N) float32 (-inf where
    masked), running max m_i and sum l_i (R,) float32.  A row that has seen no visible key yet keeps m = -inf and
    adds nothing.  Returns (p (R, N) the tile's weights, alpha (R,) the rescale of the running output, m, l);
    the caller adds p @ v to its output scaled by alpha (kept out of here: the interpreter runs a jit helper
    called from a kernel, not one called from a helper)."""
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(sc - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, bt_ptr, len_ptr,
                         acc_ptr, ml_ptr, scale,
                         stride_qb, stride_qh, stride_bt, num_splits, KVH, D, G, BS,
                         HAS_SCALES: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BT_FAULT: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    H = KVH * G
    L = tl.load(len_ptr + b).to(tl.int32)
    per = tl.cdiv(L, num_splits)
    start = s * per
    end = tl.minimum(start + per, L)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mg = offs_g < G
    md = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mg[:, None] & md[None, :], other=0.0)
    cdt = q.dtype
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        mt = toks < end
        k, v = _kv_tile(bt_ptr + b * stride_bt, toks, mt, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, kvh, offs_d, md, q,
                        KVH, D, BS, HAS_SCALES, BT_FAULT)
        sc = _scores(q, k, scale, DOT_F32)  # (G, N)
        sc = tl.where(mt[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = _softmax_update(sc, m_i, l_i)
        acc = acc * alpha[:, None] + _weighted_values(p.to(cdt), v, DOT_F32)
    # partial results: acc (B, H, S, D) and (m, l) (B, H, S, 2), float32
    row = (b * H + heads) * num_splits + s
    tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=mg[:, None] & md[None, :])
    tl.store(ml_ptr + row * 2, m_i, mask=mg)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=mg)


@triton.jit
def _decode_reduce_kernel(acc_ptr, ml_ptr, o_ptr, stride_ob, stride_oh, num_splits, H, D,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ms = offs_s < num_splits
    md = offs_d < D
    row = (b * H + h) * num_splits + offs_s
    m = tl.load(ml_ptr + row * 2, mask=ms, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=ms, other=0.0)
    M = tl.max(m, 0)
    M = tl.where(M == float("-inf"), 0.0, M)  # every split empty (a padding row): output zeros
    w = tl.exp(m - M)
    acc = tl.load(acc_ptr + row[:, None] * D + offs_d[None, :], mask=ms[:, None] & md[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    den = tl.where(den > 0, den, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, (num / den).to(o_ptr.dtype.element_ty), mask=md)


def choose_num_splits(batch: int, num_kv_heads: int, max_len: int, target_programs: int = 512,
                      min_tokens_per_split: int = 256, max_splits: int = 64) -> int:
    """Splits of the KV length per (sequence, KV head): enough programs to fill the GPU at small
    batches, never splits shorter than ``min_tokens_per_split`` tokens."""
    by_len = -(-max(1, max_len) // min_tokens_per_split)
    by_occupancy = -(-target_programs // max(1, batch * num_kv_heads))
    return int(max(1, min(by_len, by_occupancy, max_splits)))


def decode_attention(q: torch.Tensor, cache: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, max_len: int | None = None, num_splits: int | None = None,
                     block_n: int = 64, _bt_fault: int = 0) -> torch.Tensor:
    """Attention of one new query per sequence over its paged KV.

    q: (B, H, D) in the compute dtype; block_tables: (B, W) int32/int64 (entries past a sequence's
    blocks are ignored); context_lens: (B,) int, KV tokens of each sequence (0 = padding row, output
    zeros).  ``max_len`` (host int, an upper bound of context_lens) picks the number of splits when
    ``num_splits`` is not given; CUDA graphs pass a fixed ``num_splits``.  Returns (B, H, D) in q's dtype.
    """
    B, H, D = q.shape
    KVH = cache.k.shape[2]
    if H % KVH:
        raise ValueError(f"{H} query heads are not a multiple of {KVH} KV heads")
    G = H // KVH
    if num_splits is None:
        num_splits = choose_num_splits(B, KVH, max_len if max_len is not None else block_tables.shape[1] * cache.block_size)
    q = q.contiguous()
    acc = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, H, num_splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if B == 0:
        return out
    ks = cache.k_scale if cache.fmt.quantized else cache.k
    vs = cache.v_scale if cache.fmt.quantized else cache.v
    _decode_split_kernel[(B, KVH, num_splits)](
        q, cache.k, cache.v, ks, vs, block_tables, context_lens, acc, ml, float(scale),
        q.stride(0), q.stride(1), block_tables.stride(0), num_splits, KVH, D, G, cache.block_size,
        HAS_SCALES=cache.fmt.quantized, BLOCK_G=max(16, _next_pow2(G)), BLOCK_N=block_n,
        BLOCK_D=max(16, _next_pow2(D)), BT_FAULT=_bt_fault, DOT_F32=_dot_f32(q.dtype),
    )
    _decode_reduce_kernel[(B, H)](acc, ml, out, out.stride(0), out.stride(1), num_splits, H, D,
                                  BLOCK_S=max(2, _next_pow2(num_splits)), BLOCK_D=_next_pow2(D))
    return out


# ---- extend / prefill --------------------------------------------------------------------------


@triton.jit
def _extend_kernel(q_ptr, o_ptr, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, bt_ptr, qstart_ptr, qlen_ptr, ctx_ptr,
                   scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, KVH, D, G, BS,
                   HAS_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BT_FAULT: tl.constexpr, DOT_F32: tl.constexpr):
    sq = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // G
    q0 = tl.load(qstart_ptr + sq).to(tl.int64)
    qlen = tl.load(qlen_ptr + sq).to(tl.int32)
    ctx = tl.load(ctx_ptr + sq).to(tl.int32)
    offset = ctx - qlen  # position of the first new token
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mm = offs_m < qlen
    md = offs_d < D
    q = tl.load(q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    cdt = q.dtype
    qpos = offset + offs_m
    # keys this tile can see: positions [0, offset + last query of the tile]; none for an empty tile
    kv_end = tl.where(mb * BLOCK_M < qlen, tl.minimum(ctx, offset + (mb + 1) * BLOCK_M), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t0 in range(0, kv_end, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        mt = toks < kv_end
        k, v = _kv_tile(bt_ptr + sq * stride_bt, toks, mt, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, kvh, offs_d, md, q,
                        KVH, D, BS, HAS_SCALES, BT_FAULT)
        sc = _scores(q, k, scale, DOT_F32)  # (M, N)
        visible = (toks[None, :] <= qpos[:, None]) & mt[None, :]
        sc = tl.where(visible, sc, float("-inf"))
        p, alpha, m_i, l_i = _softmax_update(sc, m_i, l_i)
        acc = acc * alpha[:, None] + _weighted_values(p.to(cdt), v, DOT_F32)
    l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(o_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=mm[:, None] & md[None, :])


def extend_attention(q: torch.Tensor, cache: PagedKV, q_starts: torch.Tensor, q_lens: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_q_len: int,
                     out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                     _bt_fault: int = 0) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged KV (cached plus new).

    q: (T, H, D); sequence ``s`` owns rows ``q_starts[s] : q_starts[s] + q_lens[s]`` of q and has
    ``context_lens[s]`` tokens of KV (its new tokens included, already stored) in the blocks of
    ``block_tables[s]`` ((S, W) int).  ``max_q_len``: host int, the largest q_len.  Rows of q that
    belong to no sequence are left untouched in ``out`` (default: a new empty tensor).  Returns
    (T, H, D) in q's dtype.  Tiles: ``block_m`` queries x ``block_n`` keys (default 64 x 64 on CUDA,
    16 x 32 elsewhere, i.e. under the interpreter).
    """
    T, H, D = q.shape
    block_m = block_m or (64 if q.is_cuda else 16)
    block_n = block_n or (64 if q.is_cuda else 32)
    KVH = cache.k.shape[2]
    if H % KVH:
        raise ValueError(f"{H} query heads are not a multiple of {KVH} KV heads")
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if out.stride(-1) != 1:
        raise ValueError("extend_attention: out must be dense in its last dimension")
    S = q_lens.shape[0]
    if S == 0 or T == 0:
        return out
    ks = cache.k_scale if cache.fmt.quantized else cache.k
    vs = cache.v_scale if cache.fmt.quantized else cache.v
    grid = (S, H, -(-max_q_len // block_m))
    _extend_kernel[grid](
        q, out, cache.k, cache.v, ks, vs, block_tables, q_starts, q_lens, context_lens, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), KVH, D, H // KVH,
        cache.block_size, HAS_SCALES=cache.fmt.quantized, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, _next_pow2(D)), BT_FAULT=_bt_fault, DOT_F32=_dot_f32(q.dtype),
    )
    return out


# ---- the step: same contract as kvkeeper.attention.reference.paged_attention -----------------------


def _extend_inputs(meta, device):
    """Per-step (built once, shared by all layers): every sequence of a mixed step as an extend span."""
    cached = getattr(meta, "_triton_extend", None)
    if cached is not None:
        return cached
    starts, lens, ctx, tables = [], [], [], []
    for p in meta.prefills:
        starts.append(p.start)
        lens.append(p.q_len)
        ctx.append(p.context_len)
        tables.append(p.block_table.cpu())
    if meta.decode_indices is not None and meta.decode_indices.numel():
        starts += meta.decode_indices.cpu().tolist()
        lens += [1] * meta.decode_indices.numel()
        ctx += meta.decode_context_lens.cpu().tolist()
        tables += list(meta.decode_block_tables.cpu())
    width = max(1, max(t.numel() for t in tables))
    bt = torch.zeros(len(tables), width, dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, : t.numel()] = t
    res = (torch.tensor(starts, dtype=torch.int64, device=device), torch.tensor(lens, dtype=torch.int64, device=device),
           torch.tensor(ctx, dtype=torch.int64, device=device), bt.to(device), max(lens))
    meta._triton_extend = res
    return res


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV, meta,
                           scale: float) -> torch.Tensor:
    """The kernel path of :func:`kvkeeper.attention.reference.paged_attention` (same shapes and contract).

    q: (T, H, D); k, v: (T, KVH, D).  Decode-only steps use :func:`decode_attention` (the number of
    splits from ``meta.decode_num_splits`` when set, e.g. by a CUDA graph, else from
    ``meta.decode_max_len``); steps with prefills run every sequence through :func:`extend_attention`.
    """
    store_kv(k, v, cache, meta.slot_mapping)
    T = q.shape[0]
    if not meta.prefills and meta.decode_indices is not None and meta.decode_indices.numel() == T:
        return decode_attention(q, cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                max_len=getattr(meta, "decode_max_len", None),
                                num_splits=getattr(meta, "decode_num_splits", None))
    starts, lens, ctx, bt, max_q = _extend_inputs(meta, q.device)
    return extend_attention(q, cache, starts, lens, ctx, bt, scale, max_q)
