"""Paged attention in plain PyTorch (the reference path; device-agnostic).

The KV cache of one layer is a :class:`~kvkeeper.kvcache.quant.PagedKV`: K and V
tensors ``(num_blocks, block_size, num_kv_heads, head_dim)`` (plus scales when
quantized).  A token's *slot* is ``block_id * block_size +
offset``.  Each step the model runner builds one :class:`AttentionMetadata`
and passes it explicitly to every layer (no global context object).

Tokens of all sequences in a step are packed along one axis (``T`` tokens in
all).  Sequences that add exactly one token (decode) are batched into one
padded attention call over their gathered blocks; sequences that add several
tokens (prefill or a prefill chunk) run one causal attention call each.  GQA
is handled by ``scaled_dot_product_attention(enable_gqa=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kvcache.quant import PagedKV


@dataclass
class PrefillSpan:
    """One sequence adding ``q_len`` tokens at positions ``[context_len - q_len, context_len)``."""

    start: int  # index of its first token in the packed batch
    q_len: int
    context_len: int  # tokens in its KV cache after this step (cached + new)
    block_table: torch.Tensor  # (num_blocks_of_seq,) int64
    observer: object | None = None  # a kvcache.compression.PrefillObserver collecting attention statistics


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the runner and shared by all layers.

    slot_mapping: (T,) int64, where each new token's K/V is written.
    decode_indices: (B_d,) int64, packed-token indices of decode tokens.
    decode_block_tables: (B_d, max_blocks) int64, padded with 0.
    decode_context_lens: (B_d,) int64, KV length of each decode sequence (incl. the new token).
    prefills: one :class:`PrefillSpan` per sequence adding more than one token.
    """

    slot_mapping: torch.Tensor
    decode_indices: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # (B_d, 1, 1, L) bool, built lazily once per step
    prefills: list[PrefillSpan] = field(default_factory=list)
    # kernel path (kvkeeper.model.triton_attention): "torch" = this module's reference path
    backend: str = "torch"
    decode_max_len: int | None = None  # host-side max of decode_context_lens (picks the split-K factor)
    decode_num_splits: int | None = None  # fixed split-K factor (CUDA graphs); None: from decode_max_len

    def get_decode_mask(self, block_size: int) -> torch.Tensor:
        if self.decode_mask is None:
            L = self.decode_block_tables.shape[1] * block_size
            ar = torch.arange(L, device=self.decode_context_lens.device)
            self.decode_mask = (ar[None, :] < self.decode_context_lens[:, None])[:, None, None, :]
        return self.decode_mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKV,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' cached plus new K/V.

    q: (T, H, D); k, v: (T, KVH, D) for the new tokens (RoPE already applied).
    The new K/V are first written into the cache.  Returns (T, H, D) in q's dtype.
    With a quantized cache every token, new ones included, is attended to as the
    cache holds it (dequantized), so a prompt gives the same result whether it is
    prefilled in one piece or in chunks.
    """
    if meta.backend == "triton" and not any(p.observer is not None for p in meta.prefills):
        from .triton_attention import triton_paged_attention  # CUDA (or Triton's interpreter) only

        return triton_paged_attention(q, k, v, cache, meta, scale)
    cache.write(k, v, meta.slot_mapping)
    T, H, D = q.shape
    bs = cache.block_size
    if not meta.prefills and meta.decode_indices is not None and meta.decode_indices.numel() == T:
        return _decode_attention(q, cache, meta, scale, bs)  # decode-only step: no scatter
    out = torch.empty_like(q)
    for p in meta.prefills:
        qs = q[p.start : p.start + p.q_len].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
        if p.context_len == p.q_len and not cache.fmt.quantized:  # nothing cached: attend to the new tokens only
            ks = k[p.start : p.start + p.q_len]
            vs = v[p.start : p.start + p.q_len]
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0).to(q.dtype), vs.transpose(0, 1).unsqueeze(0).to(q.dtype),
                is_causal=True, scale=scale, enable_gqa=True,
            )
            if p.observer is not None:
                p.observer.observe(cache.layer_idx, q[p.start : p.start + p.q_len], ks, 0, scale)
        else:
            ks, vs = cache.gather(p.block_table, p.context_len, q.dtype)
            offset = p.context_len - p.q_len
            qpos = torch.arange(p.q_len, device=q.device)[:, None] + offset
            kpos = torch.arange(p.context_len, device=q.device)[None, :]
            mask = kpos <= qpos  # (q, L)
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, scale=scale, enable_gqa=True,
            )
            if p.observer is not None:
                p.observer.observe(cache.layer_idx, q[p.start : p.start + p.q_len], ks, offset, scale)
        out[p.start : p.start + p.q_len] = o[0].transpose(0, 1)
    if meta.decode_indices is not None and meta.decode_indices.numel():
        qd = q.index_select(0, meta.decode_indices)
        out.index_copy_(0, meta.decode_indices, _decode_attention(qd, cache, meta, scale, bs))
    return out


def _decode_attention(qd, cache: PagedKV, meta: AttentionMetadata, scale: float, bs: int) -> torch.Tensor:
    """One query token per decode sequence: qd (B, H, D) over gathered blocks -> (B, H, D)."""
    ks, vs = cache.gather_padded(meta.decode_block_tables, qd.dtype)  # (B, KVH, nb * bs, D) each
    o = F.scaled_dot_product_attention(
        qd.unsqueeze(2), ks, vs, attn_mask=meta.get_decode_mask(bs), scale=scale, enable_gqa=True
    )
    return o.squeeze(2)
