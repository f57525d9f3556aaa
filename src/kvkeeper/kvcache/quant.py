"""Storage formats of the paged KV cache: plain fp32 / bf16 / fp16, quantized int8 / fp8 with scales, or KIVI
int4 / int2 (packed, asymmetric, with a 16-bit window of recent tokens).

One layer's cache (a :class:`kvkeeper.kvcache.store.PagedKV`, all layers' a
:class:`~kvkeeper.kvcache.store.KVStore`) holds K and V tensors of shape
``(num_blocks, block_size, num_kv_heads, head_dim)`` in the storage dtype and, for
the quantized formats, one scale per token per KV head for K and for V, shape
``(num_blocks, block_size, num_kv_heads)``, stored as float16.

Quantization is symmetric, per token and per KV head (as in KIVI's per-token
keys/values and vLLM's per-token-head int8 KV): ``scale = max|x| / qmax`` over the
head dimension, ``q = x / scale`` rounded to int8 in [-127, 127] (``qmax`` 127) or
cast to ``torch.float8_e4m3fn`` (``qmax`` 448, its largest finite value).  Tokens
are quantized when written and dequantized (``q * scale``) when attention reads
them, in the compute dtype.  RoPE is applied before the cache, so keys are stored
rotated.

Bytes per token for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), K plus V:
fp32 46,080; bf16/fp16 23,040; int8 and fp8 11,880 (11,520 of values plus 360 of
fp16 scales: 25.8% of fp32).

**int4 / int2 (KIVI).**  Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"
(ICML 2024): keys quantized *per channel* over a group of tokens, values *per token* in groups of channels,
asymmetric (``x ~ q * scale + min``, q in 0..2^bits-1, round to nearest), the most recent tokens kept in
16 bits until their group fills.  The layout in the paged cache (one :class:`~kvkeeper.kvcache.store.PagedKV`):

* key group = one block of tokens.  A block is *closed* when its last slot is written: its keys are quantized
  per (KV head, channel) over the block's tokens, its values per (token, KV head, group of ``group_v``
  channels).  Closing depends on the block's own tokens only, so a full block's bytes are a function of its
  tokens (what the prefix cache and sessions share) whatever the order of the writes.
* ``k``, ``v``: (num_blocks, block_size, num_kv_heads, head_dim * bits / 8) uint8, packed little end first
  (int4: channel 2j in the low nibble of byte j, 2j+1 in the high one; int2: channel 4j + i in bits 2i..2i+1);
  ``k_scale``, ``k_min``: (num_blocks, num_kv_heads, head_dim) float16 (per block and channel);
  ``v_scale``, ``v_min``: (num_blocks, block_size, num_kv_heads, head_dim / group_v) float16.
* the 16-bit window: a block not yet full is *open*; its tokens live in a bounded side pool of 16-bit
  blocks, ``res_k``, ``res_v``: (residual_blocks, block_size, num_kv_heads, head_dim) bfloat16, and
  ``res_of`` (num_blocks,) int32 names each block's residual block (-1: closed).  The own-block rule: a query
  reads the block of its own position in 16 bits, earlier blocks from their codes, in prefill as in decode; a
  block closed by a write keeps its 16-bit copy for the rest of that step (``res_of = -2 - residual block``, a
  *kept* block: closed to every reader but the attention of its own queries), released at the layer's next
  write.  Measured on SmolLM2-135M at 4,096 tokens (transformers simulation of the rule,
  2026-12-06): int4 perplexity +0.83% over bf16 with the rule, +2.03% without it.  Normally a sequence's last,
  partial block is its open one; the readers (reference and kernels) accept open blocks anywhere in a block
  table, so a window of several blocks straddling a block boundary (a block reopened by a rewrite, e.g. a
  rejected draft token, next to the new tail) reads correctly.  Rewriting a slot of a closed block reopens it
  (its tokens dequantized into the window: lossy, as any re-quantization).  When every residual block is
  taken, the least recently written open block is closed early (quantized over the tokens it holds).
* ``group_v``: 64 for int4 (a 64-dim head: one group per token and head), 32 for int2 (KIVI's group).

Bytes per token for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), K plus V, closed blocks, block_size 16:
int4 7,560 (32 + 32 packed, 16 of key scale/min per channel amortised over 16 tokens, 4 of value scale/min:
0.328x bf16); int2 5,040 (0.219x); at block_size 32 int4 takes 6,840 (0.297x), int2 4,320 (0.188x).  The
16-bit window adds ``residual_blocks`` (default min(num_blocks, 128)) blocks of 16-bit K and V per layer.

A Multi-head Latent Attention model (DeepSeek V2/V3) caches one *latent row* per token and layer instead of K
and V: ``store.PagedKV(..., num_kv_heads=1, head_dim=kv_lora_rank + qk_rope_head_dim, values=False)`` holds only
``k`` (the normalized latent followed by the rotated RoPE key) and, when quantized, one scale per token row,
shared by the row's key and value roles.  ``v`` and ``v_scale`` are None there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16  # dtype of the quantized formats' scales
_MIN_SCALE = 2.0 ** -14  # smallest normal float16: a scale never underflows to zero


@dataclass(frozen=True)
class KVFormat:
    """A KV storage format.  name: canonical name; storage: element dtype; qmax: 0 when not quantized."""

    name: str
    storage: torch.dtype
    qmax: float = 0.0
    bits: int = 0  # KIVI formats: 4 or 2 (0: not a KIVI format)
    group_v: int = 0  # KIVI formats: channels per value group

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    @property
    def kivi(self) -> bool:
        """True for the packed, asymmetric int4 / int2 formats (KIVI; see the module docstring)."""
        return self.bits > 0

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, parts: int = 2,
                        block_size: int = 16) -> int:
        """Bytes of K plus V (values plus scales) for one token across all layers (``parts`` 1: an MLA latent
        row, see :meth:`kvkeeper.model_config.ModelConfig.kv_layout`).  KIVI formats: closed blocks of
        ``block_size`` tokens (the key scale and min per channel amortised over the block; the 16-bit window's
        fixed pool not counted)."""
        if self.kivi:
            return round(parts * num_layers * num_kv_heads * kivi_bytes_per_head_token(self, head_dim, block_size))
        elem = torch.empty(0, dtype=self.storage).element_size()
        per_head = head_dim * elem + (torch.empty(0, dtype=SCALE_DTYPE).element_size() if self.quantized else 0)
        return parts * num_layers * num_kv_heads * per_head


FORMATS = {
    "float32": KVFormat("float32", torch.float32),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "float16": KVFormat("float16", torch.float16),
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "int4": KVFormat("int4", torch.uint8, 15.0, bits=4, group_v=64),
    "int2": KVFormat("int2", torch.uint8, 3.0, bits=2, group_v=32),
}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3",
            "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3"}
KV_DTYPE_CHOICES = ("fp32", "bf16", "fp16", "int8", "fp8", "int4", "int2")
RESIDUAL_DTYPE = torch.bfloat16  # the KIVI formats' 16-bit window


def parse_kv_format(name: str | torch.dtype | KVFormat) -> KVFormat:
    """The KV format for a name (fp32, bf16, fp16, int8, fp8, int4, int2 and long forms) or a plain torch dtype.

    Raises ValueError naming the choices for anything else.
    """
    if isinstance(name, KVFormat):
        return name
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    key = _ALIASES.get(name.lower(), name.lower())
    try:
        return FORMATS[key]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(KV_DTYPE_CHOICES)}") from None


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> (values (..., D) in fmt.storage, scales (...) float16)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / fmt.qmax).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    y = xf / scale.float().unsqueeze(-1)
    if fmt.storage == torch.int8:
        q = y.round_().clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        q = y.clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., D) and scales (...) -> (..., D) in ``dtype``."""
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


