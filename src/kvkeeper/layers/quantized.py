"""Packed (block-quantized) weights and the layers that compute on them with the C++ kernel.

A :class:`PackedWeight` holds a (N, K) matrix as blocks of 32 (w = d * u + m) interleaved 16 rows at a time;
:class:`QuantLinear` and :class:`QuantEmbedding` run it (activations rounded to int8 per row and block of 32
inside the kernel, llama.cpp's Q8_1).  Which formats exist and how a model file's tensors become packed
weights is :mod:`kvkeeper.weights.formats`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu as cpu_kernels


QK = 32  # weights per block


ROWS = 16  # output rows per interleaved group


@dataclass
class PackedWeight:
    """A (N, K) weight as blocks of 32 with w = d * u + m, interleaved 16 rows at a time.

    qs: (G, K/32, 256) uint8 for 4-bit codes or (G, K/32, 512) for 8-bit codes, G = ceil(N / 16): byte
    ``64*s + 4*i + c`` of a 4-bit block holds u(row i, 4s + c) in its low nibble and u(row i, 16 + 4s + c)
    in its high nibble (s < 4); of an 8-bit block, byte ``64*j + 4*i + c`` holds u(row i, 4j + c) (j < 8).
    sc: (G, K/32, 2, 16) float16, the 16 rows' d then m.  Padding rows (N..16G) are zero.
    kind: where the blocks came from (Q4_1, Q8_0, int4, ...), for reports.
    """

    qs: torch.Tensor
    sc: torch.Tensor
    bits: int
    n: int
    k: int
    kind: str

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.sc.nbytes

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 (N, K): d * u + m computed in float32 (exactly the values the file encodes)."""
        u = unpack_codes(self)  # (N, K) int32
        d = self.sc[:, :, 0, :].permute(0, 2, 1).reshape(-1, self.k // QK)[: self.n].float()
        m = self.sc[:, :, 1, :].permute(0, 2, 1).reshape(-1, self.k // QK)[: self.n].float()
        w = u.view(self.n, -1, QK).float() * d[:, :, None] + m[:, :, None]
        return w.view(self.n, self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (T,) int64 dequantized to float32 (T, K) (the embedding lookup)."""
        g, i = ids // ROWS, ids % ROWS
        nb = self.k // QK
        if self.bits == 8:
            u = self.qs.view(-1, nb, 8, ROWS, 4)[g, :, :, i, :].reshape(-1, nb, QK).int()
        else:
            b = self.qs.view(-1, nb, 4, ROWS, 4)[g, :, :, i, :].reshape(-1, nb, 16).int()
            u = torch.cat([b & 0x0F, b >> 4], dim=-1)
        sc = self.sc[g, :, :, i].float()  # (T, nb, 2)
        return (u.float() * sc[:, :, 0:1] + sc[:, :, 1:2]).reshape(-1, self.k)


def pack_blocks(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, kind: str) -> PackedWeight:
    """Interleave codes u (N, K) integer in [0, 2**bits), d and m (N, K/32) float16 into a :class:`PackedWeight`.

    Raises ValueError when K is not a multiple of 32, a code is out of range or the scales' shape differs.
    """
    n, k = u.shape
    if k % QK:
        raise ValueError(f"input dimension {k} is not a multiple of {QK}")
    if d.shape != (n, k // QK) or m.shape != (n, k // QK):
        raise ValueError(f"scales must be ({n}, {k // QK}), got {tuple(d.shape)} and {tuple(m.shape)}")
    if int(u.min()) < 0 or int(u.max()) >= 1 << bits:
        raise ValueError(f"codes outside [0, {1 << bits})")
    g = -(-n // ROWS)
    pad = g * ROWS - n
    u = F.pad(u.to(torch.uint8), (0, 0, 0, pad))
    d = F.pad(d.to(torch.float16), (0, 0, 0, pad))
    m = F.pad(m.to(torch.float16), (0, 0, 0, pad))
    nb = k // QK
    ub = u.view(g, ROWS, nb, QK).permute(0, 2, 1, 3)  # (G, nb, 16 rows, 32)
    if bits == 8:
        qs = ub.reshape(g, nb, ROWS, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, nb, 512)
    elif bits == 4:
        lo = ub[..., :16].reshape(g, nb, ROWS, 4, 4).permute(0, 1, 3, 2, 4).reshape(g, nb, 256)
        hi = ub[..., 16:].reshape(g, nb, ROWS, 4, 4).permute(0, 1, 3, 2, 4).reshape(g, nb, 256)
        qs = lo | (hi << 4)
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    sc = torch.stack([d.view(g, ROWS, nb).permute(0, 2, 1), m.view(g, ROWS, nb).permute(0, 2, 1)], dim=2)
    return PackedWeight(qs.contiguous(), sc.contiguous(), bits, n, k, kind)


def unpack_codes(pw: PackedWeight) -> torch.Tensor:
    """The codes u (N, K) int32 of a :class:`PackedWeight` (inverse of :func:`pack_blocks`)."""
    g, nb = pw.qs.shape[:2]
    if pw.bits == 8:
        u = pw.qs.view(g, nb, 8, ROWS, 4).permute(0, 3, 1, 2, 4).reshape(g * ROWS, pw.k)
    else:
        q = pw.qs.view(g, nb, 4, ROWS, 4).permute(0, 3, 1, 2, 4).reshape(g * ROWS, nb, 16)
        u = torch.cat([q & 0x0F, q >> 4], dim=-1).reshape(g * ROWS, pw.k)
    return u[: pw.n].int()


def pack_numpy(u: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int, kind: str) -> PackedWeight:
    return pack_blocks(torch.from_numpy(np.ascontiguousarray(u)), torch.from_numpy(np.ascontiguousarray(d)),
                       torch.from_numpy(np.ascontiguousarray(m)), bits, kind)


def qmm(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x (..., K) float32 @ W^T -> (..., N) float32 with the C++ kernel (activations rounded to int8 per 32)."""
    mod = cpu_kernels.load()
    if mod is None:
        raise RuntimeError(f"the CPU kernels are unavailable ({cpu_kernels.unavailable_reason()})")
    x2 = x.reshape(-1, pw.k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    y = mod.qmm(x2, pw.qs, pw.sc, pw.bits, pw.n)
    return y.view(*x.shape[:-1], pw.n)


class QuantLinear(nn.Module):
    """A linear layer over a :class:`PackedWeight`: x (M, K) float32 -> (M, N) float32 (plus the bias)."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.k, packed.n
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._kernels = cpu_kernels.load()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pw = self.packed
        y = self._kernels.qmm(x if x.dtype == torch.float32 else x.float(), pw.qs, pw.sc, pw.bits, pw.n)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.packed.kind} ({self.packed.bits}-bit codes)"


class QuantEmbedding(nn.Module):
    """Token embedding over a :class:`PackedWeight` (rows dequantized on lookup); ``packed`` also serves as
    the tied LM head."""

    def __init__(self, packed: PackedWeight):
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.n, packed.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed.rows(ids.reshape(-1)).view(*ids.shape, self.packed.k)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by storage: packed blocks (codes plus scales) and plain tensors."""
    packed = plain = 0
    seen = set()
    for mod in model.modules():
        pw = getattr(mod, "packed", None)
        if isinstance(pw, PackedWeight) and id(pw) not in seen:
            seen.add(id(pw))
            packed += pw.nbytes
    for p in model.parameters():
        plain += p.numel() * p.element_size()
    return {"packed": packed, "plain": plain, "total": packed + plain}
