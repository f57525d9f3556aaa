"""The request bodies of ``POST /tokenize`` and ``POST /detokenize`` (pydantic v2, vLLM's fields)."""

from __future__ import annotations

from pydantic import BaseModel

from ..common.schemas import _OPEN, ChatMessage, Tool


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (as in vLLM): exactly one of ``prompt`` (text) or ``messages`` (chat)."""

    model_config = _OPEN
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # vLLM's: default true for a prompt (e.g. a BOS), false for messages


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (as in vLLM): token ids back to text."""

    model_config = _OPEN
    model: str | None = None
    tokens: list[int]
