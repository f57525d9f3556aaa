"""The KV store: the one owner of the paged KV tensors of every layer.

:class:`PagedKV` is one layer's cache (K and V per block, plus scales when quantized; formats in
:mod:`kvkeeper.kvcache.quant`); :class:`KVStore` holds one per layer and is the only way the rest of the
package reads or writes them: whole blocks (session offload, compaction), single tokens (KV compression,
dumps), a sequence's K/V (audits), sizes in bytes.  The model's forward pass gets the store itself
(``store[i]`` / iteration give each layer's :class:`PagedKV`, which the attention kernels read in place).

Block ids index every layer alike, except in a *hybrid* store (a sliding-window model's windowed layers
hold fewer, separately numbered window blocks; ``uniform`` False): block-level copies then raise ValueError.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Iterator

import torch

from .quant import (RESIDUAL_DTYPE, SCALE_DTYPE, KVFormat, dequantize, kivi_dequantize_keys, kivi_dequantize_values,
                    kivi_group_v, kivi_quantize_keys, kivi_quantize_values, quantize)

__all__ = ["KVStore", "PagedKV", "zeros"]


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
    """One layer's paged K/V storage (shapes and formats: :mod:`kvkeeper.kvcache.quant`).

    ``k``, ``v``: (num_blocks, block_size, num_kv_heads, head_dim) in ``fmt.storage``; ``k_scale``, ``v_scale``:
    (num_blocks, block_size, num_kv_heads) float16 when quantized, else None.  Only the attention kernels and
    the model layers read these tensors; everything else goes through :class:`KVStore`.

    values=False: K only (an MLA latent row per token; ``v`` and ``v_scale`` are None).
    A KIVI format (int4 / int2) makes a :class:`KiviPagedKV` instead (its layout: :mod:`kvkeeper.kvcache.quant`).
    """

    def __new__(cls, num_blocks: int = 0, block_size: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
                fmt: KVFormat | None = None, *args, **kwargs):
        if cls is PagedKV and fmt is not None and fmt.kivi:
            return object.__new__(KiviPagedKV)
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
        if fmt.quantized:
            self.k_scale = torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device) if values else None
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
                x = dequantize(x, scales.view(nb * bs, kvh)[idx], torch.float32)
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


class KVStore:
    """The paged KV tensors of all layers: one :class:`PagedKV` per layer, and the operations on them.

    layers: the per-layer caches, all of one format and block size.  windowed: per layer, whether it is a
    sliding layer of a hybrid cache (its block ids are window block ids; default: none is).
    Payloads (:meth:`read_blocks`, :meth:`write_blocks`) are dicts ``"<layer>.<part>"`` -> CPU tensor, part
    ``k`` / ``v`` of shape (n, block_size, num_kv_heads, head_dim) in the storage dtype and, when quantized,
    ``k_scale`` / ``v_scale`` (n, block_size, num_kv_heads) float16; an MLA latent cache has ``k`` (and
    ``k_scale``) only.
    """

    def __init__(self, layers: list[PagedKV], windowed: list[bool] | None = None):
        if not layers:
            raise ValueError("a KV store needs at least one layer")
        self._layers = list(layers)
        self._windowed = list(windowed) if windowed is not None else [False] * len(self._layers)
        self.format: KVFormat = self._layers[0].fmt
        self.block_size: int = self._layers[0].block_size

    @classmethod
    def allocate(cls, cfg, num_blocks: int, block_size: int, fmt: KVFormat, device: torch.device | str = "cpu",
                 window_blocks: int | None = None, num_layers: int | None = None) -> "KVStore":
        """Zeroed caches for a model: cfg a :class:`~kvkeeper.model_config.ModelConfig` (``num_layers``,
        ``kv_layout``: K and V heads, or one MLA latent row), ``num_blocks`` blocks of ``block_size`` tokens
        per layer; with ``window_blocks`` the sliding layers (``cfg.is_sliding_layer``) get that many window
        blocks instead.  ``num_layers``: only the model's first layers (a private cache for a forward that stops
        there; default all).  Raises ValueError for a non-positive block count or size, or a layer count outside
        1..cfg.num_layers."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV store needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        n = cfg.num_layers if num_layers is None else num_layers
        if not 1 <= n <= cfg.num_layers:
            raise ValueError(f"num_layers must be in 1..{cfg.num_layers}, got {num_layers}")
        parts, heads, dim = cfg.kv_layout
        windowed = [bool(window_blocks) and cfg.is_sliding_layer(i) for i in range(n)]
        layers = [PagedKV(window_blocks if w else num_blocks, block_size, heads, dim, fmt, device, layer_idx=i,
                          values=parts == 2) for i, w in enumerate(windowed)]
        return cls(layers, windowed)

    # ---- the model's view: one PagedKV per layer ---------------------------------------------
    def layer(self, i: int) -> PagedKV:
        """Layer ``i``'s cache (for the attention of that layer); raises IndexError outside 0..num_layers-1."""
        return self._layers[i]

    def __getitem__(self, i: int) -> PagedKV:
        return self._layers[i]

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterator[PagedKV]:
        return iter(self._layers)

    # ---- shapes and sizes --------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_blocks(self) -> int:
        """Blocks per full-attention layer (the block pool's size; 0 when every layer is windowed)."""
        return next((c.k.shape[0] for c, w in zip(self._layers, self._windowed) if not w), 0)

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer (1 for an MLA latent cache)."""
        return self._layers[0].k.shape[2]

    @property
    def head_dim(self) -> int:
        """Elements per head and token (an MLA cache: kv_lora_rank + qk_rope_head_dim)."""
        return self._layers[0].head_dim

    @property
    def latent(self) -> bool:
        """True for an MLA latent cache (K rows only)."""
        return self._layers[0].latent

    @property
    def device(self) -> torch.device:
        return self._layers[0].k.device

    @property
    def uniform(self) -> bool:
        """Whether one block id addresses the same tokens in every layer (False: a hybrid cache)."""
        return not any(self._windowed)

    @property
    def nbytes(self) -> int:
        """Bytes the KV tensors of all layers hold (values plus scales)."""
        return sum(c.nbytes() for c in self._layers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes across all layers (values plus scales; a hybrid cache: while inside the window)."""
        return sum(c.bytes_per_token() for c in self._layers)

    @property
    def bytes_per_token_full_layers(self) -> int:
        """Bytes one token takes in the full-attention layers (all layers in a uniform store)."""
        return sum(c.bytes_per_token() for c, w in zip(self._layers, self._windowed) if not w)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (``bytes_per_token * block_size``)."""
        return self.bytes_per_token * self.block_size

    # ---- whole blocks (offload, compaction) ----------------------------------------------------
    def _require_uniform(self, what: str) -> None:
        if not self.uniform:
            raise ValueError(f"{what} by block id is not possible in a hybrid KV cache (its sliding layers "
                             "number their window blocks apart)")

    def read_blocks(self, block_ids) -> dict[str, torch.Tensor]:
        """Raw copies of whole blocks of every layer (no dequantization: bit-exact), as a payload (see the class
        docstring).  block_ids: (n,) int64 tensor or list.  Raises ValueError in a hybrid store."""
        self._require_uniform("reading blocks")
        idx = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        return {f"{i}.{name}": t for i, c in enumerate(self._layers) for name, t in c.read_blocks(idx).items()}

    def write_blocks(self, block_ids, payload: dict[str, torch.Tensor]) -> None:
        """Write a payload read by :meth:`read_blocks` (any store of the same format and shapes) into
        ``block_ids``.  Every layer is checked before any is written: raises ValueError naming the layer and
        part when one is missing, extra, or of another dtype or shape (KV of another format or model)."""
        self._require_uniform("writing blocks")
        per_layer: list[dict[str, torch.Tensor]] = [{} for _ in self._layers]
        for key, t in payload.items():
            layer, _, part = key.partition(".")
            if not layer.isdigit() or int(layer) >= len(per_layer):
                raise ValueError(f"KV part {key!r} names no layer of this cache (0..{len(per_layer) - 1})")
            per_layer[int(layer)][part] = t
        for c, parts in zip(self._layers, per_layer):
            c.check_blocks(len(block_ids), parts)
        for c, parts in zip(self._layers, per_layer):
            c.write_blocks(block_ids, parts)

    def move_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i]`` to ``dst[i]`` in every layer (raw, with scales): src, dst (n,) int64 on
        the store's device.  All sources are read before any destination is written, so they may overlap (a
        permutation, as in compaction).  Raises ValueError in a hybrid store."""
        self._require_uniform("moving blocks")
        for c in self._layers:
            c.move_blocks(src, dst)

    # ---- tokens of one layer (compression, audits, dumps) ----------------------------------------
    def gather(self, layer: int, block_table: torch.Tensor, length: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``layer``'s K and V of one sequence: each (length, KVH, D) in ``dtype`` (dequantized), from its
        block table (nb,) int64; V None for an MLA latent cache."""
        return self._layers[layer].gather(block_table, length, dtype)

    def gather_keys(self, layer: int, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Layer ``layer``'s K only: (length, KVH, D) in ``dtype`` (what compression policies score)."""
        return self._layers[layer].gather_keys(block_table, length, dtype)

    def copy_tokens(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In layer ``layer``, per KV head ``h`` copy the token in slot ``src[h, j]`` to slot ``dst[j]``: src
        (KVH, n), dst (n,) int64 global slot ids (raw, no re-quantization).  Raises ValueError for an MLA cache."""
        self._layers[layer].copy_tokens(src, dst)

    def read_slots(self, layer: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s K and V at global slot ids (n,) int64: ``{"k", "v"}`` CPU tensors (n, KVH, D) in the
        storage dtype, or float32 when quantized (``{"k"}`` only for an MLA latent cache)."""
        return self._layers[layer].read_slots(slots)


class KiviPagedKV(PagedKV):
    """One layer's KV in a KIVI format (int4 / int2: Liu et al., 2024): packed closed blocks plus a 16-bit window
    of open blocks.  Tensors, shapes and the closing rule: :mod:`kvkeeper.kvcache.quant`.  Same methods as
    :class:`PagedKV`; block payloads (:meth:`read_blocks`) carry the packed bytes and scales as they are plus,
    for open blocks, their 16-bit tokens (``fill`` (n,) int16 tokens held, ``open`` (n,) bool, ``res_k`` /
    ``res_v`` (number open, block_size, KVH, D) bfloat16), so an offload round trip is bit-exact.

    residual_blocks: size of the 16-bit window's pool (default min(num_blocks, 128)).  Raises ValueError for an
    MLA latent cache (values=False) or a head_dim that is not a multiple of 8.

    The own-block rule: a query reads its own block (the block of its position) from the 16-bit window, every
    earlier block from its codes, in prefill and decode alike.  A block closed by a write therefore keeps its
    16-bit copy for the rest of that step (``kept``: ``res_of[block] = -2 - window index``; to everything but the
    attention it is a closed block) so that the step's queries in it read it as a decode token would; the copies
    are released by the next write (or move) of this layer, or first when the pool runs short.  When the pool has
    no free block for such a copy, the block's queries read its codes instead (deterministic, but not the rule).
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: KVFormat,
                 device: torch.device | str = "cpu", layer_idx: int = 0, values: bool = True,
                 residual_blocks: int | None = None):
        if not values:
            raise ValueError(f"KV dtype {fmt.name} (KIVI) needs K and V heads; an MLA latent cache takes bf16, "
                             "int8 or fp8")
        self.fmt = fmt
        self.layer_idx = layer_idx
        self.bits = fmt.bits
        self.group_v = kivi_group_v(fmt, head_dim)
        self._head_dim = head_dim
        nb, bs, kvh, d = num_blocks, block_size, num_kv_heads, head_dim
        pb = d * fmt.bits // 8
        self.k = zeros((nb, bs, kvh, pb), torch.uint8, device)
        self.v = zeros((nb, bs, kvh, pb), torch.uint8, device)
        self.k_scale = torch.ones((nb, kvh, d), dtype=SCALE_DTYPE, device=device)
        self.k_min = torch.zeros((nb, kvh, d), dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.ones((nb, bs, kvh, d // self.group_v), dtype=SCALE_DTYPE, device=device)
        self.v_min = torch.zeros((nb, bs, kvh, d // self.group_v), dtype=SCALE_DTYPE, device=device)
        r = min(nb, 128) if residual_blocks is None else residual_blocks
        if r < 1:
            raise ValueError(f"residual_blocks must be >= 1, got {r}")
        self.res_k = torch.zeros((r, bs, kvh, d), dtype=RESIDUAL_DTYPE, device=device)
        self.res_v = torch.zeros((r, bs, kvh, d), dtype=RESIDUAL_DTYPE, device=device)
        self.res_of = torch.full((nb,), -1, dtype=torch.int32)  # residual block of each open block, -1: closed
        self.fill = torch.zeros(nb, dtype=torch.int16)  # tokens written (an open block) or quantized (closed)
        self._owner = [-1] * r  # block of each residual block
        self._free = list(range(r - 1, -1, -1))
        self._tick = [0] * r  # last write, for closing the least recently written block when the pool is full
        self._clock = 0
        self.kept: set[int] = set()  # closed blocks whose 16-bit copy stays for this step (the own-block rule)

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def latent(self) -> bool:
        return False

    def write_latent(self, rows, slots):
        raise ValueError("an MLA latent cache cannot be stored in a KIVI format")

    # ---- the 16-bit window -------------------------------------------------------------------------------
    def _alloc(self, block: int, busy: set) -> int:
        if not self._free and self.kept:  # a kept copy goes first: its block's codes are already written
            self._release(self.kept.pop())
        if not self._free:
            cands = [(t, i) for i, t in enumerate(self._tick) if self._owner[i] not in busy]
            if not cands:
                raise RuntimeError(f"KIVI 16-bit window full: {len(self._tick)} residual blocks all written in one "
                                   "step; raise residual_blocks")
            _, i = min(cands)
            self._close(self._owner[i])
        i = self._free.pop()
        self._owner[i] = block
        self.res_of[block] = i
        return i

    def _drop_kept(self) -> None:
        """Release the 16-bit copies kept for the last step's own-block reads (their blocks are closed)."""
        while self.kept:
            self._release(self.kept.pop())

    def _end_kept(self, written: torch.Tensor) -> None:
        """Before a write: a kept block written again (e.g. after rejected draft tokens) reopens from its exact
        16-bit copy; the other kept copies are released.  written: the blocks (n,) the write touches."""
        if not self.kept:
            return
        for b in set(written.tolist()) & self.kept:
            self.kept.discard(b)
            self.res_of[b] = -2 - int(self.res_of[b])
        self._drop_kept()

    def _keep(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Attach a 16-bit copy k, v (block_size, KVH, D) to a block just closed, if the pool has a free block."""
        if not self._free:
            return
        i = self._free.pop()
        self._owner[i] = block
        self.res_of[block] = -2 - i  # kept: closed, its copy read by its own queries only
        self.res_k[i] = k.to(RESIDUAL_DTYPE)
        self.res_v[i] = v.to(RESIDUAL_DTYPE)
        self._tick[i] = self._clock
        self.kept.add(block)

    def _release(self, block: int) -> None:
        self.kept.discard(block)
        i = int(self.res_of[block])
        if i <= -2:
            i = -2 - i
        if i >= 0:
            self._owner[i] = -1
            self._free.append(i)
            self.res_of[block] = -1

    def _close(self, block: int, keep: bool = False) -> None:
        """Quantize an open block's tokens (its ``fill`` first ones) into its packed storage; free its window, or
        with ``keep`` leave it attached for this step (the own-block rule)."""
        i, n = int(self.res_of[block]), int(self.fill[block])
        if n > 0:
            self._store_closed(torch.tensor([block]), self.res_k[i: i + 1, :n], self.res_v[i: i + 1, :n])
        if keep:
            self.res_of[block] = -2 - i
            self.kept.add(block)
        else:
            self._release(block)

    def _store_closed(self, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize k, v (n, T, KVH, D) of ``blocks`` (n,) into their first T slots (keys per channel over T)."""
        T = k.shape[1]
        kp, ks, km = kivi_quantize_keys(k, self.fmt)
        vp, vs, vm = kivi_quantize_values(v, self.fmt)
        idx = blocks.to(self.k.device)
        if T == self.k.shape[1]:
            self.k.index_copy_(0, idx, kp)
            self.v.index_copy_(0, idx, vp)
            self.v_scale.index_copy_(0, idx, vs)
            self.v_min.index_copy_(0, idx, vm)
        else:
            for j, b in enumerate(blocks.tolist()):
                self.k[b, :T] = kp[j]
                self.v[b, :T] = vp[j]
                self.v_scale[b, :T] = vs[j]
                self.v_min[b, :T] = vm[j]
        self.k_scale.index_copy_(0, idx, ks)
        self.k_min.index_copy_(0, idx, km)
        self.fill[blocks] = T

    def _dequant_blocks(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks (n,) as held (packed dequantized, open blocks from the window): (n, bs, KVH, D)."""
        idx = blocks.to(self.k.device)
        k = kivi_dequantize_keys(self.k.index_select(0, idx), self.k_scale.index_select(0, idx),
                                 self.k_min.index_select(0, idx), self.bits, dtype)
        v = kivi_dequantize_values(self.v.index_select(0, idx), self.v_scale.index_select(0, idx),
                                   self.v_min.index_select(0, idx), self.bits, dtype)
        r = self.res_of[blocks.cpu()]
        open_ = (r >= 0).nonzero().flatten()
        if open_.numel():
            ri = r[open_].long().to(self.k.device)
            k[open_.to(k.device)] = self.res_k.index_select(0, ri).to(dtype)
            v[open_.to(v.device)] = self.res_v.index_select(0, ri).to(dtype)
        return k, v

    def close_all(self) -> None:
        """Close every open block (quantize the tokens it holds): e.g. before measuring closed-block bytes."""
        self._drop_kept()
        for b in [o for o in self._owner if o >= 0]:
            self._close(b)

    # ---- writes -----------------------------------------------------------------------------------------
    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new keys/values k, v (T, KVH, D) into their slots (T,) int64 (distinct): a block whose every slot
        is written here is quantized at once (keeping a 16-bit copy for this step); other tokens go to their block's
        window, a block whose last slot is written is closed.  A sequence appends in order: a block holds the tokens
        up to the last slot written (a rewrite truncates it there; one into a closed block reopens it, dequantized)."""
        bs, slots_c = self.k.shape[1], slots.cpu()
        self._end_kept(slots_c // bs)
        if slots.numel() == 0:
            return
        if slots.numel() <= 8 and self._append_decode(k, v, slots_c.tolist()):
            return
        order = torch.argsort(slots_c)
        ss = slots_c[order]
        blocks = ss // bs
        ub, counts = torch.unique_consecutive(blocks, return_counts=True)
        full = counts == bs
        per_tok_full = full.repeat_interleave(counts)
        if bool(full.any()):
            fb = ub[full]
            sel = order[per_tok_full].to(k.device)
            # rounded to the window's 16 bits first: a block's bytes do not depend on how its tokens were written
            kf = k.index_select(0, sel).to(RESIDUAL_DTYPE).float().view(len(fb), bs, *k.shape[1:])
            vf = v.index_select(0, sel).to(RESIDUAL_DTYPE).float().view(len(fb), bs, *v.shape[1:])
            for b in fb[self.res_of[fb] >= 0].tolist():
                self._release(b)
            self._store_closed(fb, kf, vf)
            for j, b in enumerate(fb.tolist()):  # this step's queries in these blocks read them in 16 bits
                self._keep(b, kf[j], vf[j])
        if bool(full.all()):
            return
        busy = set(ub[~full].tolist())
        self._clock += 1
        pos = 0
        for b, n, f in zip(ub.tolist(), counts.tolist(), full.tolist()):
            if f:
                pos += n
                continue
            toks = order[pos: pos + n]
            offs = (ss[pos: pos + n] - b * bs)
            pos += n
            r = int(self.res_of[b])
            fresh = int(offs[0]) == 0
            if r < 0:
                held = None
                if not fresh and int(self.fill[b]):  # a write into a closed block: reopen it (tokens dequantized)
                    held = self._dequant_blocks(torch.tensor([b]), RESIDUAL_DTYPE)
                r = self._alloc(b, busy)
                if held is not None:
                    self.res_k[r], self.res_v[r] = held[0][0], held[1][0]
            elif fresh:
                self.fill[b] = 0
            t = toks.to(k.device)
            o = offs.to(self.res_k.device)
            self.res_k[r].index_copy_(0, o, k.index_select(0, t).to(RESIDUAL_DTYPE))
            self.res_v[r].index_copy_(0, o, v.index_select(0, t).to(RESIDUAL_DTYPE))
            self.fill[b] = int(offs[-1]) + 1  # a sequence appends in order: a write at o ends its block at o
            self._tick[r] = self._clock
            if int(self.fill[b]) == bs:
                self._close(b, keep=True)

    def _append_decode(self, k: torch.Tensor, v: torch.Tensor, slots: list[int]) -> bool:
        """The decode case of :meth:`write` without tensor bookkeeping: each token appended to its own open block
        (distinct blocks, each slot the block's next one).  Returns False, writing nothing, for anything else."""
        bs = self.k.shape[1]
        at = [divmod(x, bs) for x in slots]
        if len({b for b, _ in at}) != len(at):
            return False
        rows = []
        for b, o in at:
            r = int(self.res_of[b])
            if r < 0 or o == 0 or o != int(self.fill[b]):
                return False
            rows.append(r)
        self._clock += 1
        for j, ((b, o), r) in enumerate(zip(at, rows)):
            self.res_k[r, o] = k[j]
            self.res_v[r, o] = v[j]
            self.fill[b] = o + 1
            self._tick[r] = self._clock
            if o + 1 == bs:
                self._close(b, keep=True)
        return True

    # ---- reads ------------------------------------------------------------------------------------------
    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        k, v = self._dequant_blocks(block_table, dtype)
        kvh, d = k.shape[2], k.shape[3]
        return k.reshape(-1, kvh, d)[:length], v.reshape(-1, kvh, d)[:length]

    def gather_keys(self, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        return self.gather(block_table, length, dtype)[0]

    def gather_for_reference(self, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        """What the reference attention needs for the own-block rule: (k, v) (length, KVH, D) as held (codes; an
        open block from its window), (kw, vw) (length, KVH, D) from the 16-bit window of an open or kept block
        (zeros where a block has none) and ``has`` (length,) bool: the key's block has such a copy."""
        blocks = block_table.cpu()
        k, v = self._dequant_blocks(blocks, dtype)  # as held: codes, an open block from its window
        r = self.res_of[blocks]
        has = r != -1
        kw, vw = torch.zeros_like(k), torch.zeros_like(v)
        if bool(has.any()):
            ri = torch.where(r >= 0, r, -2 - r)[has].long().to(self.k.device)
            kw[has.to(k.device)] = self.res_k.index_select(0, ri).to(dtype)
            vw[has.to(k.device)] = self.res_v.index_select(0, ri).to(dtype)
        bs, kvh, d = k.shape[1], k.shape[2], k.shape[3]
        flat = lambda x: x.reshape(-1, kvh, d)[:length]  # noqa: E731
        return flat(k), flat(v), flat(kw), flat(vw), has.repeat_interleave(bs)[:length]

    def gather_padded(self, block_tables: torch.Tensor, dtype: torch.dtype):
        B, nb = block_tables.shape
        k, v = self._dequant_blocks(block_tables.reshape(-1), dtype)
        bs, kvh, d = k.shape[1], k.shape[2], k.shape[3]
        return (k.view(B, nb * bs, kvh, d).transpose(1, 2), v.view(B, nb * bs, kvh, d).transpose(1, 2))

    def gather_keys_padded(self, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.gather_padded(block_tables, dtype)[0]

    def read_slots(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """K and V at global slot ids (n,) int64 as float32 CPU tensors (n, KVH, D), as held (dequantized)."""
        bs = self.k.shape[1]
        s = slots.cpu()
        ub, inv = torch.unique(s // bs, return_inverse=True)
        k, v = self._dequant_blocks(ub, torch.float32)
        off = (s % bs).to(k.device)
        return {"k": k[inv.to(k.device), off].cpu(), "v": v[inv.to(k.device), off].cpu()}

    def copy_tokens(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per KV head, copy the token in slot ``src[h, j]`` to slot ``dst[j]``: src (KVH, n), dst (n,) int64.
        A KIVI block's keys share per-channel scales, so the tokens are dequantized and written again (the
        destination blocks re-quantized: lossy, unlike the other formats' raw copies)."""
        kvh = self.k.shape[2]
        heads = torch.arange(kvh)
        rows = self.read_slots(src.reshape(-1))
        n = src.shape[1]
        k = rows["k"].view(kvh, n, kvh, -1)[heads, :, heads].transpose(0, 1)  # (n, KVH, D)
        v = rows["v"].view(kvh, n, kvh, -1)[heads, :, heads].transpose(0, 1)
        self.write(k, v, dst)

    # ---- whole blocks --------------------------------------------------------------------------------------
    def _parts(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "k_scale": self.k_scale, "k_min": self.k_min, "v_scale": self.v_scale,
                "v_min": self.v_min}

    def nbytes(self) -> int:
        """Bytes this layer's tensors hold: packed blocks, scales and mins, and the 16-bit window's pool."""
        return sum(t.nbytes for t in self._parts().values()) + self.res_k.nbytes + self.res_v.nbytes

    def bytes_per_token(self) -> int:
        """Bytes one token slot of a closed block takes in this layer (the window's pool not counted)."""
        return round(sum(t.nbytes for t in self._parts().values()) / (self.k.shape[0] * self.k.shape[1]))

    def move_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i]`` to ``dst[i]`` (packed bytes, scales, and an open block's 16-bit tokens, raw);
        all sources are read before any destination is written."""
        self._drop_kept()
        src_c, dst_c = src.cpu(), dst.cpu()
        for t in self._parts().values():
            t[dst] = t[src]
        r = self.res_of[src_c]
        fill = self.fill[src_c].clone()
        open_ = (r >= 0).nonzero().flatten()
        rk = self.res_k[r[open_].long()].clone()
        rv = self.res_v[r[open_].long()].clone()
        for b in dst_c.tolist():
            self._release(b)
        self.fill[dst_c] = fill
        busy = set(dst_c.tolist())
        for j, i in enumerate(open_.tolist()):
            b = int(dst_c[i])
            ri = self._alloc(b, busy)
            self.res_k[ri], self.res_v[ri] = rk[j], rv[j]
            self._tick[ri] = self._clock

    def read_blocks(self, block_ids) -> dict[str, torch.Tensor]:
        """Raw copies of whole blocks: the parts of :meth:`_parts` ((n, ...) as stored) plus ``fill`` (n,) int16,
        ``open`` (n,) bool and the open blocks' 16-bit tokens ``res_k`` / ``res_v`` (m, block_size, KVH, D)."""
        idx = torch.as_tensor(block_ids, dtype=torch.int64)
        out = {name: t.index_select(0, idx.to(t.device)).cpu() for name, t in self._parts().items()}
        r = self.res_of[idx]
        open_ = r >= 0
        out["fill"] = self.fill[idx].clone()
        out["open"] = open_.clone()
        ri = r[open_].long().to(self.res_k.device)
        out["res_k"] = self.res_k.index_select(0, ri).cpu()
        out["res_v"] = self.res_v.index_select(0, ri).cpu()
        for j, f in enumerate(out["fill"][open_].tolist()):  # rows past the tokens held: zeros, not stale bytes
            out["res_k"][j, f:] = 0
            out["res_v"][j, f:] = 0
        return out

    def write_blocks(self, block_ids, tensors: dict[str, torch.Tensor]) -> None:
        """Write blocks read by :meth:`read_blocks` into ``block_ids`` (bit-exact; open blocks get a window)."""
        self.check_blocks(len(block_ids), tensors)
        self._drop_kept()
        idx = torch.as_tensor(block_ids, dtype=torch.int64)
        for name, dst in self._parts().items():
            dst.index_copy_(0, idx.to(dst.device), tensors[name].to(dst.device))
        for b in idx.tolist():
            self._release(b)
        self.fill[idx] = tensors["fill"]
        busy = set(idx.tolist())
        for j, i in enumerate(tensors["open"].nonzero().flatten().tolist()):
            ri = self._alloc(int(idx[i]), busy)
            self.res_k[ri] = tensors["res_k"][j].to(self.res_k.device)
            self.res_v[ri] = tensors["res_v"][j].to(self.res_v.device)

    def check_blocks(self, n: int, tensors: dict[str, torch.Tensor], extra: frozenset[str] = frozenset()) -> None:
        super().check_blocks(n, tensors, extra | {"fill", "open", "res_k", "res_v"})
        op, fill = tensors["open"], tensors["fill"]
        if op.dtype != torch.bool or tuple(op.shape) != (n,) or fill.dtype != torch.int16 or tuple(fill.shape) != (n,):
            raise ValueError(f"layer {self.layer_idx}: fill/open must be ({n},) int16 / bool")
        m = int(op.sum())
        for name in ("res_k", "res_v"):
            src, want = tensors[name], (m, *self.res_k.shape[1:])
            if src.dtype != RESIDUAL_DTYPE or tuple(src.shape) != want:
                raise ValueError(f"layer {self.layer_idx} {name}: got {src.dtype} {tuple(src.shape)}, this cache "
                                 f"needs {RESIDUAL_DTYPE} {want}")
