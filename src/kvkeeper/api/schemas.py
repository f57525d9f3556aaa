"""Request bodies of the OpenAI-compatible endpoints (pydantic v2 models).

Validation failures become 400 errors (see :mod:`kvkeeper.api.errors`).  Unknown
fields are ignored, as OpenAI clients send some this server does not use.
Token counts are in tokens; ``temperature`` 0 means greedy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class KVCompressionSpec(BaseModel):
    """Extension: compress the prompt's KV after prefill (see kvkeeper.kvcache.compression)."""

    policy: Literal["streaming_llm", "h2o", "snapkv", "knorm"]
    ratio: float = Field(0.5, ge=0, lt=1)


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM): 0 or -1 = off
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    ignore_eos: bool = False  # extension (vLLM)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # extension (vLLM): tenant isolation
    kv_compression: KVCompressionSpec | None = None  # extension: drop prompt KV after prefill
    return_token_ids: bool = False  # extension (vLLM): prompt and output token ids in the response


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (as in vLLM): exactly one of ``prompt`` (text) or ``messages`` (chat)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
