"""Weight formats (``--quantization``): which exist, which one a model file gets, and the packed weights.

Formats (named as vLLM's ``--quantization`` option names its methods where one exists):

* ``none``: every weight dequantized to the model dtype at load (float32 on CPU): the exact path and the
  parity reference of the tests.
* ``gguf``: a GGUF file's own Q4_0, Q4_1 and Q8_0 blocks are computed in place by the C++ kernel
  (:mod:`kvkeeper.kernels.cpu`, ``qmm``); every other matrix (K-quants, F16, ...) of a Llama-family file
  stays in the file's memory map and runs as :class:`~kvkeeper.layers.gguf_linear.GGUFLinear` (the kernels'
  ``kq_matmul`` where they have it, else its exact PyTorch reference): no float32 copy, on disk or in memory.  The blocks are repacked at load into an interleaved layout (16 output
  rows per group, :func:`pack_blocks`) without changing a single weight: every block keeps its codes
  and its float16 scale and minimum.  Activations are rounded to int8 per row and block of 32
  (llama.cpp's Q8_1) inside the kernel: that is the only change against ``none``.
* ``int8``: weight-only round-to-nearest int8, symmetric, groups of 32 along the input dimension
  (Q8_0's scheme: scale = max|w| / 127 in float16), from the float32 weights of any model file.
* ``int4``: weight-only round-to-nearest int4, asymmetric, groups of 32 (Q4_1's scheme: scale =
  (max - min) / 15 and the minimum, both float16), from the float32 weights of any model file.

Quantized formats run on CPU with float32 activations only; their matrices are :class:`PackedWeight`
objects and the layers :class:`QuantLinear` / :class:`QuantEmbedding`.  Norms, biases and RoPE stay float32.
The default (:func:`resolve_quantization`) is ``gguf`` for a GGUF file whose projection matrices are all
Q4_0, Q4_1 or Q8_0 (the embedded SmolLM2-135M: Q4_1, embedding and LM head Q8_0; the README gives its
perplexity and greedy agreement against ``none``), else ``none``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import cpu as cpu_kernels
from ..layers.gguf_linear import GGUFWeight, is_gguf_entry, kernel_ops
from ..layers.quantized import QK, PackedWeight, pack_numpy
from ..models.registry import capabilities, causal_lm_class
from ..progress import track
from ..gguf_file import GGUFFile

QUANTIZATION_CHOICES = ("none", "gguf", "int8", "int4")
_ALIASES = {"fp32": "none", "float32": "none", "dequantized": "none"}
GGUF_IN_PLACE = ("Q4_0", "Q4_1", "Q8_0")
_log = logging.getLogger(__name__)


class QuantizationError(ValueError):
    """A ``--quantization`` value this model file, device or dtype cannot run (the message says which can)."""


# ---------------------------------------------------------------------------------------------------
# choosing the format
# ---------------------------------------------------------------------------------------------------
def resolve_quantization(requested: str | None, *, source: str, gguf_types: set[str] | None = None,
                         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         mapped: bool = True) -> str:
    """The weight format to run: ``requested`` checked against the model file, or the default.

    source: "gguf" (a GGUF file; gguf_types: the tensor types of its projection matrices), "hf" (a Hugging
    Face folder) or "dummy" (random weights).  Default (``requested`` None or "auto"): "gguf" for a GGUF
    file whose projection matrices are all Q4_0/Q4_1/Q8_0 (or types the kernels' ``kq_matmul`` runs, once they have
    it: :func:`kvkeeper.layers.gguf_linear.kernel_ops`), on CPU in float32, when the kernels load;
    otherwise "none".  An explicit quantized format whose kernels do not load falls back to "none" with a
    logged warning (the model still runs, at float32 speed).

    Raises :class:`QuantizationError` naming the formats this file supports when ``requested`` is unknown,
    is "gguf" for a file that is not GGUF, or is quantized on a non-CPU device or with a non-float32 dtype.
    """
    dev = torch.device(device)
    supported = supported_formats(source)
    if requested is None or str(requested).lower() == "auto":
        runs = set(GGUF_IN_PLACE)  # + the kq_matmul types when the loader mapped the file's matrices (``mapped``)
        runs |= {t for t in (gguf_types or ()) if mapped and kernel_ops(t)[2]}
        if (source == "gguf" and gguf_types and set(gguf_types) <= runs and dev.type == "cpu"
                and dtype == torch.float32 and cpu_kernels.available()):
            return "gguf"
        return "none"
    name = _ALIASES.get(str(requested).lower(), str(requested).lower())
    if name not in QUANTIZATION_CHOICES:
        raise QuantizationError(f"unknown --quantization {requested!r}; this model file supports "
                                f"{', '.join(supported)} (or auto)")
    if name not in supported:
        kind = {"hf": "a Hugging Face folder", "dummy": "dummy weights"}.get(source, source)
        raise QuantizationError(f"--quantization {name} needs a GGUF file, and this model is {kind}; "
                                f"choose one of {', '.join(supported)}")
    if name != "none":
        if dev.type != "cpu":
            raise QuantizationError(f"--quantization {name} runs on CPU only (its kernels are C++ CPU code); "
                                    f"on {dev.type} use --quantization none")
        if dtype != torch.float32:
            raise QuantizationError(f"--quantization {name} computes with float32 activations; use --dtype float32 "
                                    f"or --quantization none with --dtype {str(dtype).removeprefix('torch.')}")
        if not cpu_kernels.available():
            _log.warning("--quantization %s needs the CPU kernels (%s); running --quantization none instead",
                         name, cpu_kernels.unavailable_reason())
            return "none"
    return name


def may_map_gguf(requested: str | None) -> bool:
    """Whether a ``--quantization`` value can resolve to ``gguf`` (None, auto, gguf): the loader then keeps a GGUF
    file's matrices mapped (:func:`kvkeeper.weights.loader.load_weights` ``in_place``) instead of dequantizing."""
    return requested is None or str(requested).lower() in ("auto", "gguf")


