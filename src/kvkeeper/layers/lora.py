"""LoRA adapters (Hu et al., 2021, arXiv:2106.09685) in the PEFT file format, applied per request.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT's
``save_pretrained`` writes them: per layer and projection a pair ``lora_A`` (r, in) and ``lora_B``
(out, r) under names like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``.  A
projection ``y = x W^T`` of a token under the adapter becomes ``y + s * (x A^T) B^T`` with
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``, Kalajdzievski 2023), as PEFT's
``LoraLayer`` computes it (dropout is a training-time op and is not applied).  Targets: q/k/v/o and
gate/up/down projections of Llama-family models; the base weights stay as loaded (packed GGUF
blocks, int8/int4 or float) and are never merged, so one batch serves several adapters and the base
model together.

How a mixed batch is computed (:class:`LoRAHooks`): forward hooks on the fused projections
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) add, for each distinct adapter of the step,
the low-rank term of the rows (tokens) of that adapter's sequences, gathered with ``index_select``
and scattered back with ``index_add_``.  This is a loop over the distinct adapters of the batch (as
simple as it is correct; S-LoRA / Punica's batched gather kernels are the fast version of the same
sum).  Steps without an adapter run unchanged (and keep the fused C++ decode step).

An adapter's identity in the KV cache is ``name@sha256`` of its config and weights
(:attr:`LoRAAdapter.id`): KV computed under one adapter is never reused under another, the base model
or a same-named adapter with other weights (see :class:`kvkeeper.kvcache.namespace.Namespace`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import InvalidRequestError
from ..model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT target -> (fused kvkeeper module, index of its part in the fused output)
_TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
            "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
            "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
            "down_proj": ("mlp.down_proj", 0)}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# config keys whose non-default value changes the computation in a way this module does not implement
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {},
            "alpha_pattern": {}, "lora_bias": False, "use_qalora": False, "layer_replication": None}


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT target in a Llama-family model of ``cfg``."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _part_offsets(cfg: ModelConfig) -> dict[str, int]:
    """Column offset of each PEFT target inside its fused projection's output."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": 0, "k_proj": q, "v_proj": q + kv, "o_proj": 0, "gate_proj": 0,
            "up_proj": cfg.intermediate_size, "down_proj": 0}


@dataclass
class LoRAAdapter:
    """A loaded adapter.

    name: the name requests select it by (the server's ``model`` field).  path: its directory.
    sha256: hex digest of its config (canonical JSON) and weights file.  rank, alpha, scaling: ``r``,
    ``lora_alpha`` and the factor applied (alpha / r, or alpha / sqrt(r) with rslora).
    parts: ``(layer, fused module) -> [(column offset, A (r, in), B * scaling (out, r))]`` in the
    model's dtype and device.
    """

    name: str
    path: Path
    sha256: str
    rank: int
    alpha: float
    scaling: float
    parts: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = field(repr=False)

    @property
    def id(self) -> str:
        """``name@<first 16 hex digits of sha256>``: the adapter part of its KV cache namespace."""
        return f"{self.name}@{self.sha256[:16]}"

    @property
    def num_parameters(self) -> int:
        return sum(a.numel() + b.numel() for ps in self.parts.values() for _, a, b in ps)

    def __post_init__(self):
        # per fused module: the A matrices of its parts stacked (one x @ A^T for q, k and v together) and, per
        # part, (column offset, its rows of that product, B)
        self.stacked: dict[tuple[int, str], tuple[torch.Tensor, list]] = {}
        for key, parts in self.parts.items():
            r0, rows = 0, []
            for off, a, b in parts:
                rows.append((off, r0, r0 + a.shape[0], b))
                r0 += a.shape[0]
            self.stacked[key] = (torch.cat([a for _, a, _ in parts]), rows)

    def delta(self, key: tuple[int, str], x: torch.Tensor, width: int) -> torch.Tensor | None:
        """The low-rank term of fused module ``key`` = (layer, name) for inputs x (M, in): (M, width) in x's
        dtype, or None when the adapter does not touch that module."""
        st = self.stacked.get(key)
        if st is None:
            return None
        a, parts = st
        xa = x @ a.t()  # (M, sum of the parts' ranks)
        ys = [(off, xa[:, r0:r1] @ b.t()) for off, r0, r1, b in parts]
        if [off for off, _ in ys] == list(itertools.accumulate([0] + [y.shape[1] for _, y in ys[:-1]])) and \
                sum(y.shape[1] for _, y in ys) == width:  # the parts tile the output: no zeros to fill
            return ys[0][1] if len(ys) == 1 else torch.cat([y for _, y in ys], dim=1)
        out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        for off, y in ys:
            out[:, off: off + y.shape[1]] += y
        return out


