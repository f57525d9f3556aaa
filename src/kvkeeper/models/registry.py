"""Model families: from a configuration's architecture to the decoder class that runs it, and what it supports.

``ARCHITECTURES`` maps every supported architecture (``ModelConfig.architecture``) to its family class;
:func:`capabilities` returns that class's :class:`~kvkeeper.models.capabilities.Capabilities`, which every
family-dependent check reads instead of naming an architecture; :func:`family_options` applies the ones that
restrict the engine's options (attention backends, weight formats).
"""

from __future__ import annotations

from ..errors import InvalidRequestError, UnsupportedArchitectureError
from ..model_config import ModelConfig, unsupported_architecture
from .capabilities import WEIGHT_FORMATS, Capabilities
from .deepseek import DeepseekForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM, Qwen2ForCausalLM
from .mistral import MistralForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The family class of an architecture name; raises :class:`UnsupportedArchitectureError` naming it and
    the nearest supported one."""
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise UnsupportedArchitectureError(unsupported_architecture(architecture))
    return cls


def causal_lm_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class of a configuration (``ARCHITECTURES[cfg.architecture]``, or its windowed variant for a
    config whose layers slide: ``for_config``); raises :class:`UnsupportedArchitectureError` for an architecture
    not in the registry."""
    return model_class(cfg.architecture).for_config(cfg)


def capabilities(cfg: ModelConfig) -> Capabilities:
    """What the configuration's family supports (see :mod:`kvkeeper.models.capabilities`)."""
    return causal_lm_class(cfg).capabilities


def family_options(cfg: ModelConfig, attention_backend: str, quantization: str | None) -> tuple[str, str | None]:
    """(attention backend, weight format) the family runs for the requested ones: "auto" (or None) becomes
    the family's only backend / format when it has one; other names pass unchanged.  Raises
    :class:`InvalidRequestError` for a backend or a weight format (none, int8, int4, gguf) the family has
    no path for."""
    caps = capabilities(cfg)
    backends = caps.attention_backends
    if backends is not None:
        if attention_backend not in ("auto", *backends):
            raise InvalidRequestError(f"attention backend {attention_backend!r} has no "
                                      f"{caps.refusal('attention_backends')}: use auto or {' or '.join(backends)}")
        attention_backend = attention_backend if attention_backend != "auto" or len(backends) > 1 else backends[0]
    formats, name = caps.weight_formats, None if quantization is None else str(quantization).lower()
    if name in WEIGHT_FORMATS and name not in formats:  # (other names: aliases or errors of resolve_quantization)
        raise InvalidRequestError(f"weight quantization {quantization!r} does not run "
                                  f"{caps.refusal('weight_formats')}; use --quantization {' or '.join(formats)}")
    if name in (None, "auto") and len(formats) == 1:
        quantization = formats[0]
    return attention_backend, quantization
