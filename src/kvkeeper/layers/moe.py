"""Mixture-of-experts feed-forward (DeepSeek V2/V3, Qwen3-MoE): routed experts computed grouped, plus shared experts.

Routers (as transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter / Qwen3MoeTopKRouter compute them):

* softmax (DeepSeek-V2, arXiv:2405.04434; Qwen3-MoE): softmax scores; ``topk_method`` "greedy" (top-k of all
  experts) or "group_limited_greedy" (keep the ``topk_group`` groups with the highest expert score, then top-k
  inside them); weights renormalized to sum 1 when ``norm_topk_prob`` (Qwen3-MoE; the DeepSeek-V2 config
  never sets it, as transformers' V2 router never renormalizes), times ``routed_scaling_factor``.
* V3 (DeepSeek-V3, arXiv:2412.19437): sigmoid scores; the choice adds ``e_score_correction_bias``; groups ranked
  by the sum of their two best biased scores, top ``topk_group`` kept, top-k inside; weights are the unbiased
  scores, normalized to sum 1 when ``norm_topk_prob``, times ``routed_scaling_factor``.

Experts are computed grouped: the (token, expert) assignments are sorted by expert, and each expert with
tokens runs one batched SwiGLU over its contiguous slice (one matrix product per expert present, not one
call per token); results are scaled by the routing weights and summed back with ``index_add_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model_config import ModelConfig
from .mlp import MLP


class Router(nn.Module):
    """x (T, hidden) -> (weights (T, k) float32, expert ids (T, k) int64).  ``weight`` (E, hidden); V3 also
    ``e_score_correction_bias`` (E,)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.E, self.k, self.kind = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.router
        self.groups, self.topk_group, self.method = cfg.n_group, cfg.topk_group, cfg.topk_method
        self.norm, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.E, cfg.hidden_size))
        if self.kind == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.E))

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """group_scores (T, G) -> (T, E) bool, True for the experts of each token's ``topk_group`` best groups."""
        idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, idx, True)
        return mask.unsqueeze(-1).expand(-1, self.groups, self.E // self.groups).reshape(-1, self.E)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        T = logits.shape[0]
        if self.kind == "softmax":
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                group = scores.view(T, self.groups, -1).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(group), 0.0)
            w, idx = torch.topk(scores, k=self.k, dim=-1, sorted=False)
            if self.norm:
                w = w / w.sum(dim=-1, keepdim=True)
            return w * self.scaling, idx
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        group = choice.view(T, self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._group_mask(group), float("-inf"))
        idx = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


class Experts(nn.Module):
    """Routed experts stored stacked: ``gate_up_proj`` (E, 2 * inter, hidden), ``down_proj`` (E, hidden, inter)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, inter, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.inter = inter
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.zeros(E, h, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), weights (T, k), idx (T, k) -> (T, hidden): sum over each token's k experts."""
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        xs = x.index_select(0, tokens)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(xs[start:start + n], self.gate_up_proj[e]).split([self.inter, self.inter], dim=-1)
                ys[start:start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
                start += n
        ys *= weights.reshape(-1).index_select(0, order).unsqueeze(1).to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, ys)


def stack_experts(state: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """Stack one MoE layer's expert tensors into :class:`Experts`' (``{prefix}experts.gate_up_proj`` (E, 2 * inter,
    hidden), ``{prefix}experts.down_proj`` (E, hidden, inter)), in ``state`` in place.

    Reads transformers' per-expert names (``{prefix}experts.{e}.{gate,up,down}_proj.weight``, each (inter, hidden)
    or (hidden, inter)) or llama.cpp's stacked ones as the GGUF loader names them
    (``{prefix}experts.{gate,up,down}_proj.weight``, (E, inter, hidden) / (E, hidden, inter)).  Does nothing
    when the layer is already stacked or a part is missing (``take_parameters`` then names what is missing)."""
    ex = f"{prefix}experts."
    if f"{ex}gate_up_proj" in state:
        return
    stacked = [f"{ex}{p}_proj.weight" for p in ("gate", "up", "down")]
    if all(n in state for n in stacked):
        gate, up, down = (state.pop(n) for n in stacked)
        state[f"{ex}gate_up_proj"], state[f"{ex}down_proj"] = torch.cat([gate, up], dim=1), down
        return
    names = [[f"{ex}{e}.{p}_proj.weight" for p in ("gate", "up", "down")] for e in range(num_experts)]
    if not all(n in state for parts in names for n in parts):
        return
    gate_up = [torch.cat([state.pop(g), state.pop(u)], dim=0) for g, u, _ in names]
    state[f"{ex}gate_up_proj"] = torch.stack(gate_up)
    state[f"{ex}down_proj"] = torch.stack([state.pop(d) for _, _, d in names])


class MoE(nn.Module):
    """Routed experts plus ``n_shared_experts`` shared ones (one SwiGLU of n_shared x moe_intermediate_size)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        out = self.experts(x, weights, idx)
        return out if self.shared_experts is None else out + self.shared_experts(x)
