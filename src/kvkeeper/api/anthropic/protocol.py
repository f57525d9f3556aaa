"""Request bodies of Anthropic's Messages API (pydantic v2), as the ``anthropic`` SDK (2.10) and Claude Code send them.

Every field is applied, accepted with a documented meaning (:data:`NOT_APPLIED`: fields the server takes and has
nothing to do with, named back in the ``X-KVKeeper-Not-Applied`` response header), or refused with a 400 naming it
(:data:`REFUSED` unless it holds a no-op value; any field no model here declares, as on every route:
:func:`kvkeeper.api.common.protocol.refuse_unknown`).  Token counts in tokens.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from ..common.schemas import _OPEN, _only


# a breakpoint's ttl -> seconds its prefix is held against eviction (kvkeeper.kvcache.retention)
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(BaseModel):
    """A cache breakpoint: the prompt up to and including the block it marks is written to the cache and held
    there for its ``ttl`` (:data:`TTL_SECONDS`)."""

    model_config = _OPEN
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None  # default 5m


class TextBlock(BaseModel):
    """A ``system`` text block."""

    model_config = _OPEN
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = _only(None, [])


class ContentBlock(BaseModel):
    """One block of a message's content: ``text``, ``tool_use`` (assistant), ``tool_result`` (user); ``thinking``
    / ``redacted_thinking`` blocks of an earlier reply are dropped (this model does not read them back).  Other
    types (``image``, ``document``, server tools) are refused with a 400 naming the block
    (:func:`kvkeeper.api.anthropic.serving.chat_messages`)."""

    model_config = _OPEN
    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use: the call's arguments
    tool_use_id: str | None = None  # tool_result: the id of the call it answers
    content: str | list[TextBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result (an error result is sent to the model as text all the same)
    cache_control: CacheControl | None = None
    citations: list[Any] | None = _only(None, [])
    thinking: str | None = None  # thinking (dropped)
    signature: str | None = None  # thinking (dropped)
    data: str | None = None  # redacted_thinking (dropped)
    source: Any = None  # image / document: refused


class Message(BaseModel):
    model_config = _OPEN
    role: Literal["user", "assistant", "system"]  # "system" inside messages: Claude Code sends one
    content: str | list[ContentBlock]


class Tool(BaseModel):
    """A client tool: ``name``, ``description``, ``input_schema`` (a JSON schema of an object)."""

    model_config = _OPEN
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None  # calls are always constrained to the schema
    # Anthropic's tool search: a deferred tool is not in the model's context until a tool search finds it.  This
    # server runs no tool search, so a deferred tool is not offered to the model (Claude Code sends its MCP tools
    # and a placeholder this way); X-KVKeeper-Tools-Not-Offered names them.
    defer_loading: bool | None = None


class ToolChoice(BaseModel):
    model_config = _OPEN
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    """``enabled`` is refused (the model has no reasoning mode); ``disabled`` and ``adaptive`` (the model thinks when
    it wants to: a model without reasoning never does) are served as plain replies."""

    model_config = _OPEN
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None  # Claude Code sends "omitted"; no thinking to display


class Metadata(BaseModel):
    model_config = _OPEN
    user_id: str | None = None  # written to the access log


class OutputFormat(BaseModel):
    model_config = _OPEN
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _OPEN
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # not applied: no reasoning mode
    format: OutputFormat | None = None  # the reply constrained to the schema


class MessagesRequest(BaseModel):
    """``POST /v1/messages`` (and ``/v1/messages/count_tokens``, which takes the same fields but ``max_tokens``)."""

    model_config = _OPEN
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int | None = Field(None, ge=1)  # required by /v1/messages; clamped to the context left
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint after the last block
    context_management: Any = None  # accepted, not applied (NOT_APPLIED)
    diagnostics: Any = None  # accepted, not applied (NOT_APPLIED)
    service_tier: str | None = _only(None, "auto", "standard_only")
    container: Any = _only(None)
    mcp_servers: list[Any] | None = _only(None, [])
    inference_geo: str | None = _only(None)


# Fields refused with a 400 unless they hold one of their no-op values: (no-op values, why).
REFUSED: dict[str, tuple[tuple, str]] = {
    "service_tier": ((None, "auto", "standard_only"), "there is one service tier: auto (or standard_only)"),
    "container": ((None,), "there is no code-execution container"),
    "mcp_servers": ((None, []), "this server connects to no MCP server; give the tools in tools"),
    "inference_geo": ((None,), "this server runs where it is"),
}

# Fields accepted and not applied, with what the server does instead (named in X-KVKeeper-Not-Applied).
NOT_APPLIED: dict[str, str] = {
    "context_management": "the conversation is never edited by the server: it fits the context or is refused",
    "diagnostics": "no diagnostics are returned",
    "output_config.effort": "the model has no reasoning mode; effort changes nothing",
    "thinking": "the model has no reasoning mode: adaptive and disabled thinking give a plain reply",
}


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: the fields of a message request (``max_tokens`` and ``stream`` not used)."""
