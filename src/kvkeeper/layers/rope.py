"""Rotary position embeddings (RoPE) with the scaling variants of Hugging Face configs.

Su et al., "RoFormer" (2021); Llama 3 frequency scaling (Meta, 2024); YaRN
(Peng et al., 2023); linear position interpolation (Chen et al., 2023).  The
half-split layout (dim i pairs with i + head_dim/2) matches Hugging Face.
"""

from __future__ import annotations

import math

import torch

from ..model_config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Return (inverse frequencies, shape (head_dim/2,) float32; attention scaling factor for cos/sin)."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_freq_factors:  # llama.cpp's rope_freqs: theta_i / factor_i, scaling already applied
        return inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32), 1.0
    sc = cfg.rope_scaling or {}
    rtype = sc.get("rope_type", "default")
    if rtype == "default":
        return inv, 1.0
    if rtype == "linear":
        return inv / float(sc["factor"]), 1.0
    if rtype == "llama3":
        factor = float(sc["factor"])
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)  # as transformers
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, out), 1.0
    if rtype == "yarn":
        factor = float(sc["factor"])
        old_ctx = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        beta_fast = float(sc.get("beta_fast") or 32)
        beta_slow = float(sc.get("beta_slow") or 1)

        def get_mscale(scale, m=1.0):
            return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

        mscale = sc.get("attention_factor")
        if mscale is None:  # as transformers: mscale / mscale_all_dim (DeepSeek-style configs) when both given
            m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
            mscale = get_mscale(factor, m) / get_mscale(factor, m_all) if (m and m_all) else get_mscale(factor)

        def corr_dim(rot):
            return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

        low = corr_dim(beta_fast)
        high = corr_dim(beta_slow)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrap_factor = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrap_factor) + (1.0 / pos_freqs) * extrap_factor
        return inv, float(mscale)
    raise ValueError(f"unsupported rope type {rtype!r}")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables (max_positions, head_dim) float32; ``forward(q, k, positions)`` returns rotated copies.

    q: (T, H, D), k: (T, KVH, D), positions: (T,) int64 -> rotated q, k of the same shapes and dtype.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        n = max_positions or cfg.max_position_embeddings
        with torch.device("cpu"):  # a few dozen floats (arithmetic on the meta device imports torch._dynamo: 1.5 s)
            inv, scale = inv_frequencies(cfg)
        if torch.empty(0).device.type == "meta":  # a model built on the meta device: tables of the right shape,
            for name in ("cos", "sin"):  # computed by its build_rope on the real device
                self.register_buffer(name, torch.empty(n, 2 * inv.numel()), persistent=False)
            return
        t = torch.arange(n, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions: each (T, 1, head_dim) in ``dtype``."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, D) by cos/sin (T, 1, D), half-split layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate x (T, heads, D) by cos/sin (T, 1, D) with adjacent dims (2i, 2i+1) paired, as DeepSeek does.

    layout "complex": the output keeps the pairs adjacent (transformers' DeepSeek-V2 ``apply_rotary_emb``);
    "interleave": the output puts the rotated even dims first, then the odd ones (DeepSeek-V3 with
    ``rope_interleave``; both q and k get the same order, so their dot products equal the complex form's);
    "half": the half-split layout of :func:`apply_rope`.
    """
    if layout == "half":
        return apply_rope(x, cos, sin)
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    a, b = x1 * c - x2 * s, x2 * c + x1 * s
    if layout == "complex":
        return torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((a, b), dim=-1)
