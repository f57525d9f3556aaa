"""Token strings and bytes for OpenAI-style logprobs.

A byte-level BPE token (GPT-2 style, as in SmolLM2) may hold part of a UTF-8
character, so its exact bytes come from the byte-to-unicode alphabet, not from
decoding; the string is those bytes decoded with replacement characters.
Other tokenizers fall back to decoding the single token.  Only the engine
thread calls this (the tokenizer is not safe to share between threads).
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` table (transformers' own copy)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class TokenText:
    """Cached ``token id -> (string, bytes)`` for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        dec = _byte_decoder()
        special = token_id in getattr(self.tokenizer, "all_special_ids", ())
        if isinstance(piece, str) and piece and not special and all(ch in dec for ch in piece):
            raw = bytes(dec[ch] for ch in piece)
            text = raw.decode("utf-8", errors="replace")
        else:
            text = self.tokenizer.decode([int(token_id)], skip_special_tokens=False)
            raw = text.encode("utf-8")
        out = (text, list(raw))
        self._cache[token_id] = out
        return out
