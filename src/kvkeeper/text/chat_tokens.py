"""Chat prompts whose control tokens come only from the chat template, never from a message's text.

A chat template writes its turn markers (SmolLM2's ``<|im_start|>`` / ``<|im_end|>``) as text, and the tokenizer
turns every occurrence of a special token's text into its id.  Tokenizing the rendered text as is (what
transformers' ``apply_chat_template(tokenize=True)`` and vLLM do) therefore turns a user's ``<|im_end|>`` typed in
a message into a real end of turn: any client can forge a system or assistant turn.

Here the rendered text comes with the character spans of the messages' contents (:func:`render_with_spans`: the
template rendered a second time with a unique marker in place of each content, so the spans are the template's own
placement of them), and :class:`ChatEncoder` tokenizes it once as the tokenizer does; when no special token of that
tokenization overlaps a content span the ids are exactly the tokenizer's (so exactly ``apply_chat_template``'s).
Otherwise the text between the template's own special tokens is tokenized again with special tokens treated as
plain text (the ``tokenizers`` library's ``encode_special_tokens``, transformers' ``split_special_tokens``): a
typed ``<|im_end|>`` becomes the tokens of the characters ``<``, ``|``, ``im``, ...

A template that changes a content before writing it (one that trims it, say) is matched with the trimmed content;
when the spans cannot be found at all, a content holding a special token's text is refused
(:class:`~kvkeeper.errors.InvalidRequestError`) rather than tokenized into a control token.

Thread-safe: :class:`ChatEncoder` keeps its own ``tokenizers.Tokenizer`` copies, never changed after they are
built (the plain-text one on first need, under a lock), tokenizing through :func:`kvkeeper.text.gil_free.encode`,
without Python's GIL (the server tokenizes in worker threads).
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
import threading
from dataclasses import dataclass
from typing import Callable

from ..errors import InvalidRequestError
from .gil_free import encode

__all__ = ["ChatEncoder", "RenderedChat", "longest_token_bytes", "render_with_spans"]


@dataclass(frozen=True)
class RenderedChat:
    """A conversation as the chat template renders it.

    text: the template's text; spans: sorted, disjoint ``(start, end)`` character offsets of the messages'
    contents in ``text``; located: whether the spans were found (False: the template rewrote the contents in a
    way :func:`render_with_spans` could not follow; ``contents`` then holds them for the refusal check).
    """

    text: str
    spans: tuple[tuple[int, int], ...] = ()
    located: bool = True
    contents: tuple[str, ...] = ()


def _spans_of(marked: str, pattern: re.Pattern, contents: list[str], fit: Callable[[str], str]) -> tuple[str, list]:
    """The text of ``marked`` with every marker replaced by ``fit(content)``, and the spans of those contents."""
    out, spans, pos, n = [], [], 0, 0
    for m in pattern.finditer(marked):
        head = marked[pos:m.start()]
        body = fit(contents[int(m.group(1))])
        out += (head, body)
        n += len(head)
        if body:
            spans.append((n, n + len(body)))
        n += len(body)
        pos = m.end()
    out.append(marked[pos:])
    return "".join(out), spans


def render_with_spans(render: Callable[[list[dict]], str], messages: list[dict]) -> RenderedChat:
    """``render(messages)`` (the chat template's text) with the spans of the messages' contents in it.

    The spans come from ``render`` run again with a random marker in place of each string content; they are
    kept when putting the contents (or, for a template that trims them, the trimmed contents) in place of the
    markers gives exactly the first text.  Raises what ``render`` raises.
    """
    text = render(messages)
    contents = [m.get("content") if isinstance(m.get("content"), str) else "" for m in messages]
    if not any(contents):
        return RenderedChat(text)
    nonce = secrets.token_hex(6)
    pattern = re.compile("\ue000" + nonce + r"(\d+)\ue001")
    marked_msgs = [{**m, "content": f"\ue000{nonce}{i}\ue001"} if contents[i] else m for i, m in enumerate(messages)]
    try:
        marked = render(marked_msgs)
    except Exception:  # noqa: BLE001  (a template that inspects the content: spans unknown, checked below)
        marked = None
    if marked is not None:
        for fit in (lambda c: c, str.strip):
            rebuilt, spans = _spans_of(marked, pattern, contents, fit)
            if rebuilt == text:
                return RenderedChat(text, tuple(spans))
    return RenderedChat(text, (), False, tuple(c for c in contents if c))


class ChatEncoder:
    """Token ids of a :class:`RenderedChat` with control tokens only from the template (see the module doc).

    tokenizer: a fast tokenizer (transformers' or :class:`~kvkeeper.text.lazy_tokenizer.LazyTokenizer`) with a
    ``backend_tokenizer``; its special added tokens are the control tokens.  Token ids are ints.
    """

    def __init__(self, tokenizer):
        self._normal = _copy(tokenizer.backend_tokenizer.to_str())
        self._plain_copy = None  # built on first use (see _plain)
        self._lock = threading.Lock()
        added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.special_texts = tuple(sorted({t.content for t in added.values() if t.special}, key=len, reverse=True))

    @property
    def _plain(self):
        """The copy that splits special tokens' text as ordinary text, built when first needed (a content that
        writes a control token's text, :meth:`plain_ids`), from the normal copy (never changed, so read safely
        by several threads): a tokenizer's parse takes 1.8 s for Gemma 3's 262,144-token vocabulary, and most
        engines never need this one."""
        if self._plain_copy is None:
            with self._lock:
                if self._plain_copy is None:
                    plain = _copy(self._normal.to_str())
                    plain.encode_special_tokens = True  # special tokens' text is split as ordinary text
                    self._plain_copy = plain
        return self._plain_copy

    @classmethod
    def of(cls, tokenizer) -> "ChatEncoder | None":
        """The encoder of ``tokenizer``, or None for a tokenizer without a ``tokenizers`` backend (slow ones)."""
        return cls(tokenizer) if getattr(tokenizer, "backend_tokenizer", None) is not None else None

    def encode(self, rendered: RenderedChat, start: int = 0) -> list[int]:
        """The ids of ``rendered.text[start:]`` (no BOS/EOS added): the tokenizer's own where no special token
        falls inside a content span, else the template's special tokens around contents tokenized as plain text.

        Raises :class:`InvalidRequestError` when the spans are unknown and a content holds a special token's text.
        """
        text = rendered.text[start:]
        enc = encode(self._normal, text)
        if not rendered.located:
            self._refuse_unlocated(rendered)
            return list(enc.ids)
        spans = [(max(s - start, 0), e - start) for s, e in rendered.spans if e > start]
        starts = [s for s, _ in spans]
        ids = enc.ids
        marks = [k for k, i in enumerate(ids) if i in self.special_ids]  # the few special tokens' positions
        offsets = enc.offsets if marks and spans else []
        forged = [k for k in marks if offsets and _overlaps(spans, starts, *offsets[k])]
        if not forged:
            return ids
        return self._with_plain_contents(text, enc, set(forged))

    def _with_plain_contents(self, text: str, enc, forged: set[int]) -> list[int]:
        """Ids of ``text``: its template special tokens (those of ``enc`` not in ``forged``) as they are, the text
        between them tokenized with special tokens as plain text."""
        ids, pos = [], 0
        for k, (i, (a, b)) in enumerate(zip(enc.ids, enc.offsets)):
            if i not in self.special_ids or k in forged:
                continue
            if a > pos:
                ids += encode(self._plain, text[pos:a]).ids
            ids.append(i)
            pos = b
        if pos < len(text):
            ids += encode(self._plain, text[pos:]).ids
        return ids

    def _refuse_unlocated(self, rendered: RenderedChat) -> None:
        for c in rendered.contents:
            hit = next((s for s in self.special_texts if s in c), None)
            if hit is not None:
                raise InvalidRequestError(
                    f"a message's content holds the control token {hit!r}, and this model's chat template rewrites "
                    "contents so that the server cannot keep it as plain text: remove it from the message (or start "
                    "the server with --control-tokens-in-content to let contents write control tokens)",
                    param="messages")

    def plain_ids(self, text: str) -> list[int]:
        """``text``'s ids with special tokens' text tokenized as plain text (no BOS/EOS)."""
        return list(encode(self._plain, text).ids)



def _copy(spec: str):
    """A ``tokenizers.Tokenizer`` parsed from its JSON ``spec``, without padding or truncation."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(spec)
    tok.no_padding()
    tok.no_truncation()
    return tok


def _overlaps(spans: list[tuple[int, int]], starts: list[int], a: int, b: int) -> bool:
    """Whether ``[a, b)`` overlaps one of the sorted disjoint ``spans`` (``starts``: their start offsets)."""
    k = bisect.bisect_right(starts, a) - 1
    for s, e in spans[max(k, 0):k + 2]:
        if s < b and a < e:
            return True
    return False


def _never_shortens(normalizer: dict | None) -> bool:
    """Whether a ``tokenizer.json`` normalizer can only keep or lengthen a text's UTF-8 bytes (none, Prepend, a
    Replace by something at least as long, a Sequence of those)."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shortens(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pat = normalizer.get("pattern", {})
        return "String" in pat and len(normalizer.get("content", "").encode()) >= len(pat["String"].encode())
    return False


def longest_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes of input text one token of ``tokenizer`` can cover: its longest decoded token plus one
    (a decoder may drop a word-start space, e.g. Metaspace; an overestimate is safe); None when that proves nothing
    (no ``tokenizers`` backend, or a normalizer that may shorten the text before tokenizing)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _never_shortens(json.loads(backend.to_str()).get("normalizer")):
        return None
    n = backend.get_vocab_size(with_added_tokens=True)
    decoded = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return 1 + max((len(t.encode("utf-8", "replace")) for t in decoded), default=1)
