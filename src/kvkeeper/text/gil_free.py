"""Tokenizing without holding Python's GIL.

The ``tokenizers`` library's ``Tokenizer.encode`` keeps the GIL for the whole call; only its batch calls
(``encode_batch``) release it while the Rust code runs (its Python bindings wrap them alone in
``py.allow_threads``).  Measured here (tokenizers 0.23.3, SmolLM2's tokenizer, 2 cores): a 500,000-byte text took
0.23 s either way, and a thread beside it that wakes every millisecond waited up to 228 ms through ``encode`` and at
most 2.6 ms through ``encode_batch``.  The server tokenizes prompts in worker threads; through ``encode`` a prompt of
half a megabyte would still stall the engine thread's decode steps (and the event loop) for its whole length.
"""

from __future__ import annotations

__all__ = ["encode"]


def encode(backend, text: str, add_special_tokens: bool = False):
    """``backend.encode(text, add_special_tokens=...)`` (a ``tokenizers.Tokenizer``), the same ``Encoding`` (ids,
    offsets in characters), computed through ``encode_batch`` so that other threads run meanwhile."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
