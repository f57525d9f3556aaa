"""Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``) decoders on the paged KV cache.

Differences from Llama (:mod:`kvkeeper.models.llama`), as transformers' ``Qwen3ForCausalLM`` /
``Qwen3MoeForCausalLM`` compute them (Qwen Team, "Qwen3 Technical Report", 2025, arXiv:2505.09388): an RMSNorm
over each query and each key head (``q_norm`` / ``k_norm``, weights (head_dim,)) before RoPE; ``head_dim`` set by
the config (Qwen3-0.6B: 128 with hidden 1024 and 16 heads); a bias on q/k/v *and* o only when
``attention_bias`` (false in the released models).  Qwen3-MoE replaces the MLP of its sparse layers
(:meth:`~kvkeeper.model_config.ModelConfig.is_moe_layer`: every ``decoder_sparse_step``-th layer not in
``mlp_only_layers``) by :class:`~kvkeeper.layers.moe.MoE`: softmax router ``mlp.gate`` (E, hidden), top
``num_experts_per_tok`` of ``num_experts``, weights renormalized when ``norm_topk_prob``, SwiGLU experts of
``moe_intermediate_size``, no shared expert.

GGUF (llama.cpp's ``qwen3`` / ``qwen3moe``): q/k rows are not permuted (llama.cpp's Qwen converters keep
transformers' order; RoPE is NeoX-style, half-split), per-head norms are ``blk.N.attn_q_norm`` / ``attn_k_norm``,
the router ``ffn_gate_inp`` and the experts three (E, rows, cols) tensors ``ffn_{gate,up,down}_exps``.  Matrices
run in place (``gguf_in_place``) as Llama's do; the 3-D expert tensors are dequantized to float32 at load.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.metadata import AttentionMetadata
from ..attention.selector import paged_attention
from ..layers.linear import Linear
from ..layers.mlp import MLP
from ..layers.moe import MoE, stack_experts
from ..layers.norm import RMSNorm
from ..layers.rope import apply_rope
from ..model_config import ModelConfig
from .llama import GGUF_LAYER_NAMES, Attention, DecoderLayer, LlamaForCausalLM


class Qwen3Attention(Attention):
    """Grouped-query attention with RMSNorm over each q and k head (over head_dim) before RoPE; o_proj has a bias
    when the config's ``attention_bias`` does."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata):
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q.reshape(T, H, D)), self.k_norm(k.reshape(T, KVH, D))
        if self.kernels is not None and q.dtype == torch.float32:  # in place, as csrc/cpu/fused_decode.cpp
            qk = torch.cat([q.reshape(T, -1), k.reshape(T, -1)], dim=1)
            cos, sin = (t.reshape(T, -1).contiguous() for t in cos_sin)
            self.kernels.rope_qk(qk, cos, sin, H + KVH, D)
            q, k = qk[:, : self.q_size].view(T, H, D), qk[:, self.q_size :].view(T, KVH, D)
        else:
            q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        return self.o_proj(paged_attention(q, k, v.reshape(T, KVH, D), kv_cache, meta, self.scale).reshape(T, -1))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 over packed tokens; the interface of :class:`LlamaForCausalLM`.  Every weight format runs (the
    projections are Llama's), and so does the fused C++ decode step (its per-head q/k norms set by
    ``DecodeModel.set_layer_norms``)."""

    capabilities = LlamaForCausalLM.capabilities.replace(family="Qwen3", gguf_permuted_qk=False)
    gguf_layer_names = {**GGUF_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

    @staticmethod
    def make_layer(cfg: ModelConfig, i: int) -> nn.Module:
        """Llama's block with :class:`Qwen3Attention`, and (Qwen3-MoE's sparse layers) a mixture of experts."""
        return DecoderLayer(cfg, Qwen3Attention(cfg), MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE over packed tokens; the interface of :class:`LlamaForCausalLM`.  Weights keep transformers'
    names except that each layer's experts are stacked (:func:`~kvkeeper.layers.moe.stack_experts`, from the
    checkpoint's per-expert tensors or a GGUF file's 3-D ones).  Formats ``none`` and ``gguf`` (attention, dense
    MLPs, embedding and LM head in place; experts and router dequantized to float32 at load)."""

    capabilities = Qwen3ForCausalLM.capabilities.replace(
        family="Qwen3-MoE", weight_formats=("none", "gguf"), cuda_graphs=False, lora=False, fused_decode=False,
        why_not={"weight_formats": "Qwen3-MoE models (int8 / int4 have no packed path for the experts)",
                 "fused_decode": "Qwen3-MoE layers (the fused C++ decode step has no experts)",
                 "cuda_graphs": "Qwen3-MoE models: expert routing reads token counts on the host",
                 "lora": "this model's experts (MoE) have no LoRA path"})
    gguf_layer_names = {**Qwen3ForCausalLM.gguf_layer_names, "ffn_gate_inp": "mlp.gate",
                        "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                        "ffn_down_exps": "mlp.experts.down_proj"}

    @staticmethod
    def gguf_config(cfg: ModelConfig, field, prefix: str, reader) -> None:
        """The experts of a llama.cpp ``qwen3moe`` file: ``{prefix}.expert_count``, ``expert_used_count``,
        ``expert_feed_forward_length``; llama.cpp's graph always renormalizes the top-k weights (Qwen3-MoE's
        ``norm_topk_prob`` true); a layer without ``blk.N.ffn_gate_inp`` is dense.  Raises ModelFormatError
        when the expert metadata is missing."""
        from ..errors import ModelFormatError

        keys = ("expert_count", "expert_used_count", "expert_feed_forward_length")
        values = [field(f"{prefix}.{k}") for k in keys]
        if any(v is None for v in values):
            missing = [f"{prefix}.{k}" for k, v in zip(keys, values) if v is None]
            raise ModelFormatError(f"a {prefix} GGUF file needs the metadata {', '.join(missing)}")
        cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size = (int(v) for v in values)
        cfg.norm_topk_prob = True
        names = {t.name for t in reader.tensors}
        cfg.mlp_only_layers = [i for i in range(cfg.num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]

    def load_weights(self, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32) -> None:
        """Stack each MoE layer's experts, then :meth:`LlamaForCausalLM.load_weights` (fusions, GGUF matrices in
        place).  Raises :class:`ModelFormatError` naming missing or misshaped tensors."""
        state = dict(state)
        for i in range(self.config.num_layers):
            if self.config.is_moe_layer(i):
                stack_experts(state, f"model.layers.{i}.mlp.", self.config.n_routed_experts)
        super().load_weights(state, device, dtype)
