"""Layers that compute on a GGUF file's own weight blocks (K-quants, Q8_0, F16, ...), mapped, never copied.

A :class:`GGUFWeight` is one (N, K) matrix as the file stores it: a (N, row bytes) uint8 tensor over the
file's memory map (``torch.from_numpy`` on ``gguf.GGUFReader``'s memmap: no copy, pages are read on use),
its ggml type and shape, and optionally ``out_perm``, a permutation of its output columns (llama.cpp's
converter permutes the q/k rows of llama models for RoPE; :func:`rope_out_perm` undoes it on the (M, N)
result instead of copying weight rows).  :class:`GGUFLinear` runs one or several of them (a fused q/k/v or
gate/up projection stays separate tensors: the outputs are concatenated) and :class:`GGUFEmbedding` looks rows
up (and serves as a tied LM head).

The products go to the C++ kernels' ``kq_matmul`` / ``kq_dequantize_rows`` (:mod:`kvkeeper.kernels.cpu`) when
the loaded module has them and they cover the type (:data:`KERNEL_TYPES`); otherwise to
:func:`reference_kq_matmul` / :func:`reference_kq_dequantize_rows`, the PyTorch reference of the same
signature (``gguf.quants.dequantize`` of the rows, then a float32 matmul: exact and slow -- the whole matrix
is dequantized on every call, then dropped).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu as cpu_kernels

KERNEL_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0"})  # what kq_matmul runs (csrc/cpu/kquant.cpp)


def _type_name(ggml_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(int(ggml_type)).name


def _as_numpy(w: torch.Tensor) -> np.ndarray:
    return w.numpy() if w.device.type == "cpu" else w.cpu().numpy()


def reference_kq_dequantize_rows(w: torch.Tensor, ggml_type: int, n: int, k: int,
                                  row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``row_ids`` (T,) int64 (None: all N) of a GGUF matrix ``w`` ((N, row bytes) uint8; F16/F32: (N, K)) as
    float32 (T, K), with ``gguf.quants.dequantize`` (the PyTorch/numpy reference of the kernels'
    ``kq_dequantize_rows``, same arguments).  Raises IndexError for a row id outside [0, N)."""
    import gguf

    ids = torch.arange(n) if row_ids is None else row_ids.reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"row ids must lie in [0, {n}), got {int(ids.min())}..{int(ids.max())}")
    raw = _as_numpy(w)[ids.numpy()]
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(ggml_type)))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(-1, k)


def reference_kq_matmul(x: torch.Tensor, w: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
    """x (M, K) float32 @ dequantize(w)^T -> (M, N) float32: the reference of the kernels' ``kq_matmul`` (the whole
    matrix dequantized with ``gguf.quants.dequantize`` for this call, then ``F.linear``).  Raises ValueError for
    an x whose last dimension is not K."""
    import gguf

    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight has K={k}")
    wf = gguf.quants.dequantize(_as_numpy(w), gguf.GGMLQuantizationType(int(ggml_type)))
    wf = torch.from_numpy(np.ascontiguousarray(wf, dtype=np.float32)).view(n, k)
    return F.linear(x.float(), wf)


def kernel_ops(type_name: str) -> tuple[Callable, Callable, bool]:
    """(matmul, dequantize_rows, from the C++ kernels?) for a ggml type: the kernels' ``kq_matmul`` /
    ``kq_dequantize_rows`` when the loaded module has them and the type is in :data:`KERNEL_TYPES` (or in the
    module's own ``kq_types``, if it lists them), else the PyTorch reference."""
    mod = cpu_kernels.load()
    if mod is not None and hasattr(mod, "kq_matmul") and hasattr(mod, "kq_dequantize_rows"):
        types = set(getattr(mod, "kq_types", KERNEL_TYPES))
        if type_name in types:
            return mod.kq_matmul, mod.kq_dequantize_rows, True
    return reference_kq_matmul, reference_kq_dequantize_rows, False


def rope_out_perm(n: int, n_head: int) -> torch.Tensor:
    """(n,) int64: output column r of the Hugging Face layout is column perm[r] of a llama GGUF's q/k matrix
    (the index form of :func:`kvkeeper.weights.loader._unpermute_rope`: w_hf = w_gguf[perm])."""
    idx = np.arange(n).reshape(n_head, n // n_head // 2, 2).swapaxes(1, 2).reshape(n)
    return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))


