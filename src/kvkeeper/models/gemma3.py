"""Gemma 3 text decoder (Gemma Team, "Gemma 3 Technical Report", 2025) written against the paged KV cache.

Differences from Llama (:mod:`kvkeeper.models.llama`), as transformers' ``Gemma3ForCausalLM`` computes them:
the embedding is scaled by ``sqrt(hidden_size)``; RMSNorm multiplies by ``1 + weight``; every layer has
four norms (before and after attention, before and after the feed-forward) plus RMSNorm over each query and
key head; the MLP is GELU(tanh)(gate) * up; attention scores are scaled by ``query_pre_attn_scalar**-0.5``;
the layers of ``layer_types`` "sliding_attention" attend to the last ``sliding_window`` tokens only (each
query sees keys at positions ``(p - window, p]``) with RoPE base ``rope_local_theta``, the others to the whole
context with ``rope_theta``; logits are soft-capped ``cap * tanh(x / cap)`` when the config has a cap.

A sliding layer reads ``meta.sliding`` (the sliding layers' block tables and slots, see
:mod:`kvkeeper.worker.runner` and :mod:`kvkeeper.kvcache.block_pool`'s window blocks), a full layer ``meta``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.selector import paged_attention
from ..attention.metadata import AttentionMetadata
from ..model_config import ModelConfig
from ..layers.linear import Linear
from .capabilities import Capabilities
from .llama import GGUF_LAYER_NAMES, LlamaForCausalLM
from .sliding_window import sliding_meta
from ..layers.rope import RotaryEmbedding, apply_rope


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, in float32 (transformers' Gemma3RMSNorm); x (..., dim) -> same.  With
    ``kernels`` set (:meth:`Gemma3ForCausalLM.use_cpu_kernels`), the C++ RMSNorm by ``scale`` = 1 + weight."""

    kernels = None
    scale: torch.Tensor | None = None  # float32 (dim,): 1 + weight, set with kernels

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.float32:
            return self.kernels.rmsnorm(x, self.scale, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    """Grouped-query attention with q/k RMSNorm; ``sliding``: attends within the config's window."""

    def __init__(self, cfg: ModelConfig, sliding: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.sliding = sliding

    kernels = None  # the C++ kernels (use_cpu_kernels): RoPE by the fused decode step's routine

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        if self.kernels is not None and q.dtype == torch.float32:  # in place, as csrc/cpu/fused_decode.cpp
            qk = torch.cat([q.reshape(T, -1), k.reshape(T, -1)], dim=1)
            cos, sin = (t.reshape(T, -1).contiguous() for t in cos_sin)
            self.kernels.rope_qk(qk, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
            q = qk[:, : self.q_size].view(T, self.num_heads, self.head_dim)
            k = qk[:, self.q_size :].view(T, self.num_kv_heads, self.head_dim)
        else:
            q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        o = paged_attention(q, k, v.view(T, self.num_kv_heads, self.head_dim), kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(T, -1))


class GemmaMLP(nn.Module):
    """GELU(tanh approximation)(gate) * up, then down; one fused gate/up projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=False)

    kernels = None  # the C++ kernels (use_cpu_kernels): GELU(tanh)(gate) * up by the fused decode step's routine

    def forward(self, x):
        gu = self.gate_up_proj(x)
        if self.kernels is not None and gu.dtype == torch.float32:
            return self.down_proj(self.kernels.gelu_mul(gu))
        gate, up = gu.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.sliding = cfg.is_sliding_layer(i)
        self.self_attn = GemmaAttention(cfg, self.sliding)
        self.mlp = GemmaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos_sin, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 over packed tokens; same interface as :class:`LlamaForCausalLM` (``forward(input_ids (T,),
    positions (T,), kv_caches, meta)`` -> hidden (T, hidden_size); ``compute_logits`` -> float32 (N, vocab))."""

    capabilities = Capabilities(
        "Gemma 3", kv_layout="hybrid", weight_formats=("none", "gguf"), kv_compression=False, fused_decode=True,
        cuda_graphs=False, gguf_in_place=True,
        why_not={"weight_formats": "Gemma 3 (its GGUF blocks run in place, gguf, or as float32, none)",
                 "kv_compression": "sliding-window models (Gemma 3): their layers keep different token ranges",
                 "cuda_graphs": "sliding-window models (Gemma 3): their windowed layers run the PyTorch path on CUDA"})
    # four norms a layer plus q/k norms; llama.cpp's converter stores every norm as 1 + weight and keeps q/k rows in
    # transformers' order (no RoPE permutation, gguf_permuted_qk False).  In place (gguf_in_place), the matrices stay
    # GGUF blocks over the file's map (kvkeeper.layers.gguf_linear): q/k/v and gate/up as fused parts, the token
    # embedding as a GGUFEmbedding (rows dequantized on lookup, then scaled by sqrt(hidden) in forward) that is also
    # the tied LM head.
    gguf_layer_names = {
        **GGUF_LAYER_NAMES,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    gguf_norm_offset = -1.0

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope_local = RotaryEmbedding(self.local_rope_config(cfg))
        self.embed_scale = math.sqrt(cfg.hidden_size)

    @staticmethod
    def make_layer(cfg: ModelConfig, i: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, i)

    @staticmethod
    def gguf_config(cfg: ModelConfig, field, prefix: str, reader) -> None:
        """Gemma 3 hyper-parameters that GGUF metadata carries or llama.cpp fixes for the architecture: the
        window (``{prefix}.attention.sliding_window``), every 6th layer global, local RoPE base 10,000, query
        scale ``key_length**-0.5`` (Gemma 3 270M/1B/4B/12B), soft-capping when the file names one, and token
        106 ``<end_of_turn>`` as an end of sequence.  Raises UnsupportedArchitectureError for attention
        logit soft-capping (Gemma 2)."""
        from ..errors import UnsupportedArchitectureError
        from ..model_config import gemma3_layer_types

        p = prefix
        cfg.sliding_window = int(field(f"{p}.attention.sliding_window", 4096))
        cfg.layer_types = gemma3_layer_types(cfg.num_layers)
        cfg.rope_local_theta = 10000.0
        cfg.query_pre_attn_scalar = float(cfg.head_dim)
        cap = field(f"{p}.final_logit_softcapping")
        cfg.final_logit_softcapping = float(cap) if cap else None
        if field(f"{p}.attn_logit_softcapping"):
            raise UnsupportedArchitectureError("attention logit soft-capping (Gemma 2) is not supported")
        toks = reader.fields.get("tokenizer.ggml.tokens")
        if toks is not None and len(toks.data) > 106 and toks.contents(106) == "<end_of_turn>":
            cfg.eos_token_ids.append(106)  # a chat turn ends there

    def build_rope(self, device: torch.device, max_positions: int | None = None) -> None:
        """The full layers' RoPE tables and the sliding layers' (base ``rope_local_theta``) on ``device``."""
        super().build_rope(device, max_positions)
        self.rope_local = type(self.rope)(self.local_rope_config(self.config), max_positions).to(device)

    @staticmethod
    def local_rope_config(cfg: ModelConfig) -> ModelConfig:
        """The configuration of the sliding layers' RoPE (base ``rope_local_theta``, no scaling)."""
        return dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None, rope_freq_factors=None)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # as transformers: the scale in the weights' dtype
        cs_full = self.rope.cos_sin(positions, x.dtype)
        cs_local = self.rope_local.cos_sin(positions, x.dtype)
        meta_local = sliding_meta(meta, self.config.sliding_window)
        for layer, kv in zip(self.model.layers, kv_caches):
            if layer.sliding:
                x = layer(x, cs_local, kv, meta_local)
            else:
                x = layer(x, cs_full, kv, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def use_cpu_kernels(self, kernels) -> None:
        """RMSNorm (by 1 + weight, kept as ``scale``), RoPE and GELU(tanh)(gate) * up through the C++ routines of
        the fused decode step (:mod:`kvkeeper.worker.fused_decode`), so a decode token's result is the same bit
        for bit whether its step runs fused or layer by layer (for float32 activations on CPU)."""
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.scale = (1.0 + m.weight.detach().float()).contiguous()
            if isinstance(m, (GemmaRMSNorm, GemmaAttention, GemmaMLP)):
                m.kernels = kernels
