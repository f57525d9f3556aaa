"""The scaled KV formats: int8 and fp8 (e4m3) K and V with one float16 scale per token and KV head.

Values: ``(num_blocks, block_size, num_kv_heads, head_dim)`` in the storage dtype; scales ``k_scale``, ``v_scale``:
``(num_blocks, block_size, num_kv_heads)`` float16.  Quantization is symmetric, per token and per KV head (as in
KIVI's per-token keys/values and vLLM's per-token-head int8 KV): ``scale = max|x| / qmax`` over the head dimension,
``q = x / scale`` rounded to int8 in [-127, 127] (``qmax`` 127) or cast to ``torch.float8_e4m3fn`` (``qmax`` 448,
its largest finite value).  Tokens are quantized when written and dequantized (``q * scale``) when attention reads
them, in the compute dtype.  RoPE is applied before the cache, so keys are stored rotated.  An MLA latent cache
holds one scale per token row.

Bytes per token for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), K plus V: int8 and fp8 11,880 (11,520 of
values plus 360 of fp16 scales: 25.8% of fp32).
"""

from __future__ import annotations

import torch

from .base import MIN_SCALE, SCALE_DTYPE, KVFormat, PagedKV

__all__ = ["ScaledPagedKV", "dequantize", "quantize"]


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> (values (..., D) in fmt.storage, scales (...) float16)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / fmt.qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    y = xf / scale.float().unsqueeze(-1)
    if fmt.storage == torch.int8:
        q = y.round_().clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        q = y.clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., D) and scales (...) -> (..., D) in ``dtype``."""
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


class ScaledPagedKV(PagedKV, layout="scaled"):
    """One layer's K/V in int8 or fp8 with a float16 scale per token and KV head (``k_scale``, ``v_scale``:
    (num_blocks, block_size, num_kv_heads); ``v_scale`` None for an MLA latent cache)."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 fmt: KVFormat, device: torch.device | str = "cpu", layer_idx: int = 0, values: bool = True):
        super().__init__(num_blocks, block_size, num_kv_heads, head_dim, fmt, device, layer_idx, values)
        shape = (num_blocks, block_size, num_kv_heads)
        self.k_scale = torch.ones(shape, dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.ones(shape, dtype=SCALE_DTYPE, device=device) if values else None

    def write_latent(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Store MLA latent rows (T, kv_lora_rank + qk_rope_head_dim) into their slots (T,) int64 (one scale
        per row)."""
        nb, bs, _, d = self.k.shape
        q, s = quantize(rows, self.fmt)
        data = self.k.view(torch.uint8) if q.dtype.itemsize == 1 and q.dtype != torch.int8 else self.k
        data.view(nb * bs, d).index_copy_(0, slots, q.view(data.dtype))
        self.k_scale.view(nb * bs).index_copy_(0, slots, s)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new keys/values k, v (T, KVH, D) into their slots (T,) int64, quantized per token and head."""
        nb, bs, kvh, d = self.k.shape
        for data, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize(x, self.fmt)
            if q.dtype.itemsize == 1 and q.dtype != torch.int8:  # float8: copy the bytes (no float8 index_copy on CPU)
                data, q = data.view(torch.uint8), q.view(torch.uint8)
            data.view(nb * bs, kvh, d).index_copy_(0, slots, q)
            scales.view(nb * bs, kvh).index_copy_(0, slots, s)

    def _decode(self, x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(x, scales, dtype)