def supported_formats(source: str) -> tuple[str, ...]:
    """The --quantization values a model file of this kind accepts (source: gguf, hf or dummy)."""
    return QUANTIZATION_CHOICES if source == "gguf" else ("none", "int8", "int4")


# ---------------------------------------------------------------------------------------------------
# packed weights
# ---------------------------------------------------------------------------------------------------
def concat_rows(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, str]]):
    """Stack (u, d, m, bits, kind) row blocks of one fused projection; 4-bit codes join an 8-bit group as is."""
    bits = max(p[3] for p in parts)
    kinds = sorted({p[4] for p in parts})
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]), bits, "+".join(kinds))


# ---- from GGUF blocks -----------------------------------------------------------------------------------
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def gguf_blocks(data: np.ndarray, type_name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A GGUF Q4_0 / Q4_1 / Q8_0 tensor's raw bytes -> (u (N, K) uint8, d, m (N, K/32) float16, bits), exact.

    Layouts (ggml-common.h): Q4_0 = fp16 d, 16 bytes of nibbles, w = d (q - 8); Q4_1 = fp16 d, fp16 m,
    16 bytes, w = d q + m; element j < 16 of a block is byte j's low nibble, element 16 + j its high
    nibble.  Q8_0 = fp16 d, 32 int8 q, w = d q, here u = q + 128 and m = -128 d (exact in float16).
    """
    bb = _BLOCK_BYTES[type_name]
    nb = k // QK
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, nb, bb)
    d = raw[:, :, 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        q = raw[:, :, 2:].view(np.int8).astype(np.int16)
        u = (q + 128).astype(np.uint8).reshape(n, k)
        m = (d.astype(np.float32) * -128.0).astype(np.float16)
        if not np.array_equal(m.astype(np.float32), d.astype(np.float32) * -128.0):
            raise ValueError("a Q8_0 scale is too large to fold its offset into a float16 minimum")
        return u, d, m, 8
    if type_name == "Q4_1":
        m = raw[:, :, 2:4].copy().view(np.float16)[..., 0]
        qb = raw[:, :, 4:]
    else:  # Q4_0
        m = (d.astype(np.float32) * -8.0).astype(np.float16)
        qb = raw[:, :, 2:]
    u = np.concatenate([qb & 0x0F, qb >> 4], axis=-1).reshape(n, k)
    return u, d, m, 4


# ---- round-to-nearest from float weights ----------------------------------------------------------------
def quantize_rtn(w: torch.Tensor, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Round-to-nearest weight-only quantization of w (N, K) float in groups of 32 along K.

    fmt "int8": symmetric, d = max|w| / 127 (float16), q = round(w / d) in [-127, 127], stored as u = q + 128
    with m = -128 d (Q8_0's scheme).  fmt "int4": asymmetric, d = (max - min) / 15 and m = min (float16),
    u = round((w - m) / d) in [0, 15] (Q4_1's scheme).  Returns (u, d, m, bits) as for :func:`gguf_blocks`.
    Raises ValueError when K is not a multiple of 32.
    """
    n, k = w.shape
    if k % QK:
        raise ValueError(f"input dimension {k} is not a multiple of {QK}: groups of {QK} cannot tile it")
    wb = w.detach().float().reshape(n, k // QK, QK)
    if fmt == "int8":
        d = (wb.abs().amax(-1) / 127.0).to(torch.float16)
        df = d.float()
        q = torch.where(df[..., None] > 0, wb / df[..., None].clamp_min(1e-30), torch.zeros_like(wb))
        u = (q.round().clamp(-127, 127) + 128).to(torch.uint8)
        m = (df * -128.0).to(torch.float16)
        return u.reshape(n, k).numpy(), d.numpy(), m.numpy(), 8
    if fmt == "int4":
        lo, hi = wb.amin(-1), wb.amax(-1)
        d = ((hi - lo) / 15.0).to(torch.float16)
        m = lo.to(torch.float16)
        df, mf = d.float(), m.float()
        q = torch.where(df[..., None] > 0, (wb - mf[..., None]) / df[..., None].clamp_min(1e-30),
                        torch.zeros_like(wb))
        u = q.round().clamp(0, 15).to(torch.uint8)
        return u.reshape(n, k).numpy(), d.numpy(), m.numpy(), 4
    raise ValueError(f"unknown round-to-nearest format {fmt!r}; choose int8 or int4")


# ---------------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------
# building a model's packed weights
# ---------------------------------------------------------------------------------------------------
PACK_VERSION = 1  # bump when the packed layout changes (old cache files are then ignored)
_FUSED = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
          ("self_attn.o_proj", ("self_attn.o_proj",)),
          ("mlp.down_proj", ("mlp.down_proj",)))
_GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_GGUF_MATRICES = {*_GGUF_PARTS.values(), "attn_qkv"}  # + Phi-3's fused q/k/v (its ffn_up holds gate and up)


def gguf_tensor_types(path) -> dict[str, str]:
    """GGUF tensor name -> ggml type name (Q4_1, Q8_0, F32, ...) of a GGUF file."""
    return {t.name: t.tensor_type.name for t in GGUFFile(path).tensors}


def _projection_types(types: dict[str, str]) -> set[str]:
    """The types of the matrices a decode step multiplies by (projections, embedding / LM head)."""
    return {t for name, t in types.items()
            if name.startswith("blk.") and name.split(".")[2] in _GGUF_MATRICES and name.endswith(".weight")
            or name in ("token_embd.weight", "output.weight")}


def repacked_types(cfg) -> tuple[str, ...]:
    """The GGUF types the ``gguf`` format repacks for ``qmm`` (:func:`pack_blocks`): Q4_0 / Q4_1 / Q8_0 for a family
    whose fused decode step runs packed weights (it has the int8 / int4 formats); for another (Gemma 3, whose fused
    step runs GGUF matrices in place only) only those that the kernels' ``kq_matmul`` does not run in place (Q8_0
    stays mapped: no copy of its 262k-row embedding)."""
    caps = capabilities(cfg)
    if caps.fused_decode and "int8" in caps.weight_formats:
        return GGUF_IN_PLACE
    return tuple(t for t in GGUF_IN_PLACE if not kernel_ops(t)[2])


def _gguf_packed(path, cfg) -> tuple[dict[str, PackedWeight], list[str]]:
    """Pack a GGUF file's projection matrices of :func:`repacked_types` (Q4_0 / Q4_1 / Q8_0), fused as the model
    fuses them.

    Returns (HF-style fused name -> PackedWeight, names of the HF tensors they replace).  A projection the file
    stores fused (the family's ``gguf_layer_names`` maps a GGUF key to the fused name) is packed whole.  A fused
    projection with any part of another type is left out (dequantized as with ``none``).  q/k rows get llama.cpp's
    RoPE permutation undone as in :func:`kvkeeper.weights.loader.load_gguf`.
    """
    from .loader import _unpermute_rope

    tensors = {t.name: t for t in GGUFFile(path).tensors}
    packed, replaced = {}, []
    repack = repacked_types(cfg)

    def blocks(gname: str, perm_heads: int | None):
        t = tensors.get(gname)
        if t is None or t.tensor_type.name not in repack:
            return None
        n, k = int(t.shape[1]), int(t.shape[0])
        u, d, m, bits = gguf_blocks(t.data, t.tensor_type.name, n, k)
        if perm_heads:
            u, d, m = (_unpermute_rope(a, perm_heads) for a in (u, d, m))
        return u, d, m, bits, t.tensor_type.name

    permuted = capabilities(cfg).gguf_permuted_qk  # llama.cpp permuted q/k rows
    stored = {hf: key for key, hf in causal_lm_class(cfg).gguf_layer_names.items()}  # HF module -> GGUF key
    for i in track(range(cfg.num_layers), "pack GGUF weight blocks (layers)"):
        for fused, parts in _FUSED:
            if fused not in parts and fused in stored:  # the file stores it fused (Phi-3's attn_qkv, ffn_up)
                got, parts = [blocks(f"blk.{i}.{stored[fused]}.weight", None)], (fused,)
            else:
                got = []
                for part in parts:
                    heads = None
                    if permuted and part in ("self_attn.q_proj", "self_attn.k_proj"):
                        heads = cfg.num_heads if part == "self_attn.q_proj" else cfg.num_kv_heads
                    got.append(blocks(f"blk.{i}.{_GGUF_PARTS[part]}.weight", heads))
            if any(g is None for g in got):
                continue
            packed[f"model.layers.{i}.{fused}.weight"] = pack_numpy(*concat_rows(got))
            replaced += [f"model.layers.{i}.{p}.weight" for p in parts]
    for gname, hf in (("token_embd.weight", "model.embed_tokens.weight"), ("output.weight", "lm_head.weight")):
        b = blocks(gname, None)
        if b is not None:
            packed[hf] = pack_numpy(*b)
            replaced.append(hf)
    return packed, replaced


def _rtn_packed(state, cfg, fmt: str) -> tuple[dict[str, PackedWeight], list[str]]:
    """Round-to-nearest ``fmt`` (int8 / int4) of the projection matrices of a float state dict; the embedding
    and an untied LM head get int8 in both formats (the LM head is the most sensitive matrix)."""
    packed, replaced = {}, []
    for i in track(range(cfg.num_layers), f"quantise weights to {fmt} (layers)"):
        for fused, parts in _FUSED:
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            if not all(n in state for n in names):
                continue
            w = torch.cat([state[n].float() for n in names], dim=0)
            packed[f"model.layers.{i}.{fused}.weight"] = pack_numpy(*quantize_rtn(w, fmt), kind=fmt)
            replaced += names
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state:
            packed[name] = pack_numpy(*quantize_rtn(state[name].float(), "int8"), kind="int8")
            replaced.append(name)
    return packed, replaced


def _cache_path(cfg, fmt: str, cache=None):
    from ..text.tokenizer import cache_dir

    return cache_dir(cache) / "weights" / f"{cfg.revision}.{fmt}.v{PACK_VERSION}.safetensors"


def _save_packed(path, packed: dict[str, PackedWeight], replaced: list[str]) -> None:
    import json
    import os

    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, pw in packed.items():
        tensors[f"{name}.qs"], tensors[f"{name}.sc"] = pw.qs, pw.sc
        meta[name] = [pw.bits, pw.n, pw.k, pw.kind]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"packed": json.dumps(meta), "replaced": json.dumps(replaced)})
        os.replace(tmp, path)
    except OSError as e:  # the cache is an optimisation only
        _log.warning("could not cache packed weights: %s", e)


