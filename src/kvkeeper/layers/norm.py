"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 like transformers; the C++ kernel when the model's
weights are packed (``kernels`` set by ``LlamaForCausalLM.use_cpu_kernels``).  x: (..., dim) -> same shape."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), computed in float32 like transformers."""

    kernels = None  # the C++ kernels module when the model's weights are packed (see use_cpu_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rmsnorm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
