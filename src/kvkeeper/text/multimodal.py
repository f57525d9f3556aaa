"""The tokens only a multimodal input can produce: image, audio and video placeholders of a model's vocabulary.

A multimodal checkpoint served as a text model (Gemma 3's text-only 270M keeps Gemma 3's vocabulary) still ranks
its placeholders among its next tokens: after ``"An image of a sunset:\\n"`` gemma-3-270m puts ``<start_of_image>``
first and, fed it back, repeats it.  No text request can use them: the sampler masks them
(:class:`~kvkeeper.sampling.sampler.TokenMask`) unless a request names one in ``logit_bias``.

They are found per model among the tokenizer's *added* tokens (the GGUF's control / user-defined tokens, a Hugging
Face tokenizer's added vocabulary), by name: ``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>``
(Gemma 3), ``<|vision_start|>``, ``<|image_pad|>``, ``<|video_pad|>`` (Qwen2-VL), ``<|audio_bos|>`` (Qwen2-Audio),
``<image>`` (LLaVA) and the like; an HTML tag such as Gemma's ``<img>`` is text and stays.
"""

from __future__ import annotations

import re

PLACEHOLDER = re.compile(
    r"<\|?(?:(?:start|end|begin)_of_)?(?:image|audio|video|vision)"
    r"(?:_(?:soft_token|pad|start|end|bos|eos|placeholder|token|sep|break|newline))?\|?>", re.IGNORECASE)


def added_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's added tokens, {text: id}: a ``tokenizers`` backend's added-token table when it has one
    (read without loading anything more), else ``get_added_vocab()``, else none."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if _has(tokenizer, "backend_tokenizer") else None
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        return {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    if _has(tokenizer, "get_added_vocab"):
        return dict(tokenizer.get_added_vocab())
    return {}


def _has(obj, name: str) -> bool:
    """Whether ``obj`` answers ``name`` itself (never through a ``__getattr__`` that would load a full tokenizer)."""
    return name in getattr(obj, "__dict__", {}) or hasattr(type(obj), name)


def multimodal_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Sorted ids (< ``vocab_size``, the model's logits width) of the tokenizer's added tokens that are
    multimodal placeholders (:data:`PLACEHOLDER`, the whole token); [] for a tokenizer without any."""
    return sorted({i for text, i in added_tokens(tokenizer).items()
                   if 0 <= i < vocab_size and PLACEHOLDER.fullmatch(text)})