def _load_packed(path) -> tuple[dict[str, PackedWeight], list[str]] | None:
    import json

    from safetensors import safe_open

    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata()
            meta, replaced = json.loads(md["packed"]), json.loads(md["replaced"])
            packed = {name: PackedWeight(f.get_tensor(f"{name}.qs"), f.get_tensor(f"{name}.sc"), int(b), int(n), int(k),
                                         kind) for name, (b, n, k, kind) in meta.items()}
        return packed, replaced
    except Exception as e:  # noqa: BLE001  (rebuilt by the caller)
        _log.warning("packed weights cache %s unreadable (%s); rebuilding", path, e)
        return None


@dataclass
class PreparedWeights:
    """What :func:`prepare_weights` hands the model: tensors and packed matrices, the format and a summary."""

    state: dict
    format: str
    description: str


def weight_format_for(state, quantization: str | None, device="cpu", dtype=torch.float32) -> str:
    """The format :func:`prepare_weights` will run for these weights (:func:`resolve_quantization` with the
    GGUF file's tensor types); raises :class:`QuantizationError` for one the file cannot run."""
    source = getattr(state, "source", "dummy")
    gguf_types = None
    if source == "gguf" and (quantization is None or str(quantization).lower() in ("auto", "gguf")):
        gguf_types = getattr(state, "gguf_types", None)
        path = getattr(state, "path", None)
        if gguf_types is None and path is not None:
            gguf_types = gguf_tensor_types(path)
        gguf_types = _projection_types(gguf_types or {})
    mapped = any(is_gguf_entry(v) for v in state.values())  # a Llama-family GGUF loaded in place
    return resolve_quantization(quantization, source=source, gguf_types=gguf_types, device=device, dtype=dtype,
                                mapped=mapped)


