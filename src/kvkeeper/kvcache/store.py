"""The KV store: the one owner of the paged KV tensors of every layer.

:class:`PagedKV` is one layer's cache (K and V per block, plus scales when quantized; the base class and the
formats in :mod:`kvkeeper.kvcache.formats`); :class:`KVStore` holds one per layer and is the only way the rest of the
package reads or writes them: whole blocks (session offload, compaction), single tokens (KV compression,
dumps), a sequence's K/V (audits), sizes in bytes.  The model's forward pass gets the store itself
(``store[i]`` / iteration give each layer's :class:`PagedKV`, which the attention kernels read in place).

Block ids index every layer alike, except in a *hybrid* store (a sliding-window model's windowed layers
hold fewer, separately numbered window blocks; ``uniform`` False): block-level copies then raise ValueError.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .formats.base import KVFormat, PagedKV

__all__ = ["KVStore"]


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