# ---- KIVI int4 / int2 (see the module docstring) ------------------------------------------------------------
def kivi_group_v(fmt: KVFormat, head_dim: int) -> int:
    """Channels per value group for a head of ``head_dim``: fmt.group_v, or the whole head when smaller or when
    it does not divide head_dim.  Raises ValueError when head_dim is not a multiple of 8 (packing)."""
    if head_dim % 8:
        raise ValueError(f"KV dtype {fmt.name} packs 8 channels at a time; head_dim {head_dim} is not a multiple of 8")
    g = fmt.group_v
    return g if g < head_dim and head_dim % g == 0 else head_dim


def kivi_bytes_per_head_token(fmt: KVFormat, head_dim: int, block_size: int) -> float:
    """Bytes of K (packed + per-channel scale and min over a block) and V (packed + per-group scale and min) for
    one token and KV head of a closed block, divided by 2 (the per-part average: callers multiply by parts)."""
    s = SCALE_DTYPE.itemsize
    packed = head_dim * fmt.bits // 8
    k = packed + 2 * s * head_dim / block_size
    v = packed + 2 * s * (head_dim // kivi_group_v(fmt, head_dim))
    return (k + v) / 2


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., D) integers in 0..2^bits-1 -> (..., D * bits / 8) uint8 (channel order: low bits first)."""
    per = 8 // bits
    q = q.to(torch.uint8).view(*q.shape[:-1], q.shape[-1] // per, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., B) uint8 -> codes (..., B * 8 / bits) uint8 (the inverse of :func:`pack`)."""
    per, mask = 8 // bits, (1 << bits) - 1
    return torch.stack([(p >> (bits * i)) & mask for i in range(per)], dim=-1).flatten(-2)


