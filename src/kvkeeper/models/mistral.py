"""Mistral (Jiang et al., "Mistral 7B", 2023): the Llama decoder, with sliding-window attention on every layer
when its config has a ``sliding_window`` below the context (Mistral 7B v0.1: 4,096 of 32,768 tokens; v0.2 and
later set none and run as Llama).

A GGUF of Mistral is written by llama.cpp's converter as architecture ``llama`` with q/k permuted and without a
window key, and llama.cpp runs it with full attention; so does kvkeeper (it loads as :class:`LlamaForCausalLM`).
"""

from __future__ import annotations

from ..model_config import ModelConfig
from .llama import LlamaForCausalLM
from .sliding_window import EveryLayerSlides, sliding_capabilities


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral without a window that binds: Llama's decoder (``forward``, ``compute_logits`` as
    :class:`LlamaForCausalLM`)."""

    capabilities = LlamaForCausalLM.capabilities.replace(family="Mistral")

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> type[LlamaForCausalLM]:
        """:class:`SlidingMistralForCausalLM` when every layer slides (``cfg.is_hybrid``), else this class."""
        return SlidingMistralForCausalLM if cfg.is_hybrid else cls


class SlidingMistralForCausalLM(EveryLayerSlides, MistralForCausalLM):
    """Mistral with every layer attending to the last ``sliding_window`` tokens (keys at ``(p - window, p]``)."""

    capabilities = sliding_capabilities(MistralForCausalLM.capabilities)
