"""Model families: from a configuration's architecture to the decoder class that runs it."""

from __future__ import annotations

from ..model_config import ModelConfig
from .deepseek import DeepseekForCausalLM
from .llama import LlamaForCausalLM


def causal_lm_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class of a configuration: :class:`DeepseekForCausalLM` for MLA, Gemma 3's
    (:mod:`kvkeeper.models.gemma3`), else :class:`LlamaForCausalLM`."""
    if cfg.architecture == "gemma3":
        from .gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    return DeepseekForCausalLM if cfg.is_mla else LlamaForCausalLM
