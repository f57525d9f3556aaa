"""Per-step attention inputs shared by every attention path (a leaf module: it imports no other model module).

The model runner builds one :class:`AttentionMetadata` per step and passes it explicitly to every layer;
:mod:`kvkeeper.attention.selector` reads ``backend`` to pick the path that computes the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    window / sliding: see :mod:`kvkeeper.models.gemma3` (a windowed step runs the C++ kernels' window on the
    ``cpu`` backend, the PyTorch reference otherwise).
    backend: "torch" (kvkeeper.attention.reference, the reference), "cpu" (the C++ decode kernel,
    kvkeeper.attention.cpu) or "triton" (kvkeeper.attention.triton_backend).
    """

    slot_mapping: torch.Tensor
    decode_indices: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # (B_d, 1, 1, L) bool, built lazily once per step
    prefills: list[PrefillSpan] = field(default_factory=list)
    backend: str = "torch"
    decode_max_len: int | None = None  # host-side max of decode_context_lens (picks the split-K factor)
    decode_num_splits: int | None = None  # fixed split-K factor (CUDA graphs); None: from decode_max_len
    window: int | None = None  # sliding-window layers: a query at KV index i sees keys (i - window, i] only
    sliding: "AttentionMetadata | None" = None  # the sliding layers' own tables (hybrid KV cache), else None

    @property
    def decode_only(self) -> bool:
        """True when every token of the step is a decode token (no prefill span)."""
        return not self.prefills and self.decode_indices is not None and self.decode_indices.numel() == \
            self.slot_mapping.numel()

    def get_decode_mask(self, block_size: int) -> torch.Tensor:
        if self.decode_mask is None:
            L = self.decode_block_tables.shape[1] * block_size
            ar = torch.arange(L, device=self.decode_context_lens.device)
            lens = self.decode_context_lens[:, None]
            mask = ar[None, :] < lens
            if self.window is not None:
                mask &= ar[None, :] >= lens - self.window
            self.decode_mask = mask[:, None, None, :]
        return self.decode_mask
