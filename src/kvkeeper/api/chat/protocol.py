"""The request body of ``POST /v1/chat/completions`` (pydantic v2; the fields it shares with text completions, the
refused and unknown fields' rules: :mod:`kvkeeper.api.common.schemas`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ...sessions.compress import SESSION_COMPRESSION_POLICIES
from ...sessions.context import CONTEXT_POLICIES
from ..common.schemas import ChatMessage, NamedToolChoice, PredictionContent, Tool, _only, _SamplingFields


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # extension (vLLM)
    continue_final_message: bool = False  # extension (vLLM)
    context_policy: Literal[CONTEXT_POLICIES] | None = None  # extension: a session's
    context_budget: int | None = Field(None, ge=16)  # extension: prompt tokens the session's context policy keeps
    session_compression: Literal[SESSION_COMPRESSION_POLICIES] | None = None  # extension
    session_compression_ratio: float | None = Field(None, ge=0, lt=1)  # extension: KV fraction dropped per turn end
    conversation_id: str | None = None  # extension (vLLM's multi-turn benchmark): the session, as X-Session-ID
    audio: Any = _only(None)
    function_call: Any = _only(None)
    functions: Any = _only(None)
    modalities: list[str] | None = _only(None, ["text"])
    prediction: PredictionContent | None = None  # drafts for speculative decoding (kvkeeper.spec_decode)
    reasoning_effort: Any = _only(None)
    verbosity: Any = _only(None)
    web_search_options: Any = _only(None)
