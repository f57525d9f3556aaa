"""Decode attention on CPU that reads the paged KV cache in place (the C++ kernel of csrc/kvk_cpu.cpp).

:func:`decode_attention` has the contract of :func:`kvkeeper.model.attention.decode_attention` (the
reference, which gathers every block of every sequence into a padded tensor each step): qd (B, H, D) ->
(B, H, D) in qd's dtype, for sequences whose KV lengths are ``meta.decode_context_lens`` and whose blocks
are ``meta.decode_block_tables``.  The kernel walks each sequence's blocks where they lie, dequantizing
int8 / fp8 tokens on the fly (value * float16 scale, as :func:`kvkeeper.kvcache.quant.dequantize`),
with an online softmax (Milakov & Gimelshein, 2018); the context is cut into chunks of
:data:`SPLIT_BLOCKS` blocks that run in parallel and are combined at the end (flash-decoding, Dao et al.,
2023).  The chunking depends only on each sequence's own length, so a sequence's result does not depend
on the other sequences of the batch.  Computed in float32 (a bfloat16/float16 query is converted).
"""

from __future__ import annotations

import torch

from ..kvcache.quant import PagedKV
from . import cpu_kernels
from .attn_meta import AttentionMetadata

SPLIT_BLOCKS = 16  # blocks per parallel work item (256 tokens at the default block size)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
_EMPTY = torch.empty(0, dtype=torch.float16)


def supported(cache: PagedKV) -> bool:
    """Whether the kernel reads this cache's storage dtype (float32, bfloat16, float16, int8, fp8 e4m3)."""
    return cache.k.dtype in _KIND and cache.k.device.type == "cpu"


def decode_attention(qd: torch.Tensor, cache: PagedKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """qd (B, H, D) float -> (B, H, D) in qd's dtype; raises RuntimeError when the kernels are not loaded."""
    mod = cpu_kernels.load()
    if mod is None:
        raise RuntimeError(f"the CPU kernels are unavailable ({cpu_kernels.unavailable_reason()})")
    k, v = cache.k, cache.v
    kind = _KIND[k.dtype]
    if kind == 4:  # float8 bytes (the kernel decodes e4m3 itself)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    ks = cache.k_scale if cache.k_scale is not None else _EMPTY
    vs = cache.v_scale if cache.v_scale is not None else _EMPTY
    out = mod.decode_attention(qd if qd.dtype == torch.float32 else qd.float(), k, v, ks, vs,
                               meta.decode_block_tables, meta.decode_context_lens, scale, kind, SPLIT_BLOCKS)
    return out if qd.dtype == torch.float32 else out.to(qd.dtype)
