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
transformers skips); for the others :func:`kvkeeper.text.tokenizer.load_tokenizer` returns transformers'.  A folder kvkeeper wrote
itself (a GGUF file's cached conversion) also qualifies once :func:`record_verification` has compared the two on
the folder's own vocabulary and probe texts and found them equal, for the installed versions of both libraries
(``kvkeeper-tokenizers-verified.json`` in the folder records that): Gemma's ``GemmaTokenizer`` is such a class.

``apply_chat_template(..., tokenize=False)`` with a single string template renders through transformers'
own ``render_jinja_template`` (the function its tokenizers call), which needs no tokenizer built; any other call
goes to the full tokenizer.
"""

from __future__ import annotations

import functools
import json
import random
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from .gil_free import encode

__all__ = ["LazyTokenizer", "qualifies", "record_verification", "verify"]

_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")
_KNOWN_KEYS = {"backend", "is_local", "local_files_only", "model_max_length", "tokenizer_class", "bos_token",
               "eos_token", "unk_token", "pad_token", "clean_up_tokenization_spaces", "added_tokens_decoder",
               "extra_special_tokens", "additional_special_tokens"}
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: what its ``special_tokens_map`` (the chat template's variables) holds
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MARKER = "kvkeeper-tokenizers-verified.json"


def _config(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    return {lib: metadata.version(lib) for lib in ("tokenizers", "transformers")}


def _verified(folder: Path) -> bool:
    try:
        rec = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(rec, dict) and rec.get("mismatches") == [] and rec.get("versions") == _versions()


def qualifies(folder: Path) -> bool:
    """Whether ``folder`` (a saved tokenizer: ``tokenizer.json`` + ``tokenizer_config.json``) is one that
    :class:`LazyTokenizer` runs exactly as transformers does (see the module docstring)."""
    cfg = _config(folder)
    if cfg is None or not (folder / "tokenizer.json").exists():
        return False
    if _verified(folder):
        return True
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
        self.special_tokens_map = {k: cfg[k] for k in _NAMED if isinstance(cfg.get(k), str)}
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
        if clean is not False and type(tok.backend_tokenizer.model).__name__ != "BPE" and not _verified(folder):
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
        """Token ids of ``text`` (``add_special_tokens``: the post-processor's, e.g. a BOS), computed without holding
        Python's GIL (:func:`kvkeeper.text.gil_free.encode`)."""
        return encode(self.backend_tokenizer, text, add_special_tokens).ids

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

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, **kwargs):
        """transformers' ``apply_chat_template``.  With ``tokenize=False``, one conversation (a list of message
        dicts) and a single string template, the text comes from transformers' ``render_jinja_template`` with the
        same inputs transformers' tokenizer gives it (messages without None-valued keys, ``special_tokens_map``
        and ``kwargs`` as template variables), so no transformers tokenizer is built; anything else is the full
        tokenizer's call.  Raises ValueError for an empty conversation or ``continue_final_message`` with
        ``add_generation_prompt``, and jinja2's errors when the template rejects the conversation."""
        template = chat_template if chat_template is not None else self.chat_template
        own = {"padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
               "return_assistant_tokens_mask", "sanitize_control_tokens"}
        single = isinstance(conversation, (list, tuple)) and not (
            conversation and (isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")))
        if tokenize or not isinstance(self.chat_template, (str, type(None))) or not isinstance(template, str) \
                or not single or own & set(kwargs):
            return self.full.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, **kwargs)
        from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(conversation)], tools=tools, documents=documents,
            chat_template=template, continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        return rendered[0]

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


# Probe texts for :func:`verify`: words, spacing, numbers, code, scripts that need byte fallback, the markup of
# chat formats (typed as text), and empty input.
_PROBES = (
    "", " ", "  ", "\n", "\n\n\t", "Hello", " Hello", "Hello  world", "hello world\n", "Hello, world! How are you?",
    "The quick brown fox jumps over the lazy dog.", "  leading and trailing  ", "tabs\tand\nnewlines\r\n",
    "3.14159 2,048 1e-5 0x1F -42 100%", "def f(x):\n    return x ** 2  # square\n", "{\"key\": [1, 2, null]}",
    "naïve café résumé Ærøskøbing", "Привет, мир", "こんにちは世界", "你好，世界", "안녕하세요", "مرحبا بالعالم",
    "שלום", "🙂🚀👍🏽 emoji", "\u200b\u00a0\ufeff zero width", "a\u0301 combining", "<|im_start|>user\nhi<|im_end|>",
    "<start_of_turn>model\nok<end_of_turn>", "<bos><eos><pad><unk>", "</s><s>", "ǅungla Ⅻ ﬁ ½",
    "https://example.com/a?b=c&d=e", "C:\\path\\to\\file.txt", "----====****", "x" * 300, "word " * 80,
)


def _probe_texts(lazy: "LazyTokenizer", rng: random.Random, n_vocab: int) -> list[str]:
    """The fixed probes, each added token inside text, and the texts of 2,000 vocabulary entries drawn by ``rng``."""
    vocab = lazy.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    added = [t.content for t in lazy.backend_tokenizer.get_added_tokens_decoder().values()]
    texts = list(_PROBES) + [f"see {a} here" for a in added[:200]] + [f"{a}{a} x" for a in added[-50:]]
    ids = rng.sample(range(vocab), min(n_vocab, vocab))
    return texts + [lazy.decode([i]) for i in ids] + [" " + lazy.decode(ids[j:j + 7]) for j in range(0, len(ids), 7)]


def verify(lazy: "LazyTokenizer", full, *, seed: int = 0, n_vocab: int = 2000) -> list[str]:
    """Where ``lazy`` and transformers' tokenizer ``full`` of the same folder differ: the first 20 differences
    (empty: none found) over encode (with and without special tokens), decode (with and without skipping them),
    every id's token string, the special tokens and their ids, the vocabulary size, ``special_tokens_map`` and
    chat templates rendered both ways.  Deterministic for a ``seed``."""
    rng, out = random.Random(seed), []

    def check(what, a, b):
        if a != b and len(out) < 20:
            out.append(f"{what}: {a!r:.120} != {b!r:.120}")

    for name in _SPECIAL + ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "special_tokens_map"):
        check(name, getattr(lazy, name), getattr(full, name))
    check("len", len(lazy), len(full))
    n = len(lazy)
    check("tokens", lazy.convert_ids_to_tokens(list(range(n))), full.convert_ids_to_tokens(list(range(n))))
    for text in _probe_texts(lazy, rng, n_vocab):
        for special in (True, False):
            ids = lazy.encode(text, add_special_tokens=special)
            check(f"encode({text!r:.40}, {special})", ids, full.encode(text, add_special_tokens=special))
            check(f"decode({ids!r:.40}, {special})", lazy.decode(ids, skip_special_tokens=special),
                  full.decode(ids, skip_special_tokens=special))
    for _ in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            check(f"decode({ids}, {skip})", lazy.decode(ids, skip_special_tokens=skip),
                  full.decode(ids, skip_special_tokens=skip))
    if isinstance(full.chat_template, str):
        for msgs, gen in _CHATS:
            check(f"chat({msgs!r:.40})", lazy.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen),
                  full.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))
    return out


_CHATS = (
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there\n"},
      {"role": "assistant", "content": "Hello. "}, {"role": "user", "content": "Bye"}], True),
    ([{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "a story", "tool_calls": None}], False),
)


def record_verification(folder: Path, full) -> bool:
    """Compare :class:`LazyTokenizer` on ``folder`` with transformers' tokenizer ``full`` of it (:func:`verify`) and
    write the result to ``folder / MARKER`` (a folder kvkeeper owns: a GGUF file's cached conversion), keyed by the
    installed tokenizers and transformers versions.  True when they are equal.  Raises OSError when the folder
    cannot be written."""
    folder = Path(folder)
    diffs = verify(LazyTokenizer(folder, lambda: full), full)
    (folder / MARKER).write_text(json.dumps({"versions": _versions(), "mismatches": diffs}, indent=1))
    return not diffs
