"""What every KV storage format shares: :class:`KVFormat` (the formats' names, dtypes and sizes), the layer base
:class:`PagedKV` (raw block and token access, sizes) and :func:`zeros` (the memory-mapped pools).

The formats, one module each: :mod:`.plain` (fp32 / bf16 / fp16), :mod:`.int8` (int8 / fp8 with a scale per
token and KV head), :mod:`.kivi` (KIVI int4 / int2: packed, asymmetric, with a 16-bit window of recent tokens).
:class:`kvkeeper.kvcache.store.KVStore` holds one :class:`PagedKV` per layer.

A Multi-head Latent Attention model (DeepSeek V2/V3) caches one *latent row* per token and layer instead of K
and V: ``PagedKV(..., num_kv_heads=1, head_dim=kv_lora_rank + qk_rope_head_dim, values=False)`` holds only
``k`` (the normalized latent followed by the rotated RoPE key) and, when quantized, one scale per token row,
shared by the row's key and value roles.  ``v`` and ``v_scale`` are None there.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16  # dtype of the quantized formats' scales
MIN_SCALE = 2.0 ** -14  # smallest normal float16: a scale never underflows to zero


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


def layout_of(fmt: KVFormat) -> str:
    """The layer layout that stores ``fmt``: ``kivi`` (int4 / int2), ``scaled`` (int8 / fp8) or ``plain``."""
    return "kivi" if fmt.kivi else "scaled" if fmt.quantized else "plain"


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor of ``shape`` and ``dtype``; on CPU over an anonymous memory map (page-aligned, zero by the
    kernel's guarantee and committed page by page as blocks are first written: ``torch.zeros`` writes every
    byte of a 1 GiB pool, 0.7 s at start, and makes it all resident at once).  ``$KVKEEPER_KV_PREFAULT=1`` commits
    every page at once instead (MAP_POPULATE: the soak test's memory baseline)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # private: copy-on-write at a fork
    if os.environ.get("KVKEEPER_KV_PREFAULT") == "1":  # commit every page now (a leak test's flat baseline)
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    pages = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # (the tensor keeps the map open)


class PagedKV:
    """One layer's paged K/V storage, what every format shares (shapes: the format modules of this package).

    ``k``, ``v``: (num_blocks, block_size, num_kv_heads, head_dim) in ``fmt.storage``; ``k_scale``, ``v_scale``:
    (num_blocks, block_size, num_kv_heads) float16 when quantized, else None.  Only the attention kernels and
    the model layers read these tensors; everything else goes through :class:`~kvkeeper.kvcache.store.KVStore`.

    values=False: K only (an MLA latent row per token; ``v`` and ``v_scale`` are None).
    ``PagedKV(..., fmt)`` makes the subclass of the format's layout (:func:`layout_of`): ``plain``
    (:class:`~kvkeeper.kvcache.formats.plain.PlainPagedKV`), ``scaled`` (int8 / fp8,
    :class:`~kvkeeper.kvcache.formats.int8.ScaledPagedKV`) or ``kivi`` (int4 / int2,
    :class:`~kvkeeper.kvcache.formats.kivi.KiviPagedKV`).
    """

    _LAYOUTS: dict[str, type] = {}  # layout name -> the subclass that stores it (filled by __init_subclass__)

    def __init_subclass__(cls, layout: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if layout is not None:
            PagedKV._LAYOUTS[layout] = cls

    def __new__(cls, num_blocks: int = 0, block_size: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
                fmt: KVFormat | None = None, *args, **kwargs):
        if cls is PagedKV and fmt is not None:
            return object.__new__(PagedKV._LAYOUTS[layout_of(fmt)])
        return object.__new__(cls)

    @property
    def head_dim(self) -> int:
        """Elements per head and token (an MLA cache: its latent row)."""
        return self.k.shape[3]

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 fmt: KVFormat, device: torch.device | str = "cpu", layer_idx: int = 0, values: bool = True):
        self.fmt = fmt
        self.layer_idx = layer_idx
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = zeros(shape, fmt.storage, device)
        self.v = zeros(shape, fmt.storage, device) if values else None
        self.k_scale = self.v_scale = None  # a scaled format's (formats/int8.py)

    @property
    def latent(self) -> bool:
        """True for an MLA latent cache (K rows only)."""
        return self.v is None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new keys/values k, v (T, KVH, D) into their slots (T,) int64 (each format's own)."""
        raise NotImplementedError

    def write_latent(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Store MLA latent rows (T, kv_lora_rank + qk_rope_head_dim) into their slots (T,) int64."""
        raise NotImplementedError

    def _decode(self, x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored values x (..., D) and their scales (...) -> (..., D) in ``dtype`` (a scaled format's)."""
        raise NotImplementedError

    def _gather_one(self, data, scales, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        kvh, d = data.shape[2], data.shape[3]
        x = data.index_select(0, block_table).reshape(-1, kvh, d)[:length]
        if scales is not None:
            x = self._decode(x, scales.index_select(0, block_table).reshape(-1, kvh)[:length], dtype)
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

    def _gather_padded_one(self, data, scales, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        B, nb = block_tables.shape
        flat = block_tables.reshape(-1)
        bs, kvh, d = data.shape[1], data.shape[2], data.shape[3]
        x = data.index_select(0, flat).view(B, nb * bs, kvh, d)
        if scales is not None:
            x = self._decode(x, scales.index_select(0, flat).view(B, nb * bs, kvh), dtype)
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

    def read_slots(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """K and V of single token slots (global slot ids ``block * block_size + offset``, (n,) int64) as CPU
        tensors (n, KVH, D): the storage dtype, bit for bit, or float32 (``q * scale``) when quantized.
        Returns ``{"k", "v"}`` (``{"k"}`` for an MLA latent cache)."""
        nb, bs, kvh, d = self.k.shape
        idx = slots.to(self.k.device)
        out = {}
        for name, data, scales in (("k", self.k, self.k_scale), ("v", self.v, self.v_scale)):
            if data is None:
                continue
            x = self._raw(data).view(nb * bs, kvh, d)[idx].view(data.dtype)
            if scales is not None:
                x = self._decode(x, scales.view(nb * bs, kvh)[idx], torch.float32)
            out[name] = x.contiguous().cpu()
        return out

    def nbytes(self) -> int:
        """Bytes this layer's tensors hold (values plus scales)."""
        return sum(t.nbytes for t in self._parts().values())

    def bytes_per_token(self) -> int:
        """Bytes one token slot takes in this layer (values plus scales)."""
        return self.nbytes() // (self.k.shape[0] * self.k.shape[1])

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
        self.check_blocks(len(block_ids), tensors)
        idx = torch.as_tensor(block_ids, dtype=torch.int64, device=self.k.device)
        for name, dst in self._parts().items():
            self._raw(dst).index_copy_(0, idx, self._raw(tensors[name].to(dst.device)))

    def check_blocks(self, n: int, tensors: dict[str, torch.Tensor], extra: frozenset[str] = frozenset()) -> None:
        """Raise ValueError unless ``tensors`` are ``n`` blocks of this cache's parts, dtypes and shapes (plus the
        names in ``extra``, which a subclass checks itself)."""
        parts = self._parts()
        if set(tensors) != set(parts) | extra:
            raise ValueError(f"layer {self.layer_idx}: KV parts {sorted(tensors)} do not match this cache's "
                             f"{sorted(set(parts) | extra)} (another KV dtype?)")
        for name, dst in parts.items():
            src = tensors[name]
            want = (n, *dst.shape[1:])
            if src.dtype != dst.dtype or tuple(src.shape) != want:
                raise ValueError(f"layer {self.layer_idx} {name}: got {src.dtype} {tuple(src.shape)}, this cache "
                                 f"needs {dst.dtype} {want}")
