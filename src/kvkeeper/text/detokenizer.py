"""Turn generated token ids, one at a time, into safe text deltas.

The engine samples one token id per step; a client streaming the answer wants
text.  Two things make "decode the new token" wrong:

* **Split characters.**  A byte-level BPE tokenizer (GPT-2 style, as in
  SmolLM2) may cut one UTF-8 character (an emoji, a CJK character) into several
  tokens.  Decoding such a token alone gives U+FFFD replacement characters.
  :class:`IncrementalDetokenizer` holds those bytes back until the character is
  complete.
* **Stop strings.**  A stop string may span several tokens or sit in the middle
  of one token.  No part of a stop string, and nothing after it, may reach the
  client.  The detokenizer holds back the longest tail of the text that could
  still turn out to be the start of a stop string, and cuts the text at a stop
  string once one appears.

Decoding uses a sliding window of tokens (the ``prefix_offset`` /
``read_offset`` scheme of vLLM and Hugging Face's ``TextStreamer``): each step
decodes only the tokens since the last emitted chunk plus that chunk as left
context, so the cost per token does not grow with the length of the answer.

Units: every offset and length here counts Python ``str`` characters (code
points), except ``*_offset`` attributes, which count tokens.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ..errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens are decoded as left context of the first window.  Some
# tokenizers (SentencePiece) decode a word-initial token differently at the very
# start of a sequence; a few tokens of context make the first generated token
# decode as it would in the middle of the text.  Same value as vLLM.
PROMPT_CONTEXT_TOKENS = 5


def _validate_stop(stop: Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        raise InvalidRequestError(
            f"stop must be a list of strings, not a single string ({stop!r}); pass [{stop!r}]"
        )
    out: list[str] = []
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise InvalidRequestError(f"stop[{i}] must be a string, got {type(s).__name__} {s!r}")
        if s == "":
            raise InvalidRequestError(
                f"stop[{i}] is an empty string, which would match before any text; "
                "remove it or give a non-empty stop string"
            )
        if s not in out:
            out.append(s)
    return out


class IncrementalDetokenizer:
    """Incremental, UTF-8-safe, stop-string-aware detokenizer for one answer.

    Args:
        tokenizer: a ``transformers`` tokenizer (anything with
            ``decode(ids, skip_special_tokens=...)``).
        prompt_token_ids: the prompt's ids.  Only the last
            :data:`PROMPT_CONTEXT_TOKENS` of them are used, as left context for
            decoding; they never appear in the output.  The context is ignored
            when it does not decode to clean text (it ends inside a character).
            With a byte-level BPE tokenizer the context changes nothing; with a
            SentencePiece tokenizer it keeps the leading space of the first
            generated word, which ``tokenizer.decode(generated_ids)`` alone
            would strip.
        stop: stop strings.  Generation is over as soon as the text contains one
            of them.  Each must be a non-empty ``str``; an empty string, a
            non-string, or a bare ``str`` instead of a list raises
            :class:`~kvkeeper.errors.InvalidRequestError` (a ``ValueError``).
        skip_special_tokens: passed to ``tokenizer.decode``; when true, special
            tokens (``<|im_end|>``...) produce no text.

    Attributes:
        text: everything emitted so far (the concatenation of all returned deltas).
        stopped: true once a stop string has been matched.
        stop_string: the matched stop string, else ``None``.
        token_ids: every id passed to :meth:`add`, including ones after a stop.
        finished: true once :meth:`flush` has run.

    Guarantees, for a tokenizer whose windowed decodes concatenate to the full
    decode (true of byte-level BPE; vLLM relies on the same property):

    * no delta contains U+FFFD produced by a character split across tokens (a
      U+FFFD the tokens really encode, or bytes that are invalid UTF-8 whatever
      follows, are emitted as ``tokenizer.decode`` would show them);
    * the emitted text is only ever appended to, never retracted;
    * after :meth:`flush`, ``text`` equals ``tokenizer.decode(token_ids,
      skip_special_tokens=...)`` cut just before the first stop string, or the
      whole decode when no stop string occurs (up to the incomplete-tail rule
      of :meth:`flush`).

    Which stop string wins: the text is cut at the stop string occurrence that
    *ends* first (generation would have stopped there); among occurrences ending
    at the same place the one starting first wins.  With one stop string this is
    simply its first occurrence.  Example: stops ``["abcd", "bc"]`` on text
    ``"abcd"`` give ``"a"``, because ``"bc"`` is complete before ``"abcd"``.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int] | None = None,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop: list[str] = _validate_stop(stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None
        self.token_ids: list[int] = []
        self.finished = False

        # _ids = left context (tail of the prompt) + generated ids.  Tokens
        # _ids[_prefix_offset:_read_offset] decode to _prefix_text, text that
        # has already been turned into a delta; tokens from _read_offset on are
        # held because their text ends inside a character.
        context = [operator.index(t) for t in (prompt_token_ids or [])][-PROMPT_CONTEXT_TOKENS:]
        context_text = self._decode(context) if context else ""
        if REPLACEMENT_CHAR in context_text:
            context, context_text = [], ""
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text
        # Decoded text not yet emitted: a tail that may start a stop string.
        self._pending = ""

    # -- public API ---------------------------------------------------------

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text that is now safe (maybe ``""``).

        Holds back (1) the bytes of an incomplete UTF-8 character and (2) the
        longest tail of the text that is the beginning of a stop string.  When
        a stop string is matched, sets :attr:`stopped` and :attr:`stop_string`
        and returns only the text before it; every later call returns ``""``.

        Raises ``TypeError`` when ``token_id`` is not an integer and
        ``RuntimeError`` when called after :meth:`flush`.
        """
        token_id = operator.index(token_id)
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.add() called after flush(); make a new detokenizer")
        self.token_ids.append(token_id)
        if self.stopped:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # No new text yet (special token, or bytes of a character still
            # incomplete): keep the tokens and decode them again next time.
            return ""
        piece = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._release(piece, final=False)

    def flush(self) -> str:
        """End of generation (EOS or max_tokens): return the held-back text, now final.

        Text held because it might begin a stop string is released (the stop
        string never came).  Bytes of a character that is still incomplete at
        the very end are **dropped**: the last U+FFFD the tokenizer would show
        for them is removed, so the answer never ends in a replacement
        character made by a truncated character.  (A genuine U+FFFD that the
        model generated as the very last character is dropped too.)  Calling
        ``flush`` again, or after a stop, returns ``""``.
        """
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        piece = ""
        if self._read_offset < len(self._ids):
            new_text = self._decode(self._ids[self._prefix_offset :])
            piece = new_text[len(self._prefix_text) :]
            if piece.endswith(REPLACEMENT_CHAR):
                piece = piece[:-1]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = ""
        return self._release(piece, final=True)

    # -- internals ----------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, piece: str, *, final: bool) -> str:
        """Add decoded text to the pending tail; emit what no stop string can claim."""
        pending = self._pending + piece
        if not self.stop:
            self._pending = ""
            return self._emit(pending)

        match = self._find_stop(pending)
        if match is not None:
            start, s = match
            self.stopped = True
            self.stop_string = s
            self._pending = ""
            return self._emit(pending[:start])

        keep = 0 if final else self._stop_prefix_len(pending)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep])

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop occurrence in ``text`` that ends first (then starts first)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                cand = (i + len(s), i, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _emit(self, delta: str) -> str:
        self.text += delta
        return delta
