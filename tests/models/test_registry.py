"""The model registry: architecture -> family class, each family's capabilities, and the refusals they drive."""

from __future__ import annotations

import pytest

from kvkeeper.errors import InvalidRequestError, UnsupportedArchitectureError
from kvkeeper.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvkeeper.models.capabilities import Capabilities
from kvkeeper.models.deepseek import DeepseekForCausalLM
from kvkeeper.models.gemma3 import Gemma3ForCausalLM
from kvkeeper.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from kvkeeper.models.mistral import MistralForCausalLM
from kvkeeper.models.phi3 import Phi3ForCausalLM
from kvkeeper.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from kvkeeper.models.registry import ARCHITECTURES, capabilities, causal_lm_class, family_options, model_class


def _cfg(arch: str) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=2, head_dim=16)


def test_every_supported_architecture_has_a_family():
    assert set(ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES)
    assert {a: causal_lm_class(_cfg(a)) for a in ARCHITECTURES} == {
        "llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
        "qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM,
        "deepseek_v2": DeepseekForCausalLM, "deepseek_v3": DeepseekForCausalLM, "gemma3": Gemma3ForCausalLM,
        "phi3": Phi3ForCausalLM}


@pytest.mark.parametrize("name, nearest", [("qwen2_moe", "qwen3_moe"), ("gemma2", "gemma3"), ("llama4", "llama"),
                                           ("deepseek_v4", "deepseek_v3")])
def test_unsupported_architecture_names_the_nearest(name, nearest):
    for raise_it in (lambda: model_class(name), lambda: ModelConfig.check_architecture(name)):
        with pytest.raises(UnsupportedArchitectureError) as ei:
            raise_it()
        msg = str(ei.value)
        assert repr(name) in msg and f"nearest supported: {nearest!r}" in msg, msg
        assert all(a in msg for a in SUPPORTED_ARCHITECTURES), msg


def test_each_family_declares_its_capabilities():
    llama, qwen, gemma, deepseek = (capabilities(_cfg(a)) for a in ("llama", "qwen2", "gemma3", "deepseek_v2"))
    assert (llama.kv_layout, gemma.kv_layout, deepseek.kv_layout) == ("standard", "hybrid", "latent")
    assert llama.weight_formats == ("none", "int8", "int4", "gguf")
    assert gemma.weight_formats == ("none", "gguf") and deepseek.weight_formats == ("none",)
    assert llama.kv_compression and not gemma.kv_compression and not deepseek.kv_compression
    assert llama.fused_decode and gemma.fused_decode and not deepseek.fused_decode
    assert llama.cuda_graphs and not gemma.cuda_graphs and not deepseek.cuda_graphs
    assert llama.lora and gemma.lora and not deepseek.lora
    assert llama.attention_backends is None and deepseek.attention_backends == ("torch",)
    # llama.cpp permutes Llama's q/k rows, not Qwen2's; Qwen2 is otherwise Llama
    assert llama.gguf_permuted_qk and not qwen.gguf_permuted_qk and not gemma.gguf_permuted_qk
    assert llama.gguf_in_place and gemma.gguf_in_place and not deepseek.gguf_in_place
    assert qwen.replace(gguf_permuted_qk=True, family="Llama") == llama
    assert isinstance(capabilities(_cfg("mistral")), Capabilities)
    # Qwen3: Llama's projections and GGUF conventions (unpermuted like Qwen2) plus per-head q/k norms (the fused
    # C++ decode step has them); Qwen3-MoE: experts float (none, or gguf with them dequantized), no LoRA, no graphs,
    # no fused step (it has no experts)
    qwen3, moe = capabilities(_cfg("qwen3")), capabilities(_cfg("qwen3_moe"))
    assert qwen3.weight_formats == llama.weight_formats and qwen3.gguf_in_place and not qwen3.gguf_permuted_qk
    assert qwen3.fused_decode and qwen3.cuda_graphs and qwen3.lora and qwen3.kv_compression
    assert moe.weight_formats == ("none", "gguf") and moe.gguf_in_place and not moe.gguf_permuted_qk
    assert not (moe.fused_decode or moe.cuda_graphs or moe.lora) and moe.kv_layout == "standard"
    assert "fused C++ decode step" in moe.refusal("fused_decode")


def test_capabilities_are_checked_when_declared():
    with pytest.raises(ValueError, match="kv_layout"):
        Capabilities("X", kv_layout="paged")
    with pytest.raises(ValueError, match="weight_formats"):
        Capabilities("X", weight_formats=("int8",))


def test_family_options_follow_the_capabilities():
    llama, gemma, deepseek = _cfg("llama"), _cfg("gemma3"), _cfg("deepseek_v3")
    assert family_options(llama, "auto", "int8") == ("auto", "int8")
    assert family_options(deepseek, "auto", None) == ("torch", "none")
    assert family_options(gemma, "cpu", "auto") == ("cpu", "auto")  # the file decides: gguf in place or none
    assert family_options(gemma, "auto", "gguf") == ("auto", "gguf")
    with pytest.raises(InvalidRequestError, match="no Multi-head Latent Attention kernel.*use auto or torch"):
        family_options(deepseek, "triton", None)
    with pytest.raises(InvalidRequestError, match="'int4' does not run DeepSeek .*use --quantization none"):
        family_options(deepseek, "auto", "int4")
    with pytest.raises(InvalidRequestError, match="'int8' does not run Gemma 3 .*use --quantization none or gguf"):
        family_options(gemma, "auto", "int8")


def test_a_window_below_the_context_picks_the_windowed_class():
    """Mistral / Phi-3 configs whose window binds run their windowed class, whose capabilities say so; a window of
    the whole context (or none) keeps the plain class and Llama's capabilities."""
    import dataclasses

    for arch, plain in (("mistral", MistralForCausalLM), ("phi3", Phi3ForCausalLM)):
        slides = dataclasses.replace(_cfg(arch), sliding_window=8, layer_types=["sliding_attention"] * 2)
        cls = causal_lm_class(slides)
        assert issubclass(cls, plain) and cls is not plain and cls.forward is not plain.forward
        caps = capabilities(slides)
        assert caps.kv_layout == "hybrid" and not (caps.fused_decode or caps.cuda_graphs or caps.kv_compression)
        assert "sliding-window" in caps.refusal("fused_decode")
        assert causal_lm_class(_cfg(arch)) is plain and capabilities(_cfg(arch)).kv_layout == "standard"
    raw = {"model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 4096}
    assert ModelConfig.from_hf_dict({**raw, "sliding_window": 4096}).layer_types is None
    assert ModelConfig.from_hf_dict({**raw, "sliding_window": None}).context_length == 4096
    windowed = ModelConfig.from_hf_dict({**raw, "sliding_window": 1024})
    assert windowed.is_hybrid and windowed.context_length == 4096  # the window no longer caps the context
