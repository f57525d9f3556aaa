"""The SwiGLU feed-forward block shared by the Llama family, Gemma 3 (its own activation) and DeepSeek's dense
layers and experts."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..model_config import ModelConfig
from .linear import Linear


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer, 2020) with one fused gate/up projection."""

    kernels = None  # see LlamaForCausalLM.use_cpu_kernels

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        self.inter = inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x):
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)
