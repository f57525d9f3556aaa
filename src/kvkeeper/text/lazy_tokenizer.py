"""A tokenizer folder's ``tokenizer.json`` run by the ``tokenizers`` library, with transformers imported only when
a caller needs more than tokens.

Importing transformers and building its tokenizer takes 1-2.5 s of a start of about 2 s; encoding and decoding
are the ``tokenizers`` library's in both cases (transformers' fast tokenizer wraps the same ``Tokenizer`` built
from the same ``tokenizer.json``).  :class:`LazyTokenizer` answers ``encode``, ``decode``, ``convert_ids_to_tokens``,
``convert_tokens_to_ids``, the special tokens and their ids, ``len()``, ``backend_tokenizer``, ``init_kwargs`` and
``chat_template`` itself, and hands every other attribute (``apply_chat_template``, ``save_pretrained``,
``all_special_ids``...) to the transformers tokenizer of the same folder, loaded on first use.  So a
chat template is always rendered by transformers, the reference.

Only folders whose ``tokenizer_config.json`` asks for nothing transformers would add on top of
``tokenizer.json`` qualify (:func:`qualifies`: the generic fast tokenizer class, no ``add_bos_token`` /
``add_eos_token`` rewriting the post-processor, no space clean-up on decode except a BPE model's, which
transformers skips); for the others :func:`kvkeeper.text.tokenizer.load_tokenizer` returns transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

__all__ = ["LazyTokenizer", "qualifies"]

_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")
_KNOWN_KEYS = {"backend", "is_local", "local_files_only", "model_max_length", "tokenizer_class", "bos_token",
               "eos_token", "unk_token", "pad_token", "clean_up_tokenization_spaces", "added_tokens_decoder",
               "extra_special_tokens", "additional_special_tokens"}
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _config(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None


def qualifies(folder: Path) -> bool:
    """Whether ``folder`` (a saved tokenizer: ``tokenizer.json`` + ``tokenizer_config.json``) is one that
    :class:`LazyTokenizer` runs exactly as transformers does (see the module docstring)."""
    cfg = _config(folder)
    if cfg is None or not (folder / "tokenizer.json").exists():
        return False
    if cfg.get("tokenizer_class") not in _GENERIC or set(cfg) - _KNOWN_KEYS:
        return False
    if cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens"):
        return False
    return all(isinstance(cfg.get(k), (str, type(None))) for k in _SPECIAL)


class LazyTokenizer:
    """The tokenizer of a folder that :func:`qualifies`: ``LazyTokenizer(folder, load_full)`` where
    ``load_full()`` returns transformers' tokenizer of the same folder (called once, on the first attribute this
    class does not answer itself).  Token ids are ints; text is str."""

    def __init__(self, folder: Path, load_full: Callable[[], Any]):
        from tokenizers import Tokenizer

        self._folder, self._load_full, self._full = Path(folder), load_full, None
        self.backend_tokenizer = Tokenizer.from_file(str(self._folder / "tokenizer.json"))
        cfg = _config(self._folder) or {}
        for name in _SPECIAL:
            setattr(self, name, cfg.get(name))
        template = self._folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.exists() else cfg.get("chat_template")
        self.name_or_path = str(self._folder)

    @classmethod
    def open(cls, folder: Path, load_full: Callable[[], Any]) -> "LazyTokenizer | None":
        """The folder's LazyTokenizer, or None when it does not :func:`qualify <qualifies>` or its model is not
        BPE while the config asks for space clean-up (which transformers applies to other models only)."""
        folder = Path(folder)
        if not qualifies(folder):
            return None
        tok = cls(folder, load_full)
        clean = (_config(folder) or {}).get("clean_up_tokenization_spaces")
        if clean is not False and type(tok.backend_tokenizer.model).__name__ != "BPE":
            return None
        return tok

    @property
    def init_kwargs(self) -> dict:
        """The folder's ``tokenizer_config.json`` fields (what transformers' ``init_kwargs`` holds, read without
        loading transformers)."""
        return _config(self._folder) or {}

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token_id = property(lambda self: self._id(self.bos_token), doc="The BOS token's id (None: none).")
    eos_token_id = property(lambda self: self._id(self.eos_token), doc="The EOS token's id (None: none).")
    unk_token_id = property(lambda self: self._id(self.unk_token), doc="The unknown token's id (None: none).")
    pad_token_id = property(lambda self: self._id(self.pad_token), doc="The padding token's id (None: none).")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens``: the post-processor's, e.g. a BOS)."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (an int or a sequence of ints)."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        """The token string of an id (None for an id outside the vocabulary), or a list of them for a list."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        """The id of a token string (the unknown token's id for one not in the vocabulary), or a list of them."""
        if isinstance(tokens, str):
            got = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if got is None else got
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def full(self):
        """transformers' tokenizer of the same folder (imported and loaded on first use)."""
        if self._full is None:
            self._full = self._load_full()
        return self._full

    def __getattr__(self, name: str):
        if name.startswith("_"):  # (copy / pickle probe dunders; our own fields are set in __init__)
            raise AttributeError(name)
        return getattr(self.full, name)

    def __repr__(self) -> str:
        return f"LazyTokenizer({self.name_or_path!r}, vocab={len(self)})"