@dataclass
class GGUFWeight:
    """One (N, K) matrix of a GGUF file, in place.

    data: (N, row bytes) uint8 (block types) or (N, K) float16 / float32, usually a read-only view of the file's
    memory map.  ggml_type: the ``gguf.GGMLQuantizationType`` value.  out_perm: None or (N,) int64, applied to
    the product's columns (y[:, r] = (x @ W^T)[:, out_perm[r]]).
    """

    data: torch.Tensor
    ggml_type: int
    n: int
    k: int
    out_perm: torch.Tensor | None = None

    @classmethod
    def from_reader_tensor(cls, t, out_perm: torch.Tensor | None = None) -> "GGUFWeight":
        """From a ``gguf.GGUFReader`` tensor (its memmap, wrapped without a copy)."""
        with warnings.catch_warnings():  # read-only memmap: torch warns that it cannot write to it (we never do)
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(t.data)
        return cls(data, int(t.tensor_type), int(t.shape[1]), int(t.shape[0]), out_perm)

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def dequantize(self) -> torch.Tensor:
        """The matrix as float32 (N, K) in output order (out_perm applied to the rows): tests and fallbacks."""
        w = reference_kq_dequantize_rows(self.data, self.ggml_type, self.n, self.k)
        return w if self.out_perm is None else w[self.out_perm]


class GGUFLinear(nn.Module):
    """x (..., K) float32 -> (..., N) float32 over GGUF weight blocks in place (plus the bias).

    ``GGUFLinear(weight_bytes_view, ggml_type, n, k, bias=None, out_perm=None)`` for one matrix;
    :meth:`fused` for several with the same K (a fused projection: outputs concatenated in order).
    bias: None or (N total,) float.  Raises ValueError when the parts' K differ or the bias length is wrong.
    """

    def __init__(self, weight_bytes_view: torch.Tensor, ggml_type: int, n: int, k: int,
                 bias: torch.Tensor | None = None, out_perm: torch.Tensor | None = None):
        super().__init__()
        self._setup([GGUFWeight(weight_bytes_view, int(ggml_type), int(n), int(k), out_perm)], bias)

    @classmethod
    def fused(cls, parts: Sequence[GGUFWeight], bias: torch.Tensor | None = None) -> "GGUFLinear":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(list(parts), bias)
        return self

    def _setup(self, parts: list[GGUFWeight], bias) -> None:
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError(f"a GGUFLinear needs one or more weights of the same K, got K={[p.k for p in parts]}")
        self.parts = parts
        self.in_features, self.out_features = parts[0].k, sum(p.n for p in parts)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias must be ({self.out_features},), got {tuple(bias.shape)}")
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._ops = [kernel_ops(p.type_name) for p in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        x2 = (x2 if x2.dtype == torch.float32 else x2.float()).contiguous()
        ys = []
        for p, (mm, _, _) in zip(self.parts, self._ops):
            y = mm(x2, p.data, p.ggml_type, p.n, p.k)
            ys.append(y if p.out_perm is None else y.index_select(1, p.out_perm))
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    gguf_logits = forward  # as an (untied) LM head

    @property
    def on_kernels(self) -> bool:
        """Whether every part is computed by the C++ kernels (not the PyTorch reference)."""
        return all(from_kernels for _mm, _rows, from_kernels in self._ops)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        kinds = "+".join(p.type_name for p in self.parts)
        where = "kernel" if all(o[2] for o in self._ops) else "reference"
        return f"in={self.in_features}, out={self.out_features}, {kinds} in place ({where})"


class GGUFEmbedding(nn.Module):
    """Token embedding over a :class:`GGUFWeight` (rows dequantized on lookup): ids (...) int64 -> (..., K)
    float32; :meth:`gguf_logits` uses it as a tied LM head (h (M, K) -> (M, N) float32)."""

    def __init__(self, weight: GGUFWeight):
        super().__init__()
        self.weight_gguf = weight
        self.num_embeddings, self.embedding_dim = weight.n, weight.k
        self._mm, self._rows, self._kernel = kernel_ops(weight.type_name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_gguf
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.n):
            raise IndexError(f"token ids must lie in [0, {w.n}), got {int(flat.min())}..{int(flat.max())}")
        return self._rows(w.data, w.ggml_type, w.n, w.k, flat).view(*ids.shape, w.k)

    def gguf_logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.weight_gguf
        h2 = h.reshape(-1, w.k)
        return self._mm((h2 if h2.dtype == torch.float32 else h2.float()).contiguous(), w.data, w.ggml_type, w.n, w.k)

    @property
    def nbytes(self) -> int:
        return self.weight_gguf.nbytes

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight_gguf.type_name} in place"


def is_gguf_entry(t) -> bool:
    """Whether a state-dict value is a GGUF matrix in place (a :class:`GGUFWeight` or a list of them, fused)."""
    return isinstance(t, GGUFWeight) or (isinstance(t, (list, tuple)) and bool(t) and
                                         all(isinstance(p, GGUFWeight) for p in t))


def gguf_module(entry, embedding: bool, bias: torch.Tensor | None = None) -> nn.Module:
    """The layer for a state-dict entry (:func:`is_gguf_entry`): a :class:`GGUFEmbedding` for the token
    embedding (a single weight), else a :class:`GGUFLinear` over the part(s)."""
    parts = [entry] if isinstance(entry, GGUFWeight) else list(entry)
    if embedding:
        if len(parts) != 1 or bias is not None:
            raise ValueError("a GGUF embedding is one matrix without bias")
        return GGUFEmbedding(parts[0])
    return GGUFLinear.fused(parts, bias)
