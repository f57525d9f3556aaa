"""Tokenizer and chat template, read from the same source as the weights.

A GGUF file carries its vocabulary, merges and chat template; transformers'
``AutoTokenizer`` converts them into a fast tokenizer.  The conversion takes a
few seconds, so the result is cached as a tokenizer folder under
``$KVKEEPER_CACHE`` (default ``~/.cache/kvkeeper``), keyed by the GGUF file's
size and modification time.  A Hugging Face folder is read directly.  The cache folder is
``EngineConfig.cache_dir`` (``--cache-dir``, whose default the CLI reads from ``$KVKEEPER_CACHE``),
else ``~/.cache/kvkeeper``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from ..errors import ModelFormatError
from .lazy_tokenizer import LazyTokenizer, qualifies, record_verification

log = logging.getLogger(__name__)


# Gemma's turn format (Gemma 3 model card): <start_of_turn>{user|model}\n{text}<end_of_turn>\n, the generation prompt
# "<start_of_turn>model\n".  Written here for GGUF files that carry no tokenizer.chat_template (the gemma-3-270m
# package's file has none).  Gemma has no system role, so a system message's text goes into a user turn:
# - after a user (or tool) turn: appended to that turn, which stays open until the next message (Claude Code sends
#   its environment as a system message after the first user message);
# - otherwise (first, or after a model turn): it opens the next user (or tool) turn, or, when a model turn or the
#   end comes first, is a user turn of its own.
# Either way nothing is dropped, and a conversation's prompt followed by the reply and "<end_of_turn>\n" is the
# prefix of the next request's prompt (the agent resends the conversation with the reply and new turns appended),
# which is what keeps a session's KV reusable (tests/unit/text/test_gemma_template.py).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set st = namespace(sys='', open=false) %}"
    "{% for m in messages %}"
    "{% set text = (m['content'] or '') | trim %}"
    "{% if m['role'] == 'system' %}"
    "{% if st.open %}{{ '\n\n' + text }}{% else %}{% set st.sys = st.sys + text + '\n\n' %}{% endif %}"
    "{% else %}"
    "{% if st.open %}<end_of_turn>\n{% set st.open = false %}{% endif %}"
    "{% if m['role'] == 'assistant' %}"
    "{% if st.sys %}{{ '<start_of_turn>user\n' + (st.sys | trim) }}<end_of_turn>\n{% set st.sys = '' %}{% endif %}"
    "{{ '<start_of_turn>model\n' + text }}<end_of_turn>\n"
    "{% else %}"
    "{{ '<start_of_turn>user\n' + st.sys + text }}{% set st.sys = '' %}{% set st.open = true %}"
    "{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if st.open %}<end_of_turn>\n{% endif %}"
    "{% if st.sys %}{{ '<start_of_turn>user\n' + (st.sys | trim) }}<end_of_turn>\n{% endif %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def cache_dir(folder: str | os.PathLike | None = None) -> Path:
    """kvkeeper's cache folder: ``folder`` when given, else ``~/.cache/kvkeeper``."""
    return Path(folder) if folder is not None else Path.home() / ".cache" / "kvkeeper"


_TEMPLATE_KEY = hashlib.sha256(GEMMA_CHAT_TEMPLATE.encode()).hexdigest()[:8]


def _gguf_key(path: Path) -> str:
    """The cache folder name of a GGUF file's tokenizer: a digest of what transformers converts it from (the
    ``tokenizer.*`` metadata and ``general.architecture``, as stored) and of the chat template this module writes
    into a conversion (a changed template makes a new conversion, not a stale cached one).  Files that carry the
    same tokenizer share one conversion wherever they are (the quantizations of one model; the suite's synthetic
    files, which carry SmolLM2's).  A file whose header kvkeeper cannot read is keyed by its path, size and
    modification time (transformers then says what is wrong with it)."""
    from ..gguf_file import GGUFFile

    try:
        content = GGUFFile.open(path).metadata_digest(("general.architecture",), ("tokenizer.",))
    except ModelFormatError:
        st = path.stat()
        content = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    return hashlib.sha256(f"{content}:{_TEMPLATE_KEY}".encode()).hexdigest()[:16]


_conversions: dict[str, Path] = {}  # key (_gguf_key) -> a cache folder holding its conversion, in this process


