"""The bytes a model's weights will hold in memory, known before any weight is read.

From a model file's header alone (a GGUF file's tensor table, :class:`~kvkeeper.gguf_file.GGUFFile`;
the JSON headers of a Hugging Face folder's safetensors files; the shapes of a dummy config), and the weight
format the file will run (:func:`kvkeeper.weights.formats.resolve_quantization`, as the loader resolves it):

* ``mapped``: a GGUF file's own blocks computed in place over its memory map (format ``gguf``).  They count as
  resident: a decode step reads every one of them.
* ``repacked``: blocks repacked into kvkeeper's interleaved layout (:class:`~kvkeeper.layers.quantized.
  PackedWeight`: rows padded to 16, per 32 weights 16 bytes of 4-bit or 32 bytes of 8-bit codes plus 4 bytes
  of float16 scale and minimum): Q4_0 / Q4_1 / Q8_0 matrices of a GGUF file, and the ``int8`` / ``int4``
  formats (whose embedding and LM head are int8).
* ``dense``: tensors held in the model dtype (float32 on CPU): norms and biases always, every matrix with
  ``none``, plus the transposed copies ``none`` keeps on CPU in float32 (the projections and the LM head).
* ``load_extra``: bytes alive only while loading: the float32 state that ``int8`` / ``int4`` (and ``gguf`` for
  a family that is not mapped in place) quantize from, a safetensors file's own copy before its conversion to
  float32, the float32 state beside a cast to another dtype.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model_config import ModelConfig
from .formats import _FUSED, GGUF_IN_PLACE, _projection_types, may_map_gguf, resolve_quantization

__all__ = ["WeightFootprint", "TensorInfo", "weight_footprint", "packed_bytes", "gguf_tensors", "safetensors_tensors",
           "model_tensors", "gguf_projection_types"]

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a model file: its Hugging Face ``name`` (None: a tensor the model does not load),
    ``shape`` (rows first, as PyTorch), ``nbytes`` as stored in the file, ``kind`` (a ggml type name such as
    Q4_K, or a safetensors / torch dtype name), ``matrix``: a weight matrix the format may keep mapped or
    quantize (a projection, the embedding, the LM head; not a norm, a bias or a GGUF file's F32 tensor)."""

    name: str | None
    shape: tuple[int, ...]
    nbytes: int
    kind: str
    matrix: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class WeightFootprint:
    """Bytes of a model's weights in memory (the module docstring defines the parts); ``format`` is the weight
    format the file will run (none, gguf, int8, int4)."""

    format: str
    mapped: int = 0
    repacked: int = 0
    dense: int = 0
    load_extra: int = 0

    @property
    def resident(self) -> int:
        """Bytes held once loaded."""
        return self.mapped + self.repacked + self.dense

    @property
    def peak(self) -> int:
        """Bytes held at the worst moment of the load."""
        return self.resident + self.load_extra

    def describe(self) -> str:
        parts = [f"{v / (1 << 30):.2f} GiB {k}" for k, v in (("mapped", self.mapped), ("repacked", self.repacked),
                                                      ("in the model dtype", self.dense),
                                                      ("only while loading", self.load_extra)) if v]
        return f"--quantization {self.format}: " + (", ".join(parts) or "0 bytes")


