"""Phi-3 (Abdin et al., "Phi-3 Technical Report", 2024): the Llama decoder with checkpoints that store q/k/v as
one ``qkv_proj`` (q, k, v rows concatenated) and the MLP's gate and up as one ``gate_up_proj`` (gate rows, then
up rows), as transformers' ``Phi3ForCausalLM`` does; kvkeeper's layers are fused the same way, so both load as
they are.

GGUF (llama.cpp architecture ``phi3``): ``blk.N.attn_qkv`` and ``blk.N.ffn_up`` (gate and up concatenated, no
``ffn_gate``), q/k rows not permuted (NEOX RoPE); in place (``gguf_in_place``) each is one fused projection whose
output is split, never copied.  A config's ``sliding_window`` (Phi-3-mini-4k: 2,047) makes every layer slide for a
Hugging Face folder, as transformers masks it (:mod:`kvkeeper.models.sliding_window`); llama.cpp disables Phi-3's
window ("Phi SWA is currently disabled", llama.cpp PR 13676), so a GGUF runs full attention, as there.
LongRoPE (the 128k variants: ``rope_scaling`` longrope / su, GGUF ``rope_factors_long``) and partial rotary
embeddings are refused with :class:`~kvkeeper.errors.UnsupportedArchitectureError`.
"""

from __future__ import annotations

from ..model_config import ModelConfig
from .llama import GGUF_LAYER_NAMES, LlamaForCausalLM
from .sliding_window import EveryLayerSlides, sliding_capabilities

END_TOKEN = 32007  # <|end|> of the Phi-3 vocabulary: ends a chat turn (llama.cpp counts it as an end of generation)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 without a binding window; same interface as :class:`LlamaForCausalLM`."""

    capabilities = LlamaForCausalLM.capabilities.replace(family="Phi-3", gguf_permuted_qk=False)
    gguf_layer_names = {**{k: v for k, v in GGUF_LAYER_NAMES.items() if k != "ffn_gate"},
                        "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> type[LlamaForCausalLM]:
        """:class:`SlidingPhi3ForCausalLM` when every layer slides (``cfg.is_hybrid``), else this class."""
        return SlidingPhi3ForCausalLM if cfg.is_hybrid else cls

    @staticmethod
    def gguf_config(cfg: ModelConfig, field, prefix: str, reader) -> None:
        """Phi-3 GGUF metadata: refuses LongRoPE (``rope_factors_long`` / ``rope_factors_short`` tensors or a
        ``{prefix}.rope.scaling.attn_factor``) and a ``{prefix}.rope.dimension_count`` below the head size (partial
        rotary) with UnsupportedArchitectureError; ignores ``{prefix}.attention.sliding_window`` as llama.cpp does;
        adds ``<|end|>`` (token 32007) as an end of sequence when the vocabulary has it."""
        from ..errors import UnsupportedArchitectureError

        names = {t.name for t in reader.tensors}
        if {"rope_factors_long.weight", "rope_factors_short.weight"} & names or field(f"{prefix}.rope.scaling.attn_factor"):
            raise UnsupportedArchitectureError("Phi-3 LongRoPE (the 128k-context variants: rope_factors_long / "
                                               "rope_factors_short) is not supported; the 4k-context models run")
        rot = field(f"{prefix}.rope.dimension_count")
        if rot is not None and int(rot) != cfg.head_dim:
            raise UnsupportedArchitectureError(f"partial rotary embeddings ({prefix}.rope.dimension_count {rot} of "
                                               f"head size {cfg.head_dim}) are not supported")
        toks = reader.fields.get("tokenizer.ggml.tokens")
        if toks is not None and len(toks.data) > END_TOKEN and toks.contents(END_TOKEN) == "<|end|>":
            cfg.eos_token_ids.append(END_TOKEN)


class SlidingPhi3ForCausalLM(EveryLayerSlides, Phi3ForCausalLM):
    """Phi-3 with every layer attending to the last ``sliding_window`` tokens (keys at ``(p - window, p]``)."""

    capabilities = sliding_capabilities(Phi3ForCausalLM.capabilities)
