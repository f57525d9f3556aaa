"""A Llama-family decoder written against the paged KV cache.

Covers Llama 2/3, SmolLM2, Qwen2/2.5 (q/k/v bias) and Mistral: RMSNorm,
RoPE (with the config's scaling), grouped-query attention, SwiGLU MLP, tied
or untied embeddings.  Weights use Hugging Face names so a HF state dict loads
as is.  Nothing here assumes a CPU: tensors follow the weights' device.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.metadata import AttentionMetadata
from ..attention.selector import paged_attention
from ..layers.gguf_linear import gguf_module, is_gguf_entry
from ..layers.linear import Linear
from ..layers.mlp import MLP
from ..layers.norm import RMSNorm
from ..layers.quantized import PackedWeight, QuantEmbedding, QuantLinear, qmm
from ..layers.rope import RotaryEmbedding, apply_rope
from ..model_config import ModelConfig
from .capabilities import Capabilities

# llama.cpp's GGUF names of a layer's tensors -> transformers' (``blk.{i}.<key>.weight``)
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al., 2023) with one fused q/k/v projection."""

    kernels = None  # see LlamaForCausalLM.use_cpu_kernels

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.kernels is not None:  # RoPE in place on the q and k heads, the fused decode step's routine
            cos, sin = cos_sin
            self.kernels.rope_qk(qkv, cos.view(T, -1), sin.view(T, -1), self.num_heads + self.num_kv_heads,
                                 self.head_dim)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(T, self.num_heads, self.head_dim), *cos_sin)
            k = apply_rope(k.view(T, self.num_kv_heads, self.head_dim), *cos_sin)
        o = paged_attention(q, k, v.view(T, self.num_kv_heads, self.head_dim), kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(T, -1))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the feed-forward; ``self_attn`` / ``mlp`` replace Llama's
    :class:`Attention` / :class:`MLP` (a family's own, e.g. Qwen3's q/k-normed attention and experts)."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = self_attn if self_attn is not None else Attention(cfg)
        self.mlp = mlp if mlp is not None else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos_sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, make_layer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def take_parameters(model: nn.Module, state: dict[str, torch.Tensor], device, dtype: torch.dtype) -> None:
    """Replace every parameter of ``model`` by the state's tensor of the same name, cast to device/dtype
    (no copy when they already match).  Raises :class:`ModelFormatError` naming missing or misshaped tensors."""
    from ..errors import ModelFormatError

    own = dict(model.named_parameters())
    missing = [n for n in own if n not in state]
    if missing:
        raise ModelFormatError(f"weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    for n, p in own.items():
        t = state[n]
        if tuple(t.shape) != tuple(p.shape):
            raise ModelFormatError(f"tensor {n} has shape {tuple(t.shape)}, config expects {tuple(p.shape)}")
        mod_name, _, leaf = n.rpartition(".")
        # take the tensor over (no copy when device and dtype already match)
        setattr(model.get_submodule(mod_name), leaf, nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))