def _read_config(path: Path) -> tuple[dict, bytes]:
    """The adapter's config and its canonical bytes; raises InvalidRequestError for a missing, unreadable,
    non-LoRA or unsupported config."""
    f = path / CONFIG_FILE
    if not f.is_file():
        raise InvalidRequestError(f"LoRA adapter {path}: no {CONFIG_FILE} (a PEFT adapter directory, as "
                                  "save_pretrained writes it, is needed)")
    try:
        conf = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"LoRA adapter {path}: {CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(conf, dict) or str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequestError(f"LoRA adapter {path}: peft_type is {conf.get('peft_type')!r}, only LORA is "
                                  "supported")
    for key, default in _REFUSED.items():
        if conf.get(key, default) not in (default, None, False, {}, []):
            raise InvalidRequestError(f"LoRA adapter {path}: {key}={conf[key]!r} is not supported (only plain "
                                      "LoRA on q/k/v/o/gate/up/down projections)")
    if not isinstance(conf.get("r"), int) or conf["r"] < 1:
        raise InvalidRequestError(f"LoRA adapter {path}: r must be a positive integer, got {conf.get('r')!r}")
    return conf, json.dumps(conf, sort_keys=True).encode()


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    f = path / WEIGHTS_FILE
    if not f.is_file():
        raise InvalidRequestError(f"LoRA adapter {path}: no {WEIGHTS_FILE} (adapters saved as .bin are not read; "
                                  "save with safe_serialization=True)")
    from safetensors.torch import load as load_bytes

    raw = f.read_bytes()
    try:
        return load_bytes(raw), raw
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise InvalidRequestError(f"LoRA adapter {path}: {WEIGHTS_FILE} is not a safetensors file: {e}") from None


