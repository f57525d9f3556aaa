"""Storage formats of the paged KV cache: plain fp32 / bf16 / fp16, or quantized int8 / fp8 with scales.

One layer's cache is a :class:`PagedKV`: K and V tensors of shape
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
and V: ``PagedKV(..., num_kv_heads=1, head_dim=kv_lora_rank + qk_rope_head_dim, values=False)`` holds only
``k`` (the normalized latent followed by the rotated RoPE key) and, when quantized, one scale per token row,
shared by the row's key and value roles.  ``v`` and ``v_scale`` are None there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SCALE_DTYPE = torch.float16
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
        per_head = head_dim * elem + (torch.empty(0, dtype=_SCALE_DTYPE).element_size() if self.quantized else 0)
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
    scale = (xf.abs().amax(dim=-1) / fmt.qmax).clamp_min(_MIN_SCALE).to(_SCALE_DTYPE)
    y = xf / scale.float().unsqueeze(-1)
    if fmt.storage == torch.int8:
        q = y.round_().clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        q = y.clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., D) and scales (...) -> (..., D) in ``dtype``."""
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


class PagedKV:
    """One layer's paged K/V storage (see the module docstring for shapes and formats).

    values=False: K only (an MLA latent row per token; ``v`` and ``v_scale`` are None).
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 fmt: KVFormat, device: torch.device | str = "cpu", layer_idx: int = 0, values: bool = True):
        self.fmt = fmt
        self.layer_idx = layer_idx
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=fmt.storage, device=device)
        self.v = torch.zeros(shape, dtype=fmt.storage, device=device) if values else None
        if fmt.quantized:
            self.k_scale = torch.ones(shape[:3], dtype=_SCALE_DTYPE, device=device)
            self.v_scale = torch.ones(shape[:3], dtype=_SCALE_DTYPE, device=device) if values else None
        else:
            self.k_scale = self.v_scale = None

    @property
    def latent(self) -> bool:
        """True for an MLA latent cache (K rows only)."""
        return self.v is None

    def write_latent(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Store MLA latent rows (T, kv_lora_rank + qk_rope_head_dim) into their slots (T,) int64 (one scale
        per row when quantized)."""
        nb, bs, _, d = self.k.shape
        if not self.fmt.quantized:
            self.k.view(nb * bs, d).index_copy_(0, slots, rows.to(self.k.dtype))
            return
        q, s = quantize(rows, self.fmt)
        data = self.k.view(torch.uint8) if q.dtype.itemsize == 1 and q.dtype != torch.int8 else self.k
        data.view(nb * bs, d).index_copy_(0, slots, q.view(data.dtype))
        self.k_scale.view(nb * bs).index_copy_(0, slots, s)

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new keys/values k, v (T, KVH, D) into their slots (T,) int64."""
        nb, bs, kvh, d = self.k.shape
        if not self.fmt.quantized:
            self.k.view(nb * bs, kvh, d).index_copy_(0, slots, k.to(self.k.dtype))
            self.v.view(nb * bs, kvh, d).index_copy_(0, slots, v.to(self.v.dtype))
            return
        for data, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize(x, self.fmt)
            if q.dtype.itemsize == 1 and q.dtype != torch.int8:  # float8: copy the bytes (no float8 index_copy on CPU)
                data, q = data.view(torch.uint8), q.view(torch.uint8)
            data.view(nb * bs, kvh, d).index_copy_(0, slots, q)
            scales.view(nb * bs, kvh).index_copy_(0, slots, s)

    @staticmethod
    def _gather_one(data, scales, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        kvh, d = data.shape[2], data.shape[3]
        x = data.index_select(0, block_table).reshape(-1, kvh, d)[:length]
        if scales is not None:
            x = dequantize(x, scales.index_select(0, block_table).reshape(-1, kvh)[:length], dtype)
        return x.to(dtype)

    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence: each (length, KVH, D) in ``dtype``, from its blocks (nb,) int64 (V None for
        an MLA latent cache)."""
        k = self._gather_one(self.k, self.k_scale, block_table, length, dtype)
        return k, (None if self.v is None else self._gather_one(self.v, self.v_scale, block_table, length, dtype))

    def gather_keys(self, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """K only: (length, KVH, D) in ``dtype`` (what compression policies score)."""
        return self._gather_one(self.k, self.k_scale, block_table, length, dtype)

    def gather_padded(self, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a batch: block_tables (B, nb) int64 -> each (B, KVH, nb * block_size, D) in ``dtype``."""
        return (self._gather_padded_one(self.k, self.k_scale, block_tables, dtype),
                self._gather_padded_one(self.v, self.v_scale, block_tables, dtype))

    def gather_keys_padded(self, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K only (an MLA cache's latent rows) of a batch: block_tables (B, nb) -> (B, KVH, nb * block_size, D)."""
        return self._gather_padded_one(self.k, self.k_scale, block_tables, dtype)

    @staticmethod
    def _gather_padded_one(data, scales, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        B, nb = block_tables.shape
        flat = block_tables.reshape(-1)
        bs, kvh, d = data.shape[1], data.shape[2], data.shape[3]
        x = data.index_select(0, flat).view(B, nb * bs, kvh, d)
        if scales is not None:
            x = dequantize(x, scales.index_select(0, flat).view(B, nb * bs, kvh), dtype)
        return x.transpose(1, 2).to(dtype)

    def copy_tokens(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per KV head, copy the token in slot ``src[h, j]`` to slot ``dst[j]``: src (KVH, n), dst (n,) int64.

        Raw values and scales are copied (no re-quantization).  Used by KV compression,
        where each head keeps its own tokens.
        """
        if self.latent:
            raise ValueError("per-head token copies need K and V heads; an MLA latent cache has one row per token")
        nb, bs, kvh, d = self.k.shape
        heads = torch.arange(kvh)
        for data, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            raw = data.view(torch.uint8) if data.dtype.itemsize == 1 and data.dtype != torch.int8 else data
            flat = raw.view(nb * bs, kvh, d)
            flat[dst] = flat[src.t(), heads]  # (n, KVH, D)
            if scales is not None:
                fs = scales.view(nb * bs, kvh)
                fs[dst] = fs[src.t(), heads]

    def move_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i]`` to ``dst[i]`` (values and scales, raw): src, dst (n,) int64.

        The sources are read before any destination is written, so ``src`` and ``dst``
        may overlap (a permutation, as in pool defragmentation).
        """
        for data, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            if data is None:  # an MLA latent cache has no V
                continue
            raw = data.view(torch.uint8) if data.dtype.itemsize == 1 and data.dtype != torch.int8 else data
            raw[dst] = raw[src]
            if scales is not None:
                scales[dst] = scales[src]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._parts().values())

    # ---- whole-block raw access (session offload) ------------------------------------------
    def _parts(self) -> dict[str, torch.Tensor]:
        parts = {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale}
        return {name: t for name, t in parts.items() if t is not None}

    @staticmethod
    def _raw(t: torch.Tensor) -> torch.Tensor:
        # float8 has no index_select / index_copy on CPU: move its bytes as uint8 instead
        return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype != torch.int8 else t

    def read_blocks(self, block_ids) -> dict[str, torch.Tensor]:
        """Raw storage of whole blocks, copied to CPU tensors (no dequantization: a bit-exact copy).

        block_ids: (n,) int64 tensor or list of block ids.  Returns ``{"k", "v"}`` of shape
        ``(n, block_size, num_kv_heads, head_dim)`` in the storage dtype and, when quantized,
        ``{"k_scale", "v_scale"}`` of shape ``(n, block_size, num_kv_heads)`` float16.
        """
        idx = torch.as_tensor(block_ids, dtype=torch.int64, device=self.k.device)
        return {name: self._raw(t).index_select(0, idx).view(t.dtype).cpu()  # index_select copies
                for name, t in self._parts().items()}

    def write_blocks(self, block_ids, tensors: dict[str, torch.Tensor]) -> None:
        """Write blocks read by :meth:`read_blocks` (any cache of the same format and shape) into ``block_ids``.

        Raises ValueError when a part is missing or its dtype or shape differs from this cache's
        (e.g. KV saved in another format or for another model), so foreign KV is never written.
        """
        idx = torch.as_tensor(block_ids, dtype=torch.int64, device=self.k.device)
        parts = self._parts()
        if set(tensors) != set(parts):
            raise ValueError(f"layer {self.layer_idx}: KV parts {sorted(tensors)} do not match this cache's "
                             f"{sorted(parts)} (another KV dtype?)")
        for name, dst in parts.items():
            src = tensors[name]
            want = (len(idx), *dst.shape[1:])
            if src.dtype != dst.dtype or tuple(src.shape) != want:
                raise ValueError(f"layer {self.layer_idx} {name}: got {src.dtype} {tuple(src.shape)}, this cache "
                                 f"needs {dst.dtype} {want}")
        for name, dst in parts.items():
            self._raw(dst).index_copy_(0, idx, self._raw(tensors[name].to(dst.device)))
