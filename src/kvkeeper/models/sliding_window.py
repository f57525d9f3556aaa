"""Sliding-window attention on every layer (Mistral, Phi-3): the windowed variant of a Llama-family class.

A configuration whose ``layer_types`` are all "sliding_attention" (Mistral or Phi-3 with a ``sliding_window``
below its context, :func:`kvkeeper.model_config.every_layer_slides`) runs its family's windowed class
(:class:`EveryLayerSlides` before the family class; ``for_config`` picks it): every layer attends to keys at positions ``(p - window, p]`` (Beltagy et al., "Longformer", 2020; Jiang et al.,
"Mistral 7B", 2023), as transformers' ``create_sliding_window_causal_mask`` masks them.  Its layers read
``meta.sliding`` (window blocks of the hybrid KV cache, :mod:`kvkeeper.kvcache.block_pool`: the blocks that
fall out of every sequence's window give their KV storage back) or, with ``--no-hybrid-kv-cache``, the full
block tables with the window set (:func:`sliding_meta`).  Such a model has no full-attention layer: its pool's
blocks are bookkeeping (block tables, prefix-cache entries) and its KV lives in window blocks only
(:func:`kvkeeper.kvcache.sizing.kv_blocks`).
"""

from __future__ import annotations

import dataclasses

from ..attention.metadata import AttentionMetadata
from .capabilities import Capabilities


def sliding_meta(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The sliding layers' metadata: ``meta.sliding`` when the runner built one (hybrid cache: their own
    block tables), else ``meta`` itself with the window set (all layers share the full block tables)."""
    if meta.sliding is not None:
        return meta.sliding
    return dataclasses.replace(meta, window=window, sliding=None)


def sliding_capabilities(caps: Capabilities) -> Capabilities:
    """``caps`` of a family whose every layer slides: hybrid KV layout, and no KV compression, fused C++ decode
    step or CUDA graphs (on CUDA the windowed layers run the PyTorch attention path)."""
    who = f"sliding-window models ({caps.family} with sliding_window)"
    return caps.replace(kv_layout="hybrid", kv_compression=False, fused_decode=False, cuda_graphs=False, why_not={
        **caps.why_not,
        "kv_compression": f"{who}: their layers keep a window of tokens, not the whole prompt",
        "fused_decode": f"{who}: the fused C++ decode step has no window",
        "cuda_graphs": f"{who}: their windowed layers run the PyTorch path on CUDA"})


class EveryLayerSlides:
    """Mixin before a Llama-family class (``class SlidingX(EveryLayerSlides, X)``): every layer attends within
    ``cfg.sliding_window``; same interface as the class (``forward(input_ids (T,), positions (T,), kv_caches,
    meta)`` -> hidden (T, hidden_size))."""

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        return super().forward(input_ids, positions, kv_caches, sliding_meta(meta, self.config.sliding_window))