def _pairs(path: Path, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[tuple[int, str], dict]:
    """``(layer, target) -> {"A": tensor, "B": tensor}``; raises InvalidRequestError for a tensor outside the
    supported targets, a layer the model lacks, a missing half or a shape that does not fit the model."""
    pairs: dict[tuple[int, str], dict] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in _TARGETS or not _TARGETS[m.group(3)][0].startswith(m.group(2)):
            raise InvalidRequestError(f"LoRA adapter {path}: tensor {key!r} is not a LoRA weight of a "
                                      f"q/k/v/o/gate/up/down projection; this adapter cannot be applied")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise InvalidRequestError(f"LoRA adapter {path}: tensor {key!r} is for layer {layer}, the model has "
                                      f"{cfg.num_layers}")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = t
    shapes = _shapes(cfg)
    for (layer, target), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise InvalidRequestError(f"LoRA adapter {path}: layer {layer} {target} has lora_{''.join(ab)} but "
                                      "not its other half")
        n_in, n_out = shapes[target]
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            raise InvalidRequestError(
                f"LoRA adapter {path}: layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                f"model needs A (r, {n_in}) and B ({n_out}, r): the adapter was trained for another base model")
    if not pairs:
        raise InvalidRequestError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    return pairs


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter directory against the model's shapes.

    Returns a :class:`LoRAAdapter` with its weights in ``dtype`` on ``device`` and the scaling folded into
    B.  Whether the model's family takes adapters at all is its ``capabilities.lora``
    (:mod:`kvkeeper.models.capabilities`), checked by the caller (:mod:`kvkeeper.engine.adapters`).
    Raises :class:`InvalidRequestError` naming what is wrong: an empty name, a missing directory or
    file, an unsupported option (DoRA, bias, modules_to_save, rank/alpha patterns), a tensor outside the
    q/k/v/o/gate/up/down projections, or shapes of another base model.
    """
    if not name or not isinstance(name, str):
        raise InvalidRequestError("a LoRA adapter needs a non-empty name")
    path = Path(path)
    if not path.is_dir():
        raise InvalidRequestError(f"LoRA adapter {name!r}: {path} is not a directory")
    conf, conf_bytes = _read_config(path)
    tensors, raw = _read_tensors(path)
    sha = hashlib.sha256(conf_bytes + b"\0" + raw).hexdigest()
    r, alpha = int(conf["r"]), float(conf.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    offsets = _part_offsets(cfg)
    parts: dict[tuple[int, str], list] = {}
    for (layer, target), ab in sorted(_pairs(path, tensors, cfg).items()):
        a = ab["A"].to(device=device, dtype=dtype).contiguous()
        b = (ab["B"].float() * scaling).to(device=device, dtype=dtype).contiguous()
        parts.setdefault((layer, _TARGETS[target][0]), []).append((offsets[target], a, b))
    return LoRAAdapter(name, path, sha, r, alpha, scaling, parts)


class LoRAHooks:
    """Forward hooks that add the adapters' low-rank terms to a Llama-family model's projections.

    ``with hooks.batch(scheduled):`` around a forward pass (``scheduled``: the step's (sequence,
    tokens) pairs in packing order; a sequence's adapter is ``seq.lora``) activates them for that step;
    outside it, or for a step without adapters, the hooks return the projection unchanged.
    Raises :class:`InvalidRequestError` for a model without the fused Llama projections.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        self._rows: list[tuple[LoRAAdapter, torch.Tensor]] = []
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise InvalidRequestError("LoRA adapters apply to Llama-family models only")
        fused = sorted({f for f, _ in _TARGETS.values()})
        for i, layer in enumerate(layers):
            for name in fused:
                try:
                    mod = layer.get_submodule(name)
                except AttributeError:
                    raise InvalidRequestError(f"LoRA adapters apply to Llama-family models: layer {i} has no "
                                              f"{name}") from None
                mod.register_forward_hook(self._hook(i, name))

    def _hook(self, layer: int, name: str):
        def add_lora(module, inputs, out):
            if not self._rows:
                return None
            x, delta, key = inputs[0], None, (layer, name)
            if len(self._rows) == 1 and self._rows[0][1].numel() == x.shape[0]:  # one adapter, every token
                ys = self._rows[0][0].delta(key, x, out.shape[-1])
                return None if ys is None else out + ys
            for adapter, rows in self._rows:
                ys = adapter.delta(key, x.index_select(0, rows), out.shape[-1])
                if ys is not None:
                    delta = torch.zeros_like(out) if delta is None else delta
                    delta.index_add_(0, rows, ys)
            return None if delta is None else out + delta
        return add_lora

    @contextlib.contextmanager
    def batch(self, scheduled):
        """Activate the adapters of a step's sequences; yields True when any sequence has one."""
        groups: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        start = 0
        for seq, n in scheduled:
            a = getattr(seq, "lora", None)
            if a is not None:
                groups.setdefault(id(a), (a, []))[1].extend(range(start, start + n))
            start += n
        self._rows = [(a, torch.tensor(r, dtype=torch.int64, device=self.device)) for a, r in groups.values()]
        try:
            yield bool(self._rows)
        finally:
            self._rows = []
