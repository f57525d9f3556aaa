"""``--load-format dummy``: random weights of a named Hugging Face config, for measuring speed without weight files.

The package ships a few ``config.json`` files of common shapes under ``kvkeeper/weights/configs/``
(``llama-3.1-8b``, ``llama-3-8b``, ``qwen2.5-7b``, ``deepseek-v2-lite``, ``deepseek-v3``); any path to a ``config.json`` (or a folder
holding one) works too.  Nothing is downloaded.  The config goes through the same parser as a real
Hugging Face folder (:meth:`ModelConfig.from_hf_dict`).

Weights are drawn from N(0, ``std``^2) (``std`` 0.02, the usual ``initializer_range``) with a
seeded generator, directly on the target device and in the target dtype (an 8B model in bf16 is
16 GB: it is never materialised in fp32 or on the host); RMSNorm weights are ones.  q/k/v and
gate/up are generated already fused, as the model holds them.  The tokenizer is the folder's own
when it has one, else :class:`DummyTokenizer` (bytes and ``<id>`` strings), enough for token-id
prompts and benchmarks.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import ModelFormatError, ModelNotFoundError
from ..model_config import ModelConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def known_configs() -> list[str]:
    """Names of the shipped configs (file stems under kvkeeper/weights/configs)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def resolve_config(name_or_path: str) -> Path:
    """The config.json for a shipped name or a path (a JSON file or a folder with config.json).

    Raises :class:`ModelNotFoundError` listing the shipped names when neither exists.
    """
    key = str(name_or_path).lower().removesuffix(".json")
    if (CONFIG_DIR / f"{key}.json").exists():
        return CONFIG_DIR / f"{key}.json"
    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p / "config.json"
    if p.is_file():
        return p
    raise ModelNotFoundError(
        f"--load-format dummy needs a config: {name_or_path!r} is neither a shipped config name "
        f"({', '.join(known_configs())}) nor a config.json file or a folder holding one"
    )


def load_config(name_or_path: str) -> tuple[ModelConfig, Path]:
    """Parse a dummy config; its revision is ``dummy-<sha256 of the file>`` (a KV namespace of its own)."""
    path = resolve_config(name_or_path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from e
    cfg = ModelConfig.from_hf_dict(raw)
    cfg.revision = "dummy-" + hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return cfg, path


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the model's parameters (fused q/k/v and gate/up), built on the meta device."""
    from ..models.registry import causal_lm_class
    from ..models.llama import skip_init

    with skip_init(), torch.device("meta"):
        model = causal_lm_class(cfg)(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def parameter_count(cfg: ModelConfig) -> int:
    """Number of weights of the model (nothing is allocated)."""
    n = 0
    for shape in parameter_shapes(cfg).values():
        k = 1
        for s in shape:
            k *= s
        n += k
    return n


def dummy_state(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A state dict with the model's own (fused) names: N(0, std^2) weights, ones for norms, biases zero.

    Generated on ``device`` in ``dtype`` with a generator seeded by ``seed`` (same seed, device and
    dtype: same weights).
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    state = {}
    for name, shape in parameter_shapes(cfg).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            state[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            t.normal_(0.0, std, generator=gen)
            state[name] = t
    return state


class DummyTokenizer:
    """A stand-in tokenizer for configs without tokenizer files.

    encode: the UTF-8 bytes of the text as ids 0..255; decode: ids below 256 as Latin-1 characters,
    others as ``<id>``.  No special tokens, no EOS; the chat template joins ``role: content`` lines.
    """

    eos_token_id = None
    bos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def _piece(self, i: int) -> str:
        return chr(i) if 0 <= i < 256 else f"<{i}>"

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self._piece(int(i)) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self._piece(int(i)) for i in ids] if isinstance(ids, (list, tuple)) else self._piece(int(ids))

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True, **kw):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text) if tokenize else text


def load_dummy_tokenizer(config_path: Path, vocab_size: int):
    """The folder's tokenizer when it ships tokenizer files, else a :class:`DummyTokenizer`."""
    folder = config_path.parent
    if folder != CONFIG_DIR and any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        from ..text.tokenizer import load_tokenizer

        return load_tokenizer(folder)
    return DummyTokenizer(vocab_size)