def packed_bytes(rows: int, k: int, bits: int) -> int:
    """Bytes of a :class:`~kvkeeper.layers.quantized.PackedWeight` of ``rows`` x ``k`` weights with
    ``bits``-bit codes (4 or 8): rows padded to 16, per block of 32 weights 4 * bits bytes of codes plus
    4 bytes of scales."""
    return -(-rows // 16) * 16 * (k // 32) * (4 * bits + 4)


def _fused_name(name: str) -> str:
    """The name of the fused projection a Hugging Face matrix joins (itself for the others)."""
    for fused, parts in _FUSED:
        for p in parts:
            if name.endswith(f".{p}.weight"):
                return name[: -len(f"{p}.weight")] + f"{fused}.weight"
    return name


# ---- what a file holds ---------------------------------------------------------------------------------
def gguf_tensors(reader, family) -> list[TensorInfo]:
    """The tensors of a GGUF file's :class:`GGUFFile` ``reader`` under their Hugging Face names (``family``:
    the model class, whose ``gguf_layer_names`` map them)."""
    from .loader import _GGUF_TOP_NAMES, _in_place_name

    out = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        kind = t.tensor_type.name
        in_place = _in_place_name(t.name, family.gguf_layer_names)
        name = in_place or _GGUF_TOP_NAMES.get(t.name)
        parts = t.name.split(".")
        if name is None and len(parts) == 4 and parts[0] == "blk" and parts[2] in family.gguf_layer_names:
            name = f"model.layers.{parts[1]}.{family.gguf_layer_names[parts[2]]}.{parts[3]}"
        matrix = in_place is not None and len(shape) == 2 and kind != "F32"
        out.append(TensorInfo(name, shape, int(t.n_bytes), kind, matrix))
    return out


def safetensors_tensors(folder: Path) -> list[TensorInfo]:
    """The tensors of a Hugging Face folder's ``*.safetensors`` files, from their JSON headers (8-byte length,
    then the header: name -> dtype, shape, offsets).  Raises OSError / ValueError for an unreadable header."""
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    out = []
    for f in files:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, e in header.items():
            if name == "__metadata__":
                continue
            begin, end = e["data_offsets"]
            out.append(TensorInfo(name, tuple(e["shape"]), int(end - begin), e["dtype"], len(e["shape"]) == 2))
    return out


def model_tensors(cfg: ModelConfig, dtype: torch.dtype) -> list[TensorInfo]:
    """The parameters of ``cfg``'s model (its own, fused, names) in ``dtype``: built on the meta device, so
    nothing is allocated (the shapes of load format ``dummy``)."""
    from ..models.llama import skip_init
    from ..models.registry import causal_lm_class

    with skip_init(), torch.device("meta"):
        model = causal_lm_class(cfg)(cfg)
    return [TensorInfo(n, tuple(p.shape), p.numel() * dtype.itemsize, str(dtype).removeprefix("torch."), p.dim() == 2)
            for n, p in model.named_parameters()]


def gguf_projection_types(reader) -> set[str]:
    """The ggml types of a GGUF file's projection matrices, embedding and LM head (what decides its default
    format, :func:`resolve_quantization`)."""
    return _projection_types({t.name: t.tensor_type.name for t in reader.tensors})


# ---- what the format holds -----------------------------------------------------------------------------
def weight_footprint(tensors: list[TensorInfo], source: str, quantization: str | None, *, mapped: bool,
                     gguf_types: set[str] | None = None, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32, tied: bool = False) -> WeightFootprint:
    """The footprint of a model file's ``tensors`` (:func:`gguf_tensors`, :func:`safetensors_tensors` or
    :func:`model_tensors`) run in the format that ``quantization`` resolves to for the file.

    source: "gguf", "hf" or "dummy"; mapped: whether the loader keeps the file's matrices mapped (a GGUF file of
    a family with ``gguf_in_place``; ignored unless ``quantization`` may resolve to gguf); gguf_types: a GGUF
    file's :func:`gguf_projection_types`; tied: the LM head is the embedding.  Raises :class:`~kvkeeper.weights.formats.QuantizationError` as :func:`resolve_quantization`.
    """
    used = [t for t in tensors if t.name is not None]
    mapped = mapped and source == "gguf" and may_map_gguf(quantization)
    fmt = resolve_quantization(quantization, source=source, gguf_types=gguf_types, device=device, dtype=dtype,
                               mapped=mapped)
    fp = WeightFootprint(fmt)
    size = dtype.itemsize
    groups: dict[str, list[TensorInfo]] = {}
    for t in used:
        (groups.setdefault(_fused_name(t.name), []) if t.matrix else [t]).append(t)
        if not t.matrix:
            fp.dense += t.numel * size
    native_extra = sum(t.nbytes for t in used if source == "hf" and t.kind != "F32")  # before .float()
    if fmt == "gguf":
        for parts in groups.values():
            if all(p.kind in GGUF_IN_PLACE for p in parts):
                bits = 8 if any(p.kind == "Q8_0" for p in parts) else 4
                fp.repacked += packed_bytes(sum(p.shape[0] for p in parts), parts[0].shape[1], bits)
            elif mapped:
                fp.mapped += sum(p.nbytes for p in parts)
            else:
                fp.dense += sum(p.numel for p in parts) * size
        if not mapped:  # the float32 state the repacked blocks replace, until the runner is built
            fp.load_extra += sum(p.numel for ps in groups.values() for p in ps
                                 if all(q.kind in GGUF_IN_PLACE for q in ps)) * 4
        return fp
    matrices = [p for ps in groups.values() for p in ps]
    if fmt == "none":
        fp.dense += sum(p.numel for p in matrices) * size
        if torch.device(device).type == "cpu" and dtype == torch.float32:  # transposed copies: every Linear,
            head = "embed_tokens.weight" if tied else "lm_head.weight"  # plus the LM head's own
            fp.dense += sum(p.numel for p in matrices if not p.name.endswith("embed_tokens.weight")) * 4
            fp.dense += sum(p.numel for p in matrices if p.name.endswith(head)) * 4
        if dtype != torch.float32 and source != "dummy":  # the float32 state beside its cast
            fp.load_extra += sum(t.numel for t in used) * 4
        fp.load_extra += native_extra
        return fp
    bits = 8 if fmt == "int8" else 4  # int8 / int4 from the float32 state
    for name, parts in groups.items():
        b = 8 if name.endswith(("embed_tokens.weight", "lm_head.weight")) else bits
        fp.repacked += packed_bytes(sum(p.shape[0] for p in parts), parts[0].shape[1], b)
    fp.load_extra += sum(p.numel for p in matrices) * 4 + native_extra
    return fp
