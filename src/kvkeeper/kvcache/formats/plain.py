"""The plain KV formats: fp32, bf16 and fp16 K and V, ``(num_blocks, block_size, num_kv_heads, head_dim)`` in the
storage dtype, written and read as they are (no scales).

Bytes per token for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), K plus V: fp32 46,080; bf16/fp16 23,040.
"""

from __future__ import annotations

import torch

from .base import PagedKV

__all__ = ["PlainPagedKV"]


class PlainPagedKV(PagedKV, layout="plain"):
    """One layer's K/V in a plain 16- or 32-bit format (what ``PagedKV(..., fmt)`` makes for fp32, bf16, fp16)."""

    def write_latent(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Store MLA latent rows (T, kv_lora_rank + qk_rope_head_dim) into their slots (T,) int64."""
        nb, bs, _, d = self.k.shape
        self.k.view(nb * bs, d).index_copy_(0, slots, rows.to(self.k.dtype))

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new keys/values k, v (T, KVH, D) into their slots (T,) int64."""
        nb, bs, kvh, d = self.k.shape
        self.k.view(nb * bs, kvh, d).index_copy_(0, slots, k.to(self.k.dtype))
        self.v.view(nb * bs, kvh, d).index_copy_(0, slots, v.to(self.v.dtype))