@contextlib.contextmanager
def skip_init():
    """Build modules without running their random initialisers (the weights are loaded next)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


class LlamaForCausalLM(nn.Module):
    """Decoder over packed tokens.

    ``forward(input_ids (T,) int64, positions (T,) int64, kv_caches, meta)``
    returns hidden states (T, hidden_size); ``compute_logits(h (N, hidden))``
    returns float32 logits (N, vocab_size).  ``kv_caches`` is one
    ``PagedKV`` per layer (K and V, each (num_blocks, block_size, KVH, D), plus scales when quantized).

    Class attributes read by the loaders and the runner (see :mod:`kvkeeper.models.capabilities`):
    ``capabilities``; ``gguf_layer_names`` (GGUF tensor key -> transformers' module name),
    ``gguf_norm_offset`` (added to every GGUF norm weight) and :meth:`gguf_config`.
    """

    capabilities = Capabilities("Llama", gguf_permuted_qk=True, gguf_in_place=True)
    gguf_layer_names: dict[str, str] = GGUF_LAYER_NAMES
    gguf_norm_offset = 0.0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg, self.make_layer)
        self.rope = RotaryEmbedding(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @staticmethod
    def make_layer(cfg: ModelConfig, i: int) -> nn.Module:
        """Decoder layer ``i`` (subclasses build other layer types)."""
        return DecoderLayer(cfg)

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> type["LlamaForCausalLM"]:
        """The class that runs ``cfg``: this one (a family with a windowed variant returns it for a config whose
        layers slide, see :mod:`kvkeeper.models.sliding_window`)."""
        return cls

    @staticmethod
    def gguf_config(cfg: ModelConfig, field, prefix: str, reader) -> None:
        """Complete ``cfg`` read from GGUF metadata with what the family fixes (``field(key, default)``
        reads a metadata value, ``prefix`` is the file's ``general.architecture``, ``reader`` the
        ``gguf.GGUFReader``); nothing for Llama."""

    def build_rope(self, device: torch.device, max_positions: int | None = None) -> None:
        """(Re)compute the RoPE tables on ``device`` (a model built on the meta device has none) for positions
        ``[0, max_positions)`` (default: the config's ``max_position_embeddings``)."""
        self.rope = type(self.rope)(self.config, max_positions).to(device)

    def load_weights(self, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32) -> None:
        """Copy a HF-named state dict in (q/k/v and gate/up are fused here).

        A :class:`~kvkeeper.layers.quantized.PackedWeight` under a fused projection's name (e.g.
        ``model.layers.0.self_attn.qkv_proj.weight``) or the embedding's / LM head's name replaces that
        module by a :class:`QuantLinear` / :class:`QuantEmbedding` (see kvkeeper.weights.formats); a GGUF
        matrix in place (a ``GGUFWeight``, or a list of them under a fused name) by a ``GGUFLinear`` /
        ``GGUFEmbedding`` (kvkeeper.layers.gguf_linear).
        Raises :class:`ModelFormatError` naming missing or misshaped tensors.
        """
        from ..errors import ModelFormatError

        state = dict(state)
        for name in [n for n, t in state.items() if isinstance(t, PackedWeight) or is_gguf_entry(t)]:
            pw = state.pop(name)
            mod_name = name.removesuffix(".weight")
            old = self.get_submodule(mod_name)
            parts = pw if isinstance(pw, list) else [pw]
            nk = (sum(p.n for p in parts), parts[0].k)
            if nk != tuple(old.weight.shape):
                raise ModelFormatError(f"tensor {name} has shape {nk}, config expects {tuple(old.weight.shape)}")
            if isinstance(old, nn.Embedding):
                new = QuantEmbedding(pw) if isinstance(pw, PackedWeight) else gguf_module(pw, embedding=True)
            else:
                parts = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj")}.get(mod_name.split(".", 3)[-1], ())
                names = [f"{mod_name.rpartition('.')[0]}.{p}.bias" for p in parts]
                bias = state.pop(f"{mod_name}.bias", None)
                if bias is None and names and all(n in state for n in names):
                    bias = torch.cat([state.pop(n) for n in names], dim=0)
                new = QuantLinear(pw, bias) if isinstance(pw, PackedWeight) else gguf_module(pw, False, bias)
            parent, _, child = mod_name.rpartition(".")
            setattr(self.get_submodule(parent), child, new)
        for i in range(self.config.num_layers):
            pre = f"model.layers.{i}."
            for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                 ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
                for kind in ("weight", "bias"):
                    names = [f"{pre}{p}.{kind}" for p in parts]
                    if all(n in state for n in names):
                        state[f"{pre}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names], dim=0)
        take_parameters(self, state, device, dtype)

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @property
    def lm_packed(self) -> PackedWeight | None:
        """The LM head's packed blocks when it is quantized (tied: the embedding's), else None."""
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return getattr(head, "packed", None)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions, x.dtype)  # once per step, shared by all layers
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos_sin, kv, meta)
        return self.model.norm(x)

    def use_cpu_kernels(self, kernels) -> None:
        """Compute RMSNorm, RoPE and SiLU(gate) * up with the C++ routines of the fused decode step
        (:mod:`kvkeeper.worker.fused_decode`), so that a decode token's result is the same bit for bit whether its
        step runs fused or layer by layer (mixed with a prefill).  For packed (quantized) float32 models on CPU;
        the float32 reference path keeps PyTorch's operators."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.kernels = kernels

    def add_transposed_copies(self) -> None:
        """Keep a transposed copy of every projection and of the LM head (CPU decode speed; ~2x weight memory)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.add_transposed_copy()
        if self.lm_packed is None:
            self._lm_t = self.lm_weight.detach().t().contiguous()

    _lm_t: torch.Tensor | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden_size) -> float32 logits (N, vocab_size)."""
        head = self.lm_packed
        if head is not None:
            return qmm(hidden, head)
        in_place = getattr(self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head, "gguf_logits", None)
        if in_place is not None:  # GGUF blocks in place (kvkeeper.layers.gguf_linear)
            return in_place(hidden)
        if self._lm_t is not None and hidden.shape[0] <= 2:
            return torch.mm(hidden, self._lm_t).float()
        return F.linear(hidden, self.lm_weight).float()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: the Llama decoder with q/k/v biases (``cfg.attention_bias``); llama.cpp's converter
    keeps their q/k rows in transformers' order."""

    capabilities = LlamaForCausalLM.capabilities.replace(family="Qwen2", gguf_permuted_qk=False)
