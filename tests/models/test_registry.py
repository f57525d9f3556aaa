"""The model registry: architecture -> family class, each family's capabilities, and the refusals they drive."""

from __future__ import annotations

import pytest

from kvkeeper.errors import InvalidRequestError, UnsupportedArchitectureError
from kvkeeper.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvkeeper.models.capabilities import Capabilities
from kvkeeper.models.deepseek import DeepseekForCausalLM
from kvkeeper.models.gemma3 import Gemma3ForCausalLM
from kvkeeper.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from kvkeeper.models.registry import ARCHITECTURES, capabilities, causal_lm_class, family_options, model_class


def _cfg(arch: str) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=2, head_dim=16)


def test_every_supported_architecture_has_a_family():
    assert set(ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES)
    assert {a: causal_lm_class(_cfg(a)) for a in ARCHITECTURES} == {
        "llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
        "deepseek_v2": DeepseekForCausalLM, "deepseek_v3": DeepseekForCausalLM, "gemma3": Gemma3ForCausalLM}


@pytest.mark.parametrize("name, nearest", [("qwen3", "qwen2"), ("gemma2", "gemma3"), ("llama4", "llama"),
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
    assert llama.fused_decode and not gemma.fused_decode and not deepseek.fused_decode
    assert llama.cuda_graphs and not gemma.cuda_graphs and not deepseek.cuda_graphs
    assert llama.lora and gemma.lora and not deepseek.lora
    assert llama.attention_backends is None and deepseek.attention_backends == ("torch",)
    # llama.cpp permutes Llama's q/k rows, not Qwen2's; Qwen2 is otherwise Llama
    assert llama.gguf_permuted_qk and not qwen.gguf_permuted_qk and not gemma.gguf_permuted_qk
    assert llama.gguf_in_place and gemma.gguf_in_place and not deepseek.gguf_in_place
    assert qwen.replace(gguf_permuted_qk=True, family="Llama") == llama
    assert isinstance(capabilities(_cfg("mistral")), Capabilities)


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