def _share_conversion(folder: Path) -> None:
    """One conversion per key in a process, whatever cache folders it is asked for: ``folder`` (``tokenizers/<key>``
    of some cache) is remembered when it holds the conversion, else filled with a copy of one remembered from
    another cache folder (a few files, against seconds of CPU for transformers' conversion)."""
    if (folder / "tokenizer_config.json").exists():
        _conversions.setdefault(folder.name, folder)
        return
    src = _conversions.get(folder.name)
    if src is None or not (src / "tokenizer_config.json").exists():
        return
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        shutil.copytree(src, tmp)
        if not folder.exists():
            os.replace(tmp, folder)
    except OSError as e:  # an optimisation only: the conversion below serves
        log.warning("could not copy the tokenizer conversion %s to %s: %s", src, folder, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(model_path: str | os.PathLike, cache: str | os.PathLike | None = None, *, lazy: bool = False):
    """Load the tokenizer (with its chat template) for a GGUF file or HF folder (cache: see :func:`cache_dir`).

    Returns a ``transformers`` fast tokenizer; with ``lazy``, a
    :class:`~kvkeeper.text.lazy_tokenizer.LazyTokenizer` over the same ``tokenizer.json`` where the folder (or
    the GGUF file's cached conversion) qualifies: transformers is then imported only for what the ``tokenizers``
    library does not answer (the chat template's rendering, ...).  Raises :class:`ModelFormatError`
    when the source holds no usable tokenizer.
    """
    path = Path(model_path)
    folder = path if path.is_dir() else cache_dir(cache) / "tokenizers" / _gguf_key(path)
    if not path.is_dir():
        _share_conversion(folder)
    lazy_got = _open_lazy(path, folder, cache) if lazy else None
    if lazy_got is not None:
        return lazy_got
    tok = _load_full(path, folder)
    if lazy and not path.is_dir() and (folder / "tokenizer_config.json").exists() and not qualifies(folder):
        try:  # a GGUF file's conversion, checked once: the next load reads it with the tokenizers library alone
            if record_verification(folder, tok):
                log.info("tokenizer %s: the tokenizers library alone gives transformers' tokens; later loads "
                         "skip transformers", folder)
                return LazyTokenizer(folder, lambda: tok)
        except Exception as e:  # noqa: BLE001  (an optimisation only: transformers' tokenizer serves)
            log.warning("tokenizer %s not verified for the tokenizers library (%s)", folder, e)
    return tok


def _open_lazy(path: Path, folder: Path, cache) -> LazyTokenizer | None:
    if not (folder / "tokenizer_config.json").exists():
        return None
    try:
        return LazyTokenizer.open(folder, lambda: load_tokenizer(path, cache))
    except Exception as e:  # noqa: BLE001  (an unreadable tokenizer.json: transformers says why below)
        log.warning("tokenizer %s not read by the tokenizers library (%s); using transformers", folder, e)
        return None


def _load_full(path: Path, folder: Path):
    """transformers' tokenizer of a folder, or of a GGUF file (its conversion cached in ``folder``)."""
    try:
        from transformers import AutoTokenizer

        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path))
        cached = folder
        if (cached / "tokenizer_config.json").exists():
            try:
                return AutoTokenizer.from_pretrained(str(cached))
            except Exception:  # a damaged cache is rebuilt below
                log.warning("tokenizer cache %s unreadable; rebuilding", cached)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if not tok.chat_template and tok.convert_tokens_to_ids("<start_of_turn>") not in (None, tok.unk_token_id):
            tok.chat_template = GEMMA_CHAT_TEMPLATE  # a Gemma GGUF without tokenizer.chat_template
        try:
            tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
            tok.save_pretrained(str(tmp))
            os.replace(tmp, cached) if not cached.exists() else None
            _conversions.setdefault(cached.name, cached)
        except OSError as e:  # cache is an optimisation only
            log.warning("could not cache tokenizer: %s", e)
        return tok
    except Exception as e:  # transformers raises many kinds
        raise ModelFormatError(
            f"could not read a tokenizer from {path}: {e}. A GGUF file must carry tokenizer.ggml.* "
            "metadata; a Hugging Face folder needs tokenizer.json or tokenizer.model plus tokenizer_config.json"
        ) from e
