"""Storage formats of the paged KV cache: plain fp32 / bf16 / fp16, or quantized int8 / fp8 with scales.

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

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, parts: int = 2) -> int:
        """Bytes of K plus V (values plus scales) for one token across all layers (``parts`` 1: an MLA latent
        row, see :meth:`kvkeeper.model_config.ModelConfig.kv_layout`)."""
        elem = torch.empty(0, dtype=self.storage).element_size()
        per_head = head_dim * elem + (torch.empty(0, dtype=SCALE_DTYPE).element_size() if self.quantized else 0)
        return parts * num_layers * num_kv_heads * per_head


FORMATS = {
    "float32": KVFormat("float32", torch.float32),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "float16": KVFormat("float16", torch.float16),
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3",
            "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3"}
KV_DTYPE_CHOICES = ("fp32", "bf16", "fp16", "int8", "fp8")


def parse_kv_format(name: str | torch.dtype | KVFormat) -> KVFormat:
    """The KV format for a name (fp32, bf16, fp16, int8, fp8 and long forms) or a plain torch dtype.

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
