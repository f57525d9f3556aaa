"""The float linear layer of every family: ``nn.Linear`` with a BLAS layout chosen by the number of rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` that picks the fastest CPU BLAS layout for the number of rows.

    x: (M, in) -> (M, out).  On the 2-core EPYC CI machine with MKL, a one- or
    two-row product streams the weight about 30% faster as ``x @ W^T`` with
    ``W^T`` (in, out) contiguous than as ``F.linear`` (measured in
    ``benchmarks/models/engine_bench.py``'s roofline section), and 9..48 rows run
    faster as ``(W @ x^T)^T``.  ``add_transposed_copy()`` keeps that extra
    ``W^T`` copy (doubling this layer's weight memory); without it the module
    is a plain ``nn.Linear``.
    """

    transposed: torch.Tensor | None = None

    def add_transposed_copy(self) -> None:
        self.transposed = self.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.transposed is not None:
            if m <= 2:
                y = torch.mm(x, self.transposed)
                return y if self.bias is None else y + self.bias
            if 9 <= m <= 48:
                y = torch.mm(self.weight, x.t()).t().contiguous()
                return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
