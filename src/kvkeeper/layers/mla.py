"""Multi-head Latent Attention (DeepSeek-V2, DeepSeek-AI 2024, arXiv:2405.04434) on a paged latent cache.

Per token and layer the cache holds one *latent row* of ``kv_lora_rank + qk_rope_head_dim`` values: the
RMS-normalized compressed KV ``c`` followed by the rotated decoupled RoPE key ``k_pe`` (what transformers'
DeepseekV2/V3 caches hold, ``kv_nope`` and ``k_rot``).  It lives in a :class:`~kvkeeper.kvcache.formats.base.PagedKV`
with one head and no V part (``values=False``), so the block pool, block tables and prefix cache are the
standard ones.

Two ways to attend, for ``H`` heads, ``kv_b_proj`` weight ``W`` viewed as ``(H, nope + v, R)`` with
``W_uk = W[:, :nope]`` and ``W_uv = W[:, nope:]``:

* expanded (prefill and prefill chunks, as transformers does): ``K = [c W_uk^T, k_pe]`` and ``V = c W_uv^T``
  per head, then ordinary causal attention;
* absorbed (decode, the default): the key up-projection is folded into the query, ``q_lat = q_nope W_uk``
  (H, R), so ``score = [q_lat, q_pe] . row`` over the raw latent rows (one shared "head", as multi-query
  attention) and ``o = (softmax . c) W_uv^T``: the cache is read once for all heads and never expanded (the
  absorption of the paper's section 2.1.3; vLLM and SGLang decode the same way).

All of it is plain PyTorch (any device); the C++ and Triton attention kernels are for standard K/V caches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kvcache.formats.base import PagedKV
from ..attention.metadata import AttentionMetadata
from ..model_config import ModelConfig
from .linear import Linear
from .norm import RMSNorm
from .rope import apply_rope_pairs

DECODE_MODES = ("absorbed", "expanded")


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's attention-scale
    correction; transformers' ``yarn_apply_mscale``)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    sc = cfg.rope_scaling or {}
    m_all = sc.get("mscale_all_dim") or 0
    if sc.get("rope_type", "default") != "default" and m_all and float(sc["factor"]) > 1:
        m = 0.1 * float(m_all) * math.log(float(sc["factor"])) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    """One MLA layer: x (T, hidden) -> (T, hidden), writing each token's latent row into its cache slot.

    Weights carry transformers' names (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``).  ``decode_mode`` is "absorbed"
    (default) or "expanded" (the reference the absorbed form is tested and measured against).
    """

    decode_mode = "absorbed"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.H, self.R = cfg.num_heads, cfg.kv_lora_rank
        self.nope, self.rope_dim, self.vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.layout = cfg.rope_layout
        qk = self.nope + self.rope_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers: the default eps, not the config's
            self.q_b_proj = Linear(cfg.q_lora_rank, self.H * qk, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, self.H * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.R + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.R, 1e-6)
        self.kv_b_proj = Linear(self.R, self.H * (self.nope + self.vdim), bias=False)
        self.o_proj = Linear(self.H * self.vdim, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = mla_softmax_scale(cfg)

    def forward(self, x: torch.Tensor, cos_sin, kv_cache: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, self.H, -1).split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.R, self.rope_dim], dim=-1)
        q_pe = apply_rope_pairs(q_pe, *cos_sin, self.layout)
        k_pe = apply_rope_pairs(k_pe.unsqueeze(1), *cos_sin, self.layout)[:, 0]
        rows = torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)  # (T, R + rope): the cached latent rows
        o = latent_attention(self, q_nope, q_pe, rows, kv_cache, meta)
        return self.o_proj(o.reshape(T, -1))

    # ---- the two forms ------------------------------------------------------------------------
    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk (H, nope, R), W_uv (H, v, R)): views of ``kv_b_proj.weight``."""
        w = self.kv_b_proj.weight.view(self.H, self.nope + self.vdim, self.R)
        return w[:, : self.nope], w[:, self.nope:]

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows (..., L, R + rope) -> K (..., H, L, nope + rope) and V (..., H, L, v)."""
        c, k_pe = rows.split([self.R, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c.reshape(-1, self.R)).view(*c.shape[:-1], self.H, self.nope + self.vdim)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(-2).expand(*k_pe.shape[:-1], self.H, self.rope_dim)], dim=-1)
        return k.transpose(-3, -2), v.transpose(-3, -2)

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """q_nope (B, H, nope), q_pe (B, H, rope) -> (B, H, R + rope): the query against raw latent rows."""
        w_uk, _ = self.up_weights()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (B, H, R)
        return torch.cat([q_lat, q_pe], dim=-1)

    def unabsorb_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat (B, H, R), attention-weighted latents -> (B, H, v) per-head values."""
        _, w_uv = self.up_weights()
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def latent_attention(attn: MLAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                     cache: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
    """Causal MLA of the step's tokens over their sequences' cached plus new latent rows.

    q_nope (T, H, nope), q_pe (T, H, rope) (rotated), rows (T, R + rope) are written into the cache first.
    Returns (T, H, v).  Prefill spans run expanded; decode tokens run ``attn.decode_mode``.  As in
    :func:`kvkeeper.attention.reference.paged_attention`, a quantized cache is attended to as it holds the rows.
    Raises ValueError for a prefill that collects attention statistics (KV compression is refused for MLA).
    """
    cache.write_latent(rows, meta.slot_mapping)
    decode = decode_absorbed if attn.decode_mode == "absorbed" else decode_expanded
    if meta.decode_only:
        return decode(attn, q_nope, q_pe, cache, meta)
    out = q_nope.new_empty(q_nope.shape[0], attn.H, attn.vdim)
    for p in meta.prefills:
        if p.observer is not None:
            raise ValueError("KV compression needs per-head keys; an MLA model caches one latent row per token")
        sl = slice(p.start, p.start + p.q_len)
        if p.context_len == p.q_len and not cache.fmt.quantized:
            lat = rows[sl]
        else:
            lat = cache.gather_keys(p.block_table, p.context_len, q_nope.dtype)[:, 0]
        k, v = attn.expand(lat)  # (H, L, nope + rope), (H, L, v)
        q = torch.cat([q_nope[sl], q_pe[sl]], dim=-1).transpose(0, 1)  # (H, q, nope + rope)
        qpos = torch.arange(p.q_len, device=q.device)[:, None] + (p.context_len - p.q_len)
        mask = torch.arange(p.context_len, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)
        out[sl] = o.transpose(0, 1)
    if meta.decode_indices is not None and meta.decode_indices.numel():
        i = meta.decode_indices
        out.index_copy_(0, i, decode(attn, q_nope.index_select(0, i), q_pe.index_select(0, i), cache, meta))
    return out


def decode_absorbed(attn: MLAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedKV,
                    meta: AttentionMetadata) -> torch.Tensor:
    """One token per decode sequence in the absorbed form: q_nope (B, H, nope), q_pe (B, H, rope) -> (B, H, v).

    The H heads are the query rows of one attention over the raw latent rows (B, 1, L, R + rope), whose first R
    values serve as the values: the cache is gathered once and never expanded per head."""
    q = attn.absorb_query(q_nope, q_pe).unsqueeze(1)  # (B, 1, H, R + rope)
    lat = cache.gather_keys_padded(meta.decode_block_tables, q.dtype)  # (B, 1, L, R + rope)
    o = F.scaled_dot_product_attention(q, lat, lat[..., : attn.R], attn_mask=meta.get_decode_mask(cache.block_size),
                                       scale=attn.scale)  # (B, 1, H, R)
    return attn.unabsorb_output(o[:, 0])


def decode_expanded(attn: MLAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedKV,
                    meta: AttentionMetadata) -> torch.Tensor:
    """The same result as :func:`decode_absorbed` by expanding every cached row to per-head K and V (the form
    transformers computes; the reference the absorbed form is tested against)."""
    lat = cache.gather_keys_padded(meta.decode_block_tables, q_nope.dtype)[:, 0]  # (B, L, R + rope)
    k, v = attn.expand(lat)  # (B, H, L, nope + rope), (B, H, L, v)
    q = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(2)  # (B, H, 1, nope + rope)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.get_decode_mask(cache.block_size), scale=attn.scale)
    return o[:, :, 0]
