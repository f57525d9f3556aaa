"""Whether a model fits in memory, decided before its weights are loaded.

The estimate (:func:`estimate`, bytes) adds what the engine will hold once it runs:

* the weights as they will be held (:mod:`kvkeeper.weights.footprint`: mapped GGUF blocks, repacked blocks,
  dense tensors, plus what lives only while loading), from the model file's header;
* the KV pool (``kv_cache_bytes`` / ``num_kv_blocks`` as :mod:`kvkeeper.kvcache.sizing` turns them into
  blocks; counted whole, though its pages are committed only as blocks are first written);
* working buffers: the logits of a step (vocabulary x ``max_num_batched_tokens`` x 4 bytes), a step's
  activations (per token: 4 hidden-size rows, the q/k/v row, 3 intermediate-size rows, float32), the
  attention of a prefill chunk over its context (heads x chunk x context scores plus the context's K and V
  in float32, the context being at most the context window and the tokens the pool holds) and the RoPE
  tables (positions x head_dim x 2, float32).

It is compared with the memory available to the process (:func:`available_memory`: ``MemAvailable`` of
``/proc/meminfo``, and the cgroup v2 limit when one is set: ``memory.max`` minus ``memory.current``); a model
that needs more is refused with :class:`~kvkeeper.errors.InsufficientMemoryError`, which names both numbers
and the settings that lower the need, instead of being killed by the kernel's out-of-memory killer half-way
through loading.  ``EngineConfig.memory_check=False`` (``--no-memory-check``) skips the check.  Only CPU
engines are checked (a CUDA engine's weights and KV live in device memory).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InsufficientMemoryError, InvalidRequestError, KVKeeperError, ModelFormatError
from ..kvcache.sizing import bytes_per_block
from ..model_config import ModelConfig
from ..models.registry import capabilities, family_options
from ..weights import footprint as fp
from ..worker.cpu_threads import MOUNTINFO, PROC_CGROUP, own_cgroups, up_to
from ..weights.formats import QuantizationError, may_map_gguf
from ..weights.loader import load_model
from ..weights.sources import resolve_model_path
from ..worker.runner import ModelRunner
from .config import EngineConfig

__all__ = ["MemoryEstimate", "estimate", "available_memory", "check_memory_fit", "load_checked"]

MEMINFO = Path("/proc/meminfo")


@dataclass
class MemoryEstimate:
    """Bytes an engine will need: ``weights`` (a :class:`~kvkeeper.weights.footprint.WeightFootprint`),
    ``kv_pool``, ``logits``, ``activations``, ``attention``, ``rope``; ``total`` adds them (the weights at
    their load peak)."""

    weights: fp.WeightFootprint
    kv_pool: int
    logits: int
    activations: int
    attention: int
    rope: int
    source: str = "gguf"
    notes: dict = field(default_factory=dict)

    @property
    def working(self) -> int:
        return self.logits + self.activations + self.attention + self.rope

    @property
    def total(self) -> int:
        return self.weights.peak + self.kv_pool + self.working


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def model_weights(cfg: EngineConfig, path: Path | None, device: torch.device,
                  dtype: torch.dtype) -> tuple[ModelConfig, str, fp.WeightFootprint]:
    """(model config, source, weight footprint) of the engine's model from its file's header (``path``: the
    resolved model file or folder; None with load format dummy).  Raises the loader's errors and
    QuantizationError / InvalidRequestError for a format the model cannot run."""
    from ..weights import dummy
    from ..gguf_file import GGUFFile
    from ..weights.loader import gguf_model_config

    kw = dict(device=device, dtype=dtype)
    if cfg.load_format == "dummy":
        mcfg, _ = dummy.load_config(cfg.model)
        tensors, source, extra = fp.model_tensors(mcfg, dtype), "dummy", dict(mapped=False)
    elif path.is_dir():
        from ..weights.loader import load_hf_config

        mcfg = load_hf_config(path)
        try:
            tensors, source, extra = fp.safetensors_tensors(path), "hf", dict(mapped=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from e
        if not any(t.name == "lm_head.weight" for t in tensors):
            mcfg.tie_word_embeddings = True
    else:
        reader = GGUFFile.open(path)
        mcfg, family, _ = gguf_model_config(path, reader)
        tensors, source = fp.gguf_tensors(reader, family), "gguf"
        extra = dict(mapped=family.capabilities.gguf_in_place, gguf_types=fp.gguf_projection_types(reader))
    _, quantization = family_options(mcfg, cfg.attention_backend, cfg.quantization)
    weights = fp.weight_footprint(tensors, source, quantization, tied=mcfg.tie_word_embeddings, **extra, **kw)
    return mcfg, source, weights


def estimate(cfg: EngineConfig, path: Path | None, device: torch.device, dtype: torch.dtype) -> MemoryEstimate:
    """The memory an engine of these settings will need for the model at ``path`` (see the module docstring).
    Raises the loader's errors for an unreadable file and InvalidRequestError for settings the model cannot
    run (the same errors loading would raise)."""
    try:
        mcfg, source, weights = model_weights(cfg, path, device, dtype)
        kv = cfg.kv_format_for(weights.format, dtype)
    except (QuantizationError, ValueError) as e:
        if isinstance(e, KVKeeperError):
            raise
        raise InvalidRequestError(str(e)) from None
    num_blocks, window_blocks = cfg.kv_pool_blocks(mcfg, kv)
    layer_block = bytes_per_block(kv, mcfg, cfg.block_size, num_layers=1)
    n_slide = sum(mcfg.is_sliding_layer(i) for i in range(mcfg.num_layers)) if window_blocks else 0
    kv_pool = layer_block * ((mcfg.num_layers - n_slide) * num_blocks + n_slide * (window_blocks or 0))
    t = cfg.max_num_batched_tokens
    context = min(mcfg.context_length, cfg.max_model_len or mcfg.context_length, num_blocks * cfg.block_size)
    heads, dim = mcfg.num_heads, mcfg.head_dim
    per_token = 4 * mcfg.hidden_size + (heads + 2 * mcfg.num_kv_heads) * dim + 3 * mcfg.intermediate_size
    tables = 2 if capabilities(mcfg).kv_layout == "hybrid" else 1  # Gemma 3: a local RoPE table too
    return MemoryEstimate(
        weights=weights, kv_pool=kv_pool, logits=mcfg.vocab_size * t * 4, activations=t * per_token * 4,
        attention=(heads * min(t, context) * context + 2 * context * heads * dim) * 4,
        rope=tables * 2 * min(mcfg.context_length, cfg.max_model_len or mcfg.context_length) * dim * 4,
        source=source,
        notes={"kv_format": kv.name, "kv_blocks": num_blocks, "context": context})


def _cgroup_headroom(version: str, folder: Path) -> tuple[int, int] | None:
    """(limit, in use) bytes of one cgroup folder: v2 ``memory.max`` / ``memory.current``, v1
    ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``; None without a limit (v2 "max", v1's page-rounded
    2^63) or where the files cannot be read."""
    names = ("memory.max", "memory.current") if version == "v2" else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    try:
        limit = (folder / names[0]).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return int(limit), int((folder / names[1]).read_text().strip())
    except (OSError, ValueError):
        return None


def available_memory(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> tuple[int, str]:
    """(bytes, where the figure comes from) available to this process: ``MemAvailable`` of /proc/meminfo, or
    the headroom of a cgroup memory limit (limit - in use) on this process's own cgroup or an ancestor, v2 or
    v1 (found as :mod:`kvkeeper.worker.cpu_threads` finds the CPU quota), when that is lower.  (0, "unknown")
    when none can be read (the check is then skipped)."""
    got: list[tuple[int, str]] = []
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                got.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    for version, folder, top in own_cgroups(proc_cgroup, mountinfo, "memory"):
        for d in up_to(folder, top):
            lim = _cgroup_headroom(version, d)
            if lim is not None:
                got.append((max(0, lim[0] - lim[1]), f"the cgroup limit of {d} ({_gib(lim[0])}, {_gib(lim[1])} "
                                                     f"in use)"))
    return min(got) if got else (0, "unknown")


def refusal(est: MemoryEstimate, available: int, where: str) -> str:
    """The message of a model that does not fit: both numbers, the parts, and the settings that lower them."""
    w = est.weights
    lower = [f"--kv-cache-bytes (kv_cache_bytes; the KV pool is {_gib(est.kv_pool)})",
             f"a smaller --max-model-len (max_model_len; attention buffers {_gib(est.attention)} for a "
             f"context of {est.notes['context']} tokens) or --max-batched-tokens (logits and activations "
             f"{_gib(est.logits + est.activations)})"]
    if w.format == "none" and est.source == "gguf":
        lower.append("--quantization gguf (the file's own blocks, mapped, if its types run in place) or int4")
    elif w.format in ("none", "int8"):
        lower.append("--quantization int4 (or int8)")
    else:
        lower.append("a different --quantization")
    return (f"the model needs about {_gib(est.total)} of memory but {_gib(available)} is available ({where}): "
            f"weights {_gib(w.peak)} ({w.describe()}), KV pool {_gib(est.kv_pool)} ({est.notes['kv_blocks']} "
            f"{est.notes['kv_format']} blocks), working buffers {_gib(est.working)}; lower the need with "
            + "; ".join(lower) + ", or pass --no-memory-check (memory_check=False) to load it anyway")


def check_memory_fit(cfg: EngineConfig, path: Path | None, device: torch.device,
                     dtype: torch.dtype) -> MemoryEstimate | None:
    """Refuse a model that will not fit: raises :class:`InsufficientMemoryError` when :func:`estimate` exceeds
    :func:`available_memory`; returns the estimate (None when not checked: ``memory_check`` off, a non-CPU
    device, no readable memory figure, or a model file whose header is unreadable: the loader then says why)."""
    if not cfg.memory_check or device.type != "cpu":
        return None
    available, where = available_memory()
    if available <= 0:
        return None
    try:
        est = estimate(cfg, path, device, dtype)
    except ModelFormatError:  # an unreadable file: the loader says what is wrong with it
        return None
    except KVKeeperError:  # settings the model cannot run: loading says the same
        raise
    except Exception as e:  # noqa: BLE001  (an estimate that fails must not stop a load that would work)
        logging.getLogger(__name__).warning("memory estimate failed (%s: %s); the model is loaded unchecked",
                                            type(e).__name__, e)
        return None
    if est.total > available:
        raise InsufficientMemoryError(refusal(est, available, where), est.total, available)
    return est


def load_checked(cfg: EngineConfig, device: torch.device, dtype: torch.dtype):
    """Check that ``cfg``'s model fits (:func:`check_memory_fit`, before any large allocation), then load it onto
    ``device`` in ``dtype`` and build its :class:`~kvkeeper.worker.runner.ModelRunner`.  Returns (runner, model
    config, tokenizer, model path, memory estimate or None).  Raises what loading raises, InsufficientMemoryError,
    and InvalidRequestError for a format or attention backend the model cannot run."""
    path = None if cfg.load_format == "dummy" else resolve_model_path(cfg.model, cfg.cache_dir)
    est = check_memory_fit(cfg, path, device, dtype)
    mcfg, state, tokenizer, model_path = load_model(str(path or cfg.model), cfg.load_format, cfg.cache_dir, dtype,
                                                    device, cfg.seed, in_place=may_map_gguf(cfg.quantization))
    try:
        runner = ModelRunner(mcfg, state, **cfg.runner_args(mcfg, state, device, dtype))
    except ValueError as e:  # a format or attention backend the model cannot run
        raise InvalidRequestError(str(e)) from None
    return runner, mcfg, tokenizer, model_path, est
