"""A Llama-family decoder written against the paged KV cache.

Covers Llama 2/3, SmolLM2, Qwen2/2.5 (q/k/v bias) and Mistral: RMSNorm,
RoPE (with the config's scaling), grouped-query attention, SwiGLU MLP, tied
or untied embeddings.  Weights use Hugging Face names so a HF state dict loads
as is.  Nothing here assumes a CPU: tensors follow the weights' device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), computed in float32 like transformers."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=b)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(q, k, positions)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer, 2020)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder over packed tokens.

    ``forward(input_ids (T,) int64, positions (T,) int64, kv_caches, meta)``
    returns hidden states (T, hidden_size); ``compute_logits(h (N, hidden))``
    returns float32 logits (N, vocab_size).  ``kv_caches`` is one
    ``(k_cache, v_cache)`` pair per layer, each (num_blocks, block_size, KVH, D).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.rope = RotaryEmbedding(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a HF-named state dict in; raises :class:`ModelFormatError` naming missing or misshaped tensors."""
        from ..errors import ModelFormatError

        own = dict(self.named_parameters())
        missing = [n for n in own if n not in state]
        if missing:
            raise ModelFormatError(f"weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for n, p in own.items():
                t = state[n]
                if tuple(t.shape) != tuple(p.shape):
                    raise ModelFormatError(f"tensor {n} has shape {tuple(t.shape)}, config expects {tuple(p.shape)}")
                p.copy_(t)

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, positions, self.rope, kv, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_weight).float()
