"""Model configuration: the hyper-parameters of a Llama-family decoder.

Read from a Hugging Face ``config.json`` or from GGUF metadata; both end up as
one :class:`ModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelFormatError, UnsupportedArchitectureError

# model_type (HF) / general.architecture (GGUF) values we implement.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_HF_ARCH_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Mistral)."""

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
    sliding_window: int | None = None  # Mistral; we cap the context at it
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    revision: str = ""  # identifies the weights; part of every KV cache namespace

    @property
    def context_length(self) -> int:
        """Tokens a sequence may hold (prompt plus output)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K plus V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @staticmethod
    def check_architecture(name: str) -> str:
        arch = _HF_ARCH_NAMES.get(name, name).lower()
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
                "(Llama 2/3, SmolLM2, Qwen2/2.5, Mistral)"
            )
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
            scaling = None if rtype == "default" else {**rope, "rope_type": rtype}
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedArchitectureError(
                    f"rope scaling type {rtype!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(x) for x in eos])
            sliding = cfg.get("sliding_window")
            if arch == "qwen2" and not cfg.get("use_sliding_window", False):
                sliding = None
            return cls(
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
        except KeyError as e:
            raise ModelFormatError(f"config.json lacks the required key {e.args[0]!r}") from e
