"""Paged attention in plain PyTorch (the reference path; device-agnostic).

The KV cache of one layer is a :class:`~kvkeeper.kvcache.formats.base.PagedKV`: K and V
tensors ``(num_blocks, block_size, num_kv_heads, head_dim)`` (plus scales when
quantized).  A token's *slot* is ``block_id * block_size +
offset``.  Each step the model runner builds one :class:`AttentionMetadata`
and passes it explicitly to every layer (no global context object).

Tokens of all sequences in a step are packed along one axis (``T`` tokens in
all).  Sequences that add exactly one token (decode) are batched into one
padded attention call over their gathered blocks; sequences that add several
tokens (prefill or a prefill chunk) run one causal attention call each.  GQA
is handled by ``scaled_dot_product_attention(enable_gqa=True)``.

This module is the reference: it imports no kernel module.  Which path computes a step is decided in
:mod:`kvkeeper.attention.selector`, which may hand :func:`paged_attention` a faster decode routine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kvcache.formats.base import PagedKV
from .metadata import AttentionMetadata, PrefillSpan

__all__ = ["AttentionMetadata", "PrefillSpan", "paged_attention"]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKV,
    meta: AttentionMetadata,
    scale: float,
    decode: Callable | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' cached plus new K/V.

    q: (T, H, D); k, v: (T, KVH, D) for the new tokens (RoPE already applied).
    The new K/V are first written into the cache.  Returns (T, H, D) in q's dtype.
    With a quantized cache every token, new ones included, is attended to as the
    cache holds it (dequantized), so a prompt gives the same result whether it is
    prefilled in one piece or in chunks.
    decode: ``f(qd (B, H, D), cache, meta, scale) -> (B, H, D)`` for the decode tokens (default: the
    gathered SDPA of :func:`decode_attention`).
    """
    decode = decode or decode_attention
    cache.write(k, v, meta.slot_mapping)
    T, H, D = q.shape
    if meta.decode_only:
        return decode(q, cache, meta, scale)  # decode-only step: no scatter
    out = torch.empty_like(q)
    for p in meta.prefills:
        if cache.fmt.kivi:
            out[p.start : p.start + p.q_len] = kivi_span_attention(q[p.start : p.start + p.q_len], cache,
                                                                    p.block_table, p.context_len, meta.window, scale)
            if p.observer is not None:
                ks = cache.gather_for_reference(p.block_table, p.context_len, q.dtype)[0]
                p.observer.observe(cache.layer_idx, q[p.start : p.start + p.q_len], ks,
                                   p.context_len - p.q_len, scale)
            continue
        qs = q[p.start : p.start + p.q_len].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
        if p.context_len == p.q_len and not cache.fmt.quantized:  # nothing cached: attend to the new tokens only
            ks = k[p.start : p.start + p.q_len]
            vs = v[p.start : p.start + p.q_len]
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0).to(q.dtype), vs.transpose(0, 1).unsqueeze(0).to(q.dtype),
                attn_mask=None if meta.window is None else _mask(p.q_len, p.q_len, meta.window, q.device),
                is_causal=meta.window is None, scale=scale, enable_gqa=True,
            )
            if p.observer is not None:
                p.observer.observe(cache.layer_idx, q[p.start : p.start + p.q_len], ks, 0, scale)
        else:
            ks, vs = cache.gather(p.block_table, p.context_len, q.dtype)
            offset = p.context_len - p.q_len
            mask = _mask(p.q_len, p.context_len, meta.window, q.device)  # (q, L)
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, scale=scale, enable_gqa=True,
            )
            if p.observer is not None:
                p.observer.observe(cache.layer_idx, q[p.start : p.start + p.q_len], ks, offset, scale)
        out[p.start : p.start + p.q_len] = o[0].transpose(0, 1)
    if meta.decode_indices is not None and meta.decode_indices.numel():
        qd = q.index_select(0, meta.decode_indices)
        out.index_copy_(0, meta.decode_indices, decode(qd, cache, meta, scale))
    return out


def _mask(q_len: int, context_len: int, window: int | None, device) -> torch.Tensor:
    """(q_len, context_len) bool: query j (KV index context_len - q_len + j) sees key i when i <= its index and,
    with a window, i > its index - window (transformers' sliding-window mask)."""
    qpos = torch.arange(q_len, device=device)[:, None] + (context_len - q_len)
    kpos = torch.arange(context_len, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def decode_attention(qd: torch.Tensor, cache: PagedKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query token per decode sequence: qd (B, H, D) over gathered blocks -> (B, H, D).

    Gathers every block of every sequence into a padded (B, KVH, max_blocks * block_size, D) tensor in the
    compute dtype, then one masked SDPA call: simple and device-agnostic, the reference for the kernels.
    A KIVI cache goes row by row through :func:`kivi_span_attention` (the own-block rule)."""
    if cache.fmt.kivi:
        lens = meta.decode_context_lens.tolist()
        nb = [-(-n // cache.block_size) for n in lens]
        return torch.cat([kivi_span_attention(qd[i : i + 1], cache, meta.decode_block_tables[i, : nb[i]], lens[i],
                                              meta.window, scale) for i in range(qd.shape[0])])
    ks, vs = cache.gather_padded(meta.decode_block_tables, qd.dtype)  # (B, KVH, nb * bs, D) each
    o = F.scaled_dot_product_attention(
        qd.unsqueeze(2), ks, vs, attn_mask=meta.get_decode_mask(cache.block_size), scale=scale, enable_gqa=True
    )
    return o.squeeze(2)


def kivi_span_attention(q: torch.Tensor, cache, block_table: torch.Tensor, context_len: int, window: int | None,
                        scale: float) -> torch.Tensor:
    """The last q.shape[0] positions of a sequence over a KIVI cache (:class:`kvkeeper.kvcache.formats.kivi.KiviPagedKV`),
    with its own-block rule: a query reads the keys and values of its own block (the block of its position) from
    the 16-bit window when that block has a copy there, every other block dequantized from its codes.
    q (n, H, D) -> (n, H, D) in q's dtype, computed in float32."""
    k, v, kw, vw, has = cache.gather_for_reference(block_table, context_len, torch.float32)
    n = q.shape[0]
    qpos = torch.arange(n)[:, None] + (context_len - n)
    kpos = torch.arange(context_len)[None, :]
    own = (kpos // cache.block_size == qpos // cache.block_size) & has[None, :]  # (n, L)
    G = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # (H, n, D)
    rep = lambda x: x.transpose(0, 1).repeat_interleave(G, 0)  # noqa: E731  (L, KVH, D) -> (H, L, D)
    s = torch.where(own, qf @ rep(kw).transpose(1, 2), qf @ rep(k).transpose(1, 2)) * scale
    s = s.masked_fill(~_mask(n, context_len, window, q.device), float("-inf"))
    p = s.softmax(-1)
    o = (p * own) @ rep(vw) + (p * ~own) @ rep(v)
    return o.transpose(0, 1).to(q.dtype)
