"""Model configuration: the hyper-parameters of a Llama-family decoder.

Read from a Hugging Face ``config.json`` or from GGUF metadata; both end up as
one :class:`ModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ModelFormatError, UnsupportedArchitectureError

# model_type (HF) / general.architecture (GGUF) values we implement.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gemma3",
                           "phi3")
_HF_ARCH_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "qwen3moe": "qwen3_moe",  # llama.cpp's GGUF architecture name
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma3ForCausalLM": "gemma3",
    "gemma3_text": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_architecture(name: str) -> str:
    """The message for an architecture kvkeeper does not implement: ``name``, the nearest supported
    architecture (by spelling) and every supported one."""
    import difflib

    names = {**{a: a for a in SUPPORTED_ARCHITECTURES}, **{k.lower(): v for k, v in _HF_ARCH_NAMES.items()}}
    near = difflib.get_close_matches(str(name).lower(), list(names), n=1, cutoff=0.0)
    hint = f" (nearest supported: {names[near[0]]!r})" if near else ""
    return (f"architecture {name!r} is not supported{hint}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral, DeepSeek V2/V3, Gemma 3, Phi-3)")


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder: Llama family (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Mistral, Phi-3), Qwen3-MoE,
    DeepSeek V2/V3 or Gemma 3.

    For DeepSeek (``kv_lora_rank > 0``: Multi-head Latent Attention, DeepSeek-AI 2024, arXiv:2405.04434)
    ``head_dim`` is the RoPE part of a query/key head (``qk_rope_head_dim``, as transformers' config sets it).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": ..., "factor": ...}
    rope_freq_factors: list[float] | None = None  # GGUF rope_freqs (Llama 3.x scaling baked per frequency)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k and v projections (Qwen2)
    sliding_window: int | None = None  # tokens a sliding layer attends to (see layer_types; Qwen2: caps the context)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    revision: str = ""  # identifies the weights; part of every KV cache namespace
    # Multi-head Latent Attention (DeepSeek V2/V3); kv_lora_rank 0 means standard attention
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: one q_proj (V2-Lite); else q_a_proj -> RMSNorm -> q_b_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_layout: str = "half"  # "half": HF half-split; "complex": V2 adjacent pairs; "interleave": V3 rope_interleave
    # mixture of experts (DeepSeek, Qwen3-MoE); n_routed_experts 0 means every layer is a dense MLP
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0  # layers below this index are dense
    routed_scaling_factor: float = 1.0
    router: str = "softmax"  # "softmax" (V2, topk_method greedy / group_limited_greedy) or "sigmoid" (V3)
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here (dense layers)
    # Gemma 3: per-layer attention kind, local RoPE base, query scaling, logit soft-capping
    layer_types: list[str] | None = None  # "sliding_attention" / "full_attention" per layer (None: all full;
    # Gemma 3 mixes both, a Mistral / Phi-3 config with a window below its context slides every layer)
    rope_local_theta: float = 10000.0  # RoPE base of the sliding-window layers (Gemma 3 rope_local_base_freq)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def is_hybrid(self) -> bool:
        """True when some layers (Gemma 3) or all (Mistral, Phi-3 with a window) attend within ``sliding_window``
        tokens; the others attend to the whole context."""
        return bool(self.layer_types) and bool(self.sliding_window) and "sliding_attention" in self.layer_types

    def is_sliding_layer(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention"

    @property
    def is_mla(self) -> bool:
        """True for Multi-head Latent Attention (one latent row per token and layer in the cache)."""
        return self.kv_lora_rank > 0

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(parts, heads, dim) of one token's cache per layer: (2, num_kv_heads, head_dim) for K and V, or
        (1, 1, kv_lora_rank + qk_rope_head_dim) for an MLA latent row."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` has a mixture of experts (DeepSeek: from ``first_k_dense_replace`` on; Qwen3-MoE:
        every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``, as transformers builds them)."""
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def context_length(self) -> int:
        """Tokens a sequence may hold (prompt plus output)."""
        if self.sliding_window and not self.layer_types:  # a window without sliding layers (Qwen2's) caps it
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K plus V (or of the MLA latent row) for one token across all layers."""
        parts, heads, dim = self.kv_layout
        return parts * self.num_layers * heads * dim * dtype_bytes

    @staticmethod
    def check_architecture(name: str) -> str:
        """The architecture of a ``model_type`` / HF class / GGUF name; raises UnsupportedArchitectureError
        naming it, the nearest supported one and the list."""
        arch = _HF_ARCH_NAMES.get(name, name).lower()
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(unsupported_architecture(name))
        return arch

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary.

        Raises :class:`UnsupportedArchitectureError` for another model type and
        :class:`ModelFormatError` when a required key is missing.
        """
        name = cfg.get("model_type") or (cfg.get("architectures") or ["?"])[0]
        arch = cls.check_architecture(name)
        try:
            n_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            rope = dict(rope)
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
            if arch == "phi3":
                _check_phi3_rope(cfg, rope, rtype)
            scaling = None if rtype == "default" else {**rope, "rope_type": rtype}
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedArchitectureError(
                    f"rope scaling type {rtype!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(x) for x in eos])
            sliding = cfg.get("sliding_window")
            if arch in ("qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
                raise UnsupportedArchitectureError(f"use_sliding_window is not supported for {arch} (its released "
                                                   "models set it false); set it false to run full attention")
            if arch in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
                sliding = None
            kw = dict(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=n_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            if arch.startswith("deepseek"):
                kw.update(_deepseek_fields(cfg, arch))
            if arch == "gemma3":
                kw.update(_gemma3_fields(cfg))
            if arch == "qwen3_moe":
                kw.update(_qwen3_moe_fields(cfg))
            if arch in ("mistral", "phi3"):
                kw["layer_types"] = every_layer_slides(kw["sliding_window"], kw["max_position_embeddings"],
                                                       kw["num_layers"])
            return cls(**kw)
        except KeyError as e:
            raise ModelFormatError(f"config.json lacks the required key {e.args[0]!r}") from e


def every_layer_slides(window: int | None, max_positions: int, num_layers: int) -> list[str] | None:
    """Layer kinds of a model whose every layer attends to the last ``window`` tokens (Mistral, Phi-3 with
    ``sliding_window``, as transformers' MistralForCausalLM / Phi3ForCausalLM mask them): all
    "sliding_attention"; None (every layer full) without a window or with one of ``max_positions`` or more,
    which no query can exceed."""
    if not window or window >= max_positions:
        return None
    return ["sliding_attention"] * num_layers


def _check_phi3_rope(cfg: dict[str, Any], rope: dict[str, Any], rtype: str) -> None:
    """Refuse the Phi-3 RoPE variants kvkeeper does not implement: LongRoPE (``longrope``, and ``su`` / ``yarn``,
    which transformers' Phi3Config renames to it: the 128k-context models) and partial rotary embeddings
    (``partial_rotary_factor`` below 1, e.g. Phi-4-mini)."""
    if rtype in ("longrope", "su", "yarn"):
        raise UnsupportedArchitectureError(
            f"Phi-3 rope scaling {rtype!r} (LongRoPE, the 128k-context variants) is not supported; the 4k-context "
            "Phi-3 models (rope_scaling null) run")
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor {partial} is not supported (RoPE over every head dimension only, factor 1.0)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {cfg['hidden_act']!r} is not supported; Phi-3 uses silu")


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Gemma 3's default layer kinds: every ``pattern``-th layer (1-based) is global, the rest slide
    (transformers' Gemma3TextConfig ``sliding_window_pattern`` 6)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 fields of a ``config.json`` (names as transformers' Gemma3TextConfig; a ``Gemma3Config`` with a
    vision tower is not handled: pass its ``text_config``).  Raises UnsupportedArchitectureError for attention
    logit soft-capping (Gemma 2; None in Gemma 3), bidirectional attention or another activation."""
    if cfg.get("attn_logit_softcapping"):
        raise UnsupportedArchitectureError("attn_logit_softcapping is not supported (Gemma 3 configs set None)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError("use_bidirectional_attention is not supported (a causal decoder only)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedArchitectureError(f"hidden_activation {act!r} is not supported; Gemma 3 uses gelu_pytorch_tanh")
    n = int(cfg["num_hidden_layers"])
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    for kind in (full, local):
        if kind.get("rope_type", "default") not in ("default", None):
            raise UnsupportedArchitectureError(f"Gemma 3 rope scaling {kind.get('rope_type')!r} is not supported")
    if cfg.get("rope_scaling"):
        raise UnsupportedArchitectureError("Gemma 3 rope_scaling is not supported (the 270M/1B text models have none)")
    return dict(
        layer_types=list(cfg.get("layer_types") or gemma3_layer_types(n, int(cfg.get("sliding_window_pattern", 6)))),
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        rope_scaling=None,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id", 2),
    )


def _qwen3_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mixture-of-experts fields of a Qwen3-MoE ``config.json`` (names as transformers' Qwen3MoeConfig, which
    writes ``num_experts`` as ``num_local_experts``): softmax top-k router, no shared experts.  Raises
    UnsupportedArchitectureError for another activation and ModelFormatError for a missing expert count."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts:
        raise ModelFormatError("config.json of a qwen3_moe model lacks num_experts (or num_local_experts)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {cfg['hidden_act']!r} is not supported; Qwen3-MoE uses silu")
    return dict(
        n_routed_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
    )


def _deepseek_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """MLA and MoE fields of a DeepSeek V2/V3 ``config.json`` (names as transformers' DeepseekV2/V3Config)."""
    q_lora = cfg.get("q_lora_rank")
    v3 = arch == "deepseek_v3"
    out = dict(
        kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(q_lora) if q_lora else None,
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]), head_dim=int(cfg["qk_rope_head_dim"]),
        rope_layout=("interleave" if cfg.get("rope_interleave", True) else "half") if v3 else "complex",
        attention_bias=bool(cfg.get("attention_bias", False)),
        n_routed_experts=int(cfg.get("n_routed_experts") or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        router="sigmoid" if v3 else "softmax", topk_method=str(cfg.get("topk_method") or "greedy"),
        n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) and v3,  # transformers' V2 router never normalizes
    )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {cfg['hidden_act']!r} is not supported; DeepSeek uses silu")
    return out