def prepare_weights(state, cfg, quantization: str | None, device="cpu", dtype=torch.float32,
                    cache=None) -> PreparedWeights:
    """Resolve the weight format (:func:`resolve_quantization`) and replace the matrices it quantizes.

    state: HF-named float tensors as :func:`kvkeeper.weights.loader.load_weights` returns them (a
    :class:`~kvkeeper.weights.loader.ModelWeights` says whether they came from a GGUF file, whose blocks the
    ``gguf`` format reads).  Quantized matrices are built once per model revision and format and cached
    next to the dequantized weights (``cache/weights``, see :func:`kvkeeper.text.tokenizer.cache_dir`).
    Raises :class:`QuantizationError`.
    """
    path = getattr(state, "path", None)
    fmt = weight_format_for(state, quantization, device, dtype)
    if fmt != "gguf" and any(is_gguf_entry(v) for v in state.values()):  # mapped GGUF matrices: float32 load
        from .loader import _cached_gguf

        state = _cached_gguf(path, cache)[1]
    if fmt == "none":
        return PreparedWeights(state, "none", f"{str(dtype).removeprefix('torch.')} weights")
    packed_path = _cache_path(cfg, fmt, cache) if cfg.revision else None
    got = _load_packed(packed_path) if packed_path is not None else None
    types = getattr(state, "gguf_types", None)
    if got is None and fmt == "gguf" and types is not None and not _projection_types(types) & set(repacked_types(cfg)):
        got = ({}, [])  # nothing to repack (a K-quant file): do not parse the file again
    if got is None:
        got = _gguf_packed(path, cfg) if fmt == "gguf" else _rtn_packed(state, cfg, fmt)
        if packed_path is not None and got[0]:
            _save_packed(packed_path, *got)
    packed, replaced = got
    out = {k: v for k, v in state.items() if k not in set(replaced)}
    out.update(packed)
    if fmt == "gguf" and any(is_gguf_entry(v) for v in out.values()):
        return PreparedWeights(out, fmt, _group_mapped(out, cfg, packed))
    kinds: dict[str, int] = {}
    for pw in packed.values():
        kinds[pw.kind] = kinds.get(pw.kind, 0) + 1
    nbytes = sum(pw.nbytes for pw in packed.values())
    left = [k for k, v in out.items() if isinstance(v, torch.Tensor) and v.dim() == 2]
    desc = (f"{fmt}: {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))} matrices in place "
            f"({nbytes / 1e6:.1f} MB)" + (f", {len(left)} dequantized" if left else ""))
    return PreparedWeights(out, fmt, desc)