def quantize_asym(x: torch.Tensor, dim: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization over ``dim``: x float -> (codes uint8 like x, scale, min) with scale and min float16
    of x's shape without ``dim`` (``x ~ codes * scale + min``; round to nearest, codes clamped to 0..qmax)."""
    xf = x.float()
    mn = xf.amin(dim=dim).to(SCALE_DTYPE)
    mx = xf.amax(dim=dim)
    scale = ((mx - mn.float()) / qmax).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    q = ((xf - mn.float().unsqueeze(dim)) / scale.float().unsqueeze(dim)).round_().clamp_(0, qmax).to(torch.uint8)
    return q, scale, mn


def kivi_quantize_keys(k: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of whole blocks (n, T, KVH, D) float, T <= block_size tokens -> (packed (n, T, KVH, D*bits/8) uint8,
    scale (n, KVH, D), min (n, KVH, D) float16): per channel over the block's T tokens (KIVI's key grouping)."""
    q, s, m = quantize_asym(k, 1, fmt.qmax)
    return pack(q, fmt.bits), s, m


def kivi_quantize_values(v: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values (..., KVH, D) float -> (packed (..., KVH, D*bits/8) uint8, scale, min (..., KVH, D/group) float16):
    per token in groups of channels (KIVI's value grouping)."""
    d = v.shape[-1]
    g = kivi_group_v(fmt, d)
    q, s, m = quantize_asym(v.reshape(*v.shape[:-1], d // g, g), -1, fmt.qmax)
    return pack(q.flatten(-2), fmt.bits), s, m


def kivi_dequantize_keys(p: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed (n, T, KVH, B), scale and min (n, KVH, D) -> keys (n, T, KVH, D) in ``dtype`` (``q * scale + min``
    in float32)."""
    q = unpack(p, bits).float()
    return (q * scale.float().unsqueeze(1) + mn.float().unsqueeze(1)).to(dtype)


def kivi_dequantize_values(p: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed (..., KVH, B), scale and min (..., KVH, D/g) -> values (..., KVH, D) in ``dtype``."""
    q = unpack(p, bits).float()
    ng = scale.shape[-1]
    q = q.view(*q.shape[:-1], ng, q.shape[-1] // ng)
    return (q * scale.float().unsqueeze(-1) + mn.float().unsqueeze(-1)).flatten(-2).to(dtype)
