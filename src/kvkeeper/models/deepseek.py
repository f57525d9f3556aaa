"""DeepSeek V2 / V2-Lite / V3 decoders (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``) on the paged cache.

Multi-head Latent Attention (:mod:`kvkeeper.layers.mla`) in every layer, a dense SwiGLU MLP in the first
``first_k_dense_replace`` layers and a mixture of experts (:mod:`kvkeeper.layers.moe`) after them.  Same
interface as :class:`~kvkeeper.models.llama.LlamaForCausalLM` (``forward``, ``compute_logits``,
``load_weights``); weights keep transformers' names, except that each MLP's gate/up projections are fused and
the routed experts are stacked (``mlp.experts.gate_up_proj`` (E, 2 * inter, hidden), ``mlp.experts.down_proj``
(E, hidden, inter)), built here from the checkpoint's per-expert tensors.  The KV cache of every layer is a
latent :class:`~kvkeeper.kvcache.formats.base.PagedKV` (``values=False``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..model_config import ModelConfig
from .capabilities import Capabilities
from ..layers.mlp import MLP
from .llama import DecoderLayer, LlamaForCausalLM, take_parameters
from ..layers.norm import RMSNorm
from ..layers.mla import DECODE_MODES, MLAttention
from ..layers.moe import MoE, stack_experts


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm residual block: MLA, then a dense MLP or a mixture of experts."""

    forward = DecoderLayer.forward

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _fuse_and_stack(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> this model's: gate/up fused, routed experts stacked (a new dict)."""
    state = dict(state)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp."
        for mlp in (pre, pre + "shared_experts."):
            names = [f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"]
            if all(n in state for n in names):
                state[f"{mlp}gate_up_proj.weight"] = torch.cat([state.pop(n) for n in names], dim=0)
        if cfg.is_moe_layer(i):
            stack_experts(state, pre, cfg.n_routed_experts)
    return state


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek V2/V3 over packed tokens: the interface of :class:`LlamaForCausalLM`, with ``kv_caches`` one latent
    :class:`~kvkeeper.kvcache.formats.base.PagedKV` per layer (rows (num_blocks, block_size, 1, kv_lora_rank +
    qk_rope_head_dim)).  The RoPE tables are built for ``qk_rope_head_dim`` (``cfg.head_dim``)."""

    capabilities = Capabilities(
        "DeepSeek", kv_layout="latent", weight_formats=("none",), attention_backends=("torch",),
        kv_compression=False, fused_decode=False, cuda_graphs=False, lora=False,
        why_not={"weight_formats": "DeepSeek (MLA/MoE) models yet",
                 "attention_backends": "Multi-head Latent Attention kernel; DeepSeek models run attention in PyTorch",
                 "kv_compression": "Multi-head Latent Attention (DeepSeek) models: their cache holds one shared "
                                   "latent row per token, not per-head keys",
                 "fused_decode": "DeepSeek (MLA/MoE) layers (the fused C++ decode step is written for Llama's)",
                 "cuda_graphs": "DeepSeek models: their attention runs in PyTorch",
                 "lora": "this model's attention (MLA) or experts (MoE) have no LoRA path"})

    @staticmethod
    def make_layer(cfg: ModelConfig, i: int) -> nn.Module:
        return DeepseekDecoderLayer(cfg, i)

    def load_weights(self, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32) -> None:
        """Copy a HF-named DeepSeek state dict in (float tensors only).  Raises :class:`ModelFormatError` naming
        missing or misshaped tensors, or a packed (quantized) weight, which this model does not run."""
        from ..errors import ModelFormatError

        if any(not isinstance(t, torch.Tensor) for t in state.values()):
            raise ModelFormatError("DeepSeek models run float weights only (--quantization none)")
        take_parameters(self, _fuse_and_stack(state, self.config), device, dtype)

    def set_decode_mode(self, mode: str) -> None:
        """Decode attention form of every MLA layer: "absorbed" (default) or "expanded".  Raises ValueError."""
        if mode not in DECODE_MODES:
            raise ValueError(f"unknown MLA decode mode {mode!r}; choose one of {', '.join(DECODE_MODES)}")
        for m in self.modules():
            if isinstance(m, MLAttention):
                m.decode_mode = mode

    def use_cpu_kernels(self, kernels) -> None:
        """Not available: the fused C++ decode step is written for Llama layers (DeepSeek runs float weights)."""
        raise ValueError("the fused C++ decode step does not run DeepSeek (MLA/MoE) layers")


