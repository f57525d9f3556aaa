"""Load weights and configuration from a GGUF file or a Hugging Face folder.

Both paths produce a :class:`ModelConfig` and a state dict in Hugging Face
naming (``model.layers.{i}.self_attn.q_proj.weight`` ...), dequantised to
float32 tensors (a :class:`ModelWeights`, which also says where they came from);
the model casts them to its dtype, or :mod:`kvkeeper.weights.formats`
replaces matrices by packed blocks (``--quantization``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..errors import ModelFormatError, ModelNotFoundError
from ..layers.gguf_linear import GGUFWeight, rope_out_perm
from ..progress import track
from ..model_config import ModelConfig
from ..models.registry import model_class
from ..text.tokenizer import load_tokenizer
from .heap import release_free_heap
from . import dummy
from ..gguf_file import GGUFFile
from .sources import resolve_model_path

_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelWeights(dict):
    """HF-named float32 tensors, plus their origin: ``source`` "gguf" or "hf", ``path`` the file or folder,
    and for GGUF ``gguf_types`` (tensor name -> ggml type name, e.g. Q4_1) when known."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str, path: Path,
                 gguf_types: dict[str, str] | None = None):
        super().__init__(tensors)
        self.source, self.path, self.gguf_types = source, path, gguf_types


def _file_revision(path: Path) -> str:
    """A short content id of a weights file: sha256 of size, head and tail (fast on large files)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read())
    return h.hexdigest()[:16]


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of q/k rows (interleaved -> half-split RoPE layout).

    ``w``: (n_head * head_dim, ...).  llama.cpp stores q and k so that RoPE
    pairs adjacent dims; Hugging Face pairs dim i with i + head_dim/2.
    """
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_model_config(path: Path, reader: GGUFFile | None = None):
    """(ModelConfig, model family class, ``field(key, default)``) of a GGUF file from its metadata and tensor
    table alone (no tensor data is read; ``reader``: the file's :class:`GGUFFile`, read when None).
    Raises :class:`ModelFormatError` and :class:`UnsupportedArchitectureError` as :func:`load_gguf`."""
    reader = reader if reader is not None else GGUFFile.open(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    arch_name = field("general.architecture")
    if arch_name is None:
        raise ModelFormatError(f"{path} has no general.architecture metadata; is it a GGUF model file?")
    arch = ModelConfig.check_architecture(arch_name)
    p = arch_name
    n_heads = int(field(f"{p}.attention.head_count"))
    n_kv = int(field(f"{p}.attention.head_count_kv", n_heads))
    hidden = int(field(f"{p}.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    vocab = field(f"{p}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    stype = field(f"{p}.rope.scaling.type")
    if stype and stype not in ("none",):
        rope_scaling = {"rope_type": stype, "factor": float(field(f"{p}.rope.scaling.factor", 1.0))}
        if stype == "yarn":
            rope_scaling["original_max_position_embeddings"] = int(
                field(f"{p}.rope.scaling.original_context_length", field(f"{p}.context_length"))
            )
    eos = field("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field(f"{p}.feed_forward_length", 0)),  # (a missing one: a shape error later)
        num_layers=int(field(f"{p}.block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(field(f"{p}.attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(field(f"{p}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{p}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(field(f"{p}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        revision=_file_revision(path),
    )
    family = model_class(arch)  # its GGUF names and conventions (kvkeeper.models)
    family.gguf_config(cfg, field, p, reader)
    return cfg, family, field


def load_gguf(path: Path, in_place: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """Read a GGUF file (its header with :class:`~kvkeeper.gguf_file.GGUFFile`) and dequantise every
    tensor to float32 with the ``gguf`` package.

    in_place: keep every 2-D matrix that is not F32 (projections, embedding, LM head) of a file whose family has
    ``capabilities.gguf_in_place`` (Llama, Qwen2, Qwen3, Qwen3-MoE, Phi-3) as a
    :class:`~kvkeeper.layers.gguf_linear.GGUFWeight` over the file's memory map instead (no copy; q/k get the
    RoPE permutation as an output-column index); only norms, biases, F32 tensors and 3-D tensors (Qwen3-MoE's
    stacked experts) are read into memory.  With in_place, a file of another family (Gemma 3, DeepSeek) returns
    None before any tensor is read (the caller loads it dequantized, :func:`load_weights`).
    Raises :class:`ModelFormatError` for an unreadable or truncated file and
    :class:`UnsupportedArchitectureError` for an architecture we do not implement.
    """
    import gguf

    reader = GGUFFile.open(path)  # the header only (raises ModelFormatError); tensor data stays in the file's map
    cfg, family, field = gguf_model_config(path, reader)
    p = field("general.architecture")
    n_heads = int(field(f"{p}.attention.head_count"))
    n_kv = int(field(f"{p}.attention.head_count_kv", n_heads))
    tensors = {t.name: t for t in reader.tensors}
    layer_names, permuted = family.gguf_layer_names, family.capabilities.gguf_permuted_qk
    state = ModelWeights({}, "gguf", path, {name: t.tensor_type.name for name, t in tensors.items()})
    if in_place and not family.capabilities.gguf_in_place:
        return None
    try:
        for name, t in track(tensors.items(), f"dequantise {path.name}", total=len(tensors)):
            if in_place and len(t.shape) == 2 and t.tensor_type.name != "F32":
                hf = _in_place_name(name, layer_names)
                if hf is not None:
                    state[hf] = _mapped(t, name, n_heads, n_kv, permuted)
                    continue
            arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            if name in _GGUF_TOP_NAMES:
                hf = _GGUF_TOP_NAMES[name]
            else:
                parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
                if name == "rope_freqs.weight":
                    cfg.rope_freq_factors = [float(x) for x in arr.reshape(-1)]
                    continue
                if parts[0] != "blk" or parts[2] not in layer_names:
                    continue
                hf = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
                if permuted and parts[2] in ("attn_q", "attn_k"):
                    arr = _unpermute_rope(arr, n_heads if parts[2] == "attn_q" else n_kv)
            if family.gguf_norm_offset and name.endswith("norm.weight"):
                arr = arr + family.gguf_norm_offset  # e.g. Gemma 3's 1 + weight back to transformers' weight
            state[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    except Exception as e:
        raise ModelFormatError(f"{path}: could not read tensor data ({type(e).__name__}: {e}); the file may be truncated") from e
    return cfg, state


def _in_place_name(name: str, layer_names: dict[str, str]) -> str | None:
    """The HF name of a GGUF matrix the model multiplies by (projection, embedding, LM head), else None."""
    if name in ("token_embd.weight", "output.weight"):
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.weight"
    return None


def _mapped(t, name: str, n_heads: int, n_kv: int, permuted: bool):
    """A GGUF reader tensor as a GGUFWeight over the memmap (permuted q/k: the RoPE permutation undone on the
    output columns)."""
    perm = None
    kind = name.split(".")[2] if name.startswith("blk.") else ""
    if permuted and kind in ("attn_q", "attn_k"):
        perm = rope_out_perm(int(t.shape[1]), n_heads if kind == "attn_q" else n_kv)
    return GGUFWeight.from_reader_tensor(t, perm)


def load_hf_config(path: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's ``config.json``; raises :class:`ModelFormatError` when it is
    missing or not valid JSON."""
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelFormatError(f"{path} is a folder without config.json; a Hugging Face model folder needs config.json plus *.safetensors")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{cfg_path} is not valid JSON: {e}") from e
    return ModelConfig.from_hf_dict(raw)


def load_hf_folder(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read ``config.json`` and every ``*.safetensors`` file of a Hugging Face folder.

    Raises :class:`ModelFormatError` when either is missing or unreadable.
    """
    from safetensors.torch import load_file

    cfg_path = path / "config.json"
    cfg = load_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():  # only the shards it names (Mistral folders also ship consolidated.safetensors)
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelFormatError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from e
        files = [path / n for n in sorted(names)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelFormatError(f"{path}: shards named in {index.name} are missing: {', '.join(missing)}")
    if not files:
        raise ModelFormatError(f"{path} has config.json but no *.safetensors weight files")
    state: dict[str, torch.Tensor] = {}
    h = hashlib.sha256(cfg_path.read_bytes())
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:
            raise ModelFormatError(f"{f} is not a readable safetensors file ({type(e).__name__}: {e})") from e
        h.update(_file_revision(f).encode())
    cfg.revision = h.hexdigest()[:16]
    cfg.eos_token_ids += [t for t in _generation_eos(path) if t not in cfg.eos_token_ids]
    if "model.embed_tokens.weight" not in state:
        raise ModelFormatError(f"{path}: weights lack model.embed_tokens.weight; is this a Llama-family checkpoint?")
    if "lm_head.weight" not in state:
        cfg.tie_word_embeddings = True
    return cfg, ModelWeights({k: v.float() for k, v in state.items()}, "hf", path)


def _generation_eos(path: Path) -> list[int]:
    """The ``eos_token_id`` (int or list) of a folder's ``generation_config.json``, which transformers'
    ``generate`` stops at (Phi-3 instruct lists ``<|end|>`` there, not in config.json); [] without one or when
    it is unreadable."""
    try:
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return [int(t) for t in eos if isinstance(t, int)]


def _cached_gguf(path: Path, cache=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """GGUF weights, dequantised once and kept as safetensors under the kvkeeper cache folder.

    The cache is keyed by the file's content id; a damaged cache file is rebuilt.  Processes that start on the same
    file at once (the replicas of ``serve --replicas``, a test run's workers) build it once: one dequantises and
    writes while the others wait on a lock file beside the cache file, then read it.
    """
    import dataclasses
    import logging
    import os

    from safetensors.torch import save_file

    from ..text.tokenizer import cache_dir

    rev = _file_revision(path)
    folder = cache_dir(cache) / "weights"
    st_path, cfg_path = folder / f"{rev}.safetensors", folder / f"{rev}.json"
    types_path = folder / f"{rev}.types.json"
    got = _read_cached_gguf(path, st_path, cfg_path, types_path)
    if got is not None:
        return got
    with _exclusive(st_path):
        got = _read_cached_gguf(path, st_path, cfg_path, types_path)  # built while this process waited
        if got is not None:
            return got
        cfg, state = load_gguf(path)
        try:
            tmp = st_path.with_name(f"{st_path.name}.tmp{os.getpid()}")
            save_file(state, str(tmp))
            os.replace(tmp, st_path)
            tmp = cfg_path.with_name(f"{cfg_path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(dataclasses.asdict(cfg)))
            os.replace(tmp, cfg_path)
            _write_json(types_path, state.gguf_types)
        except OSError as e:  # the cache is an optimisation only
            logging.getLogger(__name__).warning("could not cache dequantised weights: %s", e)
    return cfg, state


def _read_cached_gguf(path: Path, st_path: Path, cfg_path: Path, types_path: Path):
    """(config, weights) from the dequantised cache of ``path``, or None when it is missing or unreadable."""
    import logging

    from safetensors.torch import load_file

    if not (st_path.exists() and cfg_path.exists()):
        return None
    try:
        cfg = ModelConfig(**json.loads(cfg_path.read_text()))
        if types_path.exists():
            types = json.loads(types_path.read_text())
        else:  # a cache written before the types were kept
            types = {t.name: t.tensor_type.name for t in GGUFFile(path).tensors}
            _write_json(types_path, types)
        return cfg, ModelWeights(load_file(str(st_path)), "gguf", path, types)
    except Exception as e:  # rebuilt by the caller
        logging.getLogger(__name__).warning("weights cache %s unreadable (%s); rebuilding", st_path, e)
        return None


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Held by one process at a time: ``filelock``'s lock on ``<path>.lock`` (the folder made if missing).  Where
    the folder cannot be written nothing is held: each process then builds for itself, as before the lock."""
    from filelock import FileLock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{path}.lock")
        lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _write_json(path: Path, obj) -> None:
    import os

    try:
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)
    except OSError:  # the cache is an optimisation only
        pass


def load_weights(path: Path, cache=None, in_place: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dispatch on the path: a folder is a Hugging Face checkpoint, a file must be GGUF.

    GGUF weights are dequantised once and cached under ``cache`` (a folder; default
    :func:`kvkeeper.text.tokenizer.cache_dir`; see :func:`_cached_gguf`); with ``in_place`` their matrices
    stay mapped instead (:func:`load_gguf`; nothing is cached; :func:`kvkeeper.weights.formats.prepare_weights`
    dequantizes them when the format needs float weights).
    """
    if not path.exists():
        raise ModelNotFoundError(f"no model file or folder at {path}")
    if path.is_dir():
        return load_hf_folder(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF'); pass a .gguf file or a Hugging Face folder")
    got = load_gguf(path, in_place=True) if in_place else None
    return got if got is not None else _cached_gguf(path, cache)


def load_model(model: str, load_format: str = "auto", cache=None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", seed: int = 0, in_place: bool = False):
    """(model config, state dict, tokenizer, model path) of a known model id or a path.

    load_format "dummy": random weights of a shipped config's shapes (:mod:`kvkeeper.weights.dummy`), made
    on ``device`` in ``dtype`` from ``seed``; "auto": the model's files (:func:`load_weights`, tokenizer from
    :func:`kvkeeper.text.tokenizer.load_tokenizer`).  Raises ModelNotFoundError, ModelFormatError and
    UnsupportedArchitectureError.  in_place: GGUF matrices stay mapped (:func:`load_weights`).
    """
    if load_format == "dummy":
        cfg, path = dummy.load_config(model)
        return cfg, dummy.dummy_state(cfg, dtype, device, seed=seed), dummy.load_dummy_tokenizer(path, cfg.vocab_size), path
    path = resolve_model_path(model, cache)
    cfg, state = load_weights(path, cache, in_place)  # first, so a bad weights file is what an error names
    release_free_heap()
    tokenizer = load_tokenizer(path, cache, lazy=True)
    release_free_heap()  # the tokenizer parse's freed heap (about 290 MB for Gemma 3's) given back
    return cfg, state, tokenizer, path
