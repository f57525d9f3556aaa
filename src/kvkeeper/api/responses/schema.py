"""The request body of ``POST /v1/responses`` (OpenAI's Responses API, the subset a text model serves).

Input items: messages (``{"role", "content"}``, content a string or ``input_text`` / ``output_text`` parts),
``function_call`` (a call the model made, as an earlier response gave it) and ``function_call_output`` (the
caller's result of a call).  Fields this server does not apply are refused with a 400 naming them (the ones in
:data:`RESPONSES_REFUSED` unless they hold their no-op value; any other unknown field, as on every route).
Token counts in tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from ..common.schemas import _OPEN, FunctionDefinition, FunctionName, _only


class InputContent(BaseModel):
    """A text part of a message item: ``input_text`` (the caller's) or ``output_text`` (an earlier reply's)."""

    model_config = _OPEN
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = _only(None, [])
    logprobs: list[Any] | None = _only(None, [])


class _Item(BaseModel):
    """What every input item may carry back from an earlier response: its id and status."""

    model_config = _OPEN
    id: str | None = None
    status: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContent]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str
    arguments: str  # JSON text of the arguments object


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str


def _item_type(v: Any) -> Any:
    """An item's ``type``; one with none is a message (OpenAI's easy input message: ``{"role", "content"}``)."""
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]], Discriminator(_item_type)]


class FunctionTool(FunctionDefinition):
    """A function the model may call (the Responses API's flat form: name and schema beside ``type``)."""

    type: Literal["function"]


class NamedFunction(FunctionName):
    """``tool_choice`` naming one function (flat: ``{"type": "function", "name": ...}``)."""

    type: Literal["function"]


class TextFormat(BaseModel):
    model_config = _OPEN
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced
    description: str | None = _only(None)


class TextConfig(BaseModel):
    model_config = _OPEN
    format: TextFormat | None = None
    verbosity: str | None = _only(None, "medium")


class ConversationRef(BaseModel):
    model_config = _OPEN
    id: str


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``.  ``store`` defaults to true, as OpenAI's: the response is kept (and its KV, as a
    session turn) until deleted."""

    model_config = _OPEN

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, pattern=r"^resp_[A-Za-z0-9]{1,64}$")
    store: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=16)  # kept with the stored response
    user: str | None = None  # written to the access log
    safety_identifier: str | None = None  # written to the access log
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # extension (vLLM): tenant isolation
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)
    prompt_cache_retention: str | None = _only(None, "in_memory")
    # refused unless they hold their no-op value (see RESPONSES_REFUSED)
    truncation: str | None = _only(None, "disabled")
    include: list[str] | None = _only(None, [])
    reasoning: Any = _only(None)
    background: bool | None = _only(None, False)
    service_tier: str | None = _only(None, "auto", "default")
    max_tool_calls: Any = _only(None)
    top_logprobs: int | None = _only(None, 0)
    conversation: str | ConversationRef | None = None
    prompt: Any = _only(None)
    stream_options: Any = _only(None)


RESPONSES_REFUSED: dict[str, tuple[tuple, str]] = {
    "prompt_cache_retention": ((None, "in_memory"), "cached prefixes stay in memory until evicted (least recently "
                                                    "used first), as in_memory; a 24h retention is not offered"),
    "truncation": ((None, "disabled"), "a prompt over the context is refused, never cut: send \"disabled\""),
    "include": ((None, []), "no extra output data is kept (no reasoning, no logprobs, no tool sources)"),
    "reasoning": ((None,), "this model has no reasoning mode"),
    "background": ((None, False), "responses run in the foreground; stream them instead"),
    "service_tier": ((None, "auto", "default"), "there is one service tier: auto (or default)"),
    "max_tool_calls": ((None,), "the model calls at most the tools that one reply holds; set parallel_tool_calls"),
    "top_logprobs": ((None, 0), "logprobs are served on /v1/chat/completions"),
    "prompt": ((None,), "there are no stored prompt templates"),
    "stream_options": ((None,), "stream events are not padded (no obfuscation); leave it out"),
    "text.verbosity": ((None, "medium"), "this model has no verbosity setting"),
    "text.format.description": ((None,), "the schema alone constrains the output; describe it in the input"),
}


class ConversationCreate(BaseModel):
    """``POST /v1/conversations``: its first items (at most 20, as OpenAI's) and metadata."""

    model_config = _OPEN
    items: list[InputItem] | None = Field(None, max_length=20)
    metadata: dict[str, str] | None = Field(None, max_length=16)


class ConversationUpdate(BaseModel):
    """``POST /v1/conversations/{id}``: new metadata."""

    model_config = _OPEN
    metadata: dict[str, str] = Field(max_length=16)


class ItemsCreate(BaseModel):
    """``POST /v1/conversations/{id}/items``: items to append (at most 20)."""

    model_config = _OPEN
    items: list[InputItem] = Field(min_length=1, max_length=20)
