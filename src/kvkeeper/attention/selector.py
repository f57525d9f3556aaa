"""Which attention path computes a step: the dispatch between the PyTorch reference and the kernels.

Imports flow one way: this module imports the reference (:mod:`kvkeeper.attention.reference`) and the CPU
kernel wrapper (:mod:`kvkeeper.attention.cpu`) at the top and the Triton kernels
(:mod:`kvkeeper.attention.triton_backend`, CUDA or Triton's interpreter) lazily, since triton is optional;
none of them imports this module.  Backends, named in ``AttentionMetadata.backend``:

* ``torch``: :func:`kvkeeper.attention.reference.paged_attention` as is (gathers each decode sequence's blocks).
* ``cpu``: the C++ kernels, which read the blocks in place, for prefill spans and decode tokens
  (:mod:`kvkeeper.attention.cpu`; attention statistics for KV compression are observed as the reference
  observes them).
* ``triton``: the Triton kernels for everything (a step whose prefill collects attention statistics for KV
  compression runs the reference instead: the kernels do not produce them).
"""

from __future__ import annotations

import torch

from ..kvcache.formats.base import PagedKV
from . import reference as attention, cpu as cpu_attention
from ..kernels import cpu as cpu_kernels
from .metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "cpu", "triton")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """The step's attention by ``meta.backend``; same shapes and contract as the reference
    :func:`kvkeeper.attention.reference.paged_attention` (q (T, H, D), k and v (T, KVH, D) -> (T, H, D))."""
    backend = meta.backend
    if (meta.window is not None or cache.fmt.kivi) and backend == "triton":  # no window, no KIVI in Triton
        backend = "torch"
    if backend == "cpu":
        return cpu_attention.paged_attention(q, k, v, cache, meta, scale)
    if backend == "triton" and not any(p.observer is not None for p in meta.prefills):
        from .triton_backend import triton_paged_attention  # CUDA (or Triton's interpreter) only

        return triton_paged_attention(q, k, v, cache, meta, scale)
    return attention.paged_attention(q, k, v, cache, meta, scale)


def triton_available() -> bool:
    """True when ``triton`` imports (it is optional: the CPU path never needs it)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """"auto", "torch", "cpu" or "triton" -> the backend to run.

    auto: triton on CUDA when it imports; on CPU, cpu when the C++ kernels load (else torch).
    Raises ValueError for another name, for "triton" when triton does not import, and for "cpu" on a
    non-CPU device or when the kernels are not built (the message says how to build them).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if device.type == "cpu" and cpu_kernels.available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package: pip install triton")
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPU tensors, not {device.type}")
        if not cpu_kernels.available():
            raise ValueError(f"attention backend 'cpu' needs the C++ kernels ({cpu_kernels.unavailable_reason()})")
    return name