def _group_mapped(out: dict, cfg, packed: dict[str, PackedWeight]) -> str:
    """Fuse a llama model's mapped GGUF matrices (:class:`GGUFWeight`) in ``out`` as the model fuses them (a list
    of parts under the fused name), dequantize any other mapped matrix to float32; returns the load summary
    (bytes mapped in place, repacked and dequantized to float32)."""
    for i in range(cfg.num_layers):
        for fused, parts in _FUSED:
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            if all(isinstance(out.get(n), GGUFWeight) for n in names):
                out[f"model.layers.{i}.{fused}.weight"] = [out.pop(n) for n in names]
            elif isinstance(out.get(f"model.layers.{i}.{fused}.weight"), GGUFWeight):  # stored fused (Phi-3)
                out[f"model.layers.{i}.{fused}.weight"] = [out[f"model.layers.{i}.{fused}.weight"]]
    top = ("model.embed_tokens.weight", "lm_head.weight")
    for name in [n for n, v in out.items() if isinstance(v, GGUFWeight) and n not in top]:
        out[name] = out[name].dequantize()
    mapped: dict[str, int] = {}
    for v in out.values():
        for w in ([v] if isinstance(v, GGUFWeight) else v if is_gguf_entry(v) else ()):
            mapped[w.type_name] = mapped.get(w.type_name, 0) + w.nbytes
    deq = sum(v.numel() * v.element_size() for v in out.values() if isinstance(v, torch.Tensor))
    rep = sum(pw.nbytes for pw in packed.values())
    kinds = ", ".join(f"{t} {b / 1e6:.2f}" for t, b in sorted(mapped.items()))
    experts = ", MoE router and experts" if any(".mlp.experts." in n for n in out) else ""
    return (f"gguf: {sum(mapped.values()) / 1e6:.2f} MB mapped in place ({kinds}), {rep / 1e6:.2f} MB repacked"
            f" ({len(packed)} matrices), {deq / 1e6:.2f} MB dequantized to float32 (norms, biases, F32 tensors"
            f"{experts})")
