"""The request body of ``POST /v1/responses`` (OpenAI's Responses API, the subset a text model serves).

Input items: messages (``{"role", "content"}``, content a string or ``input_text`` / ``output_text`` parts),
``function_call`` (a call the model made, as an earlier response gave it) and ``function_call_output`` (the
caller's result of a call).  Fields this server does not apply are refused with a 400 naming them (the ones in
:data:`RESPONSES_REFUSED` unless they hold their no-op value; any other unknown field, as on every route).
Token counts in tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ..common.schemas import _OPEN, RETENTION_DOC, FunctionDefinition, FunctionName, _only


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
    namespace: str | None = None  # a call of a namespace tool's function (as the response gave it back)
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


class NamespaceTool(BaseModel):
    """A named group of function tools (Codex CLI's MCP tools): offered to the model as functions named
    ``<namespace>__<name>`` (:func:`qualified_name`), given back as ``function_call`` items with ``name`` and
    ``namespace``."""

    model_config = _OPEN
    type: Literal["namespace"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    tools: list[FunctionTool]


# Hosted tools: run by OpenAI's servers, not by the client.  This server cannot run them: they are not offered to
# the model, and the response names them (X-KVKeeper-Tools-Not-Offered), so that an agent that always sends them
# runs on.  "custom" (a free-form tool, e.g. Codex's apply_patch) is not offered either: its calls are raw text.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                "computer_use_preview", "mcp", "local_shell", "tool_search", "custom")


class HostedTool(BaseModel):
    """A tool of :data:`HOSTED_TOOLS`: accepted, not offered (its options are not read)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal[HOSTED_TOOLS]
    name: str | None = None


def _tool_type(v: Any) -> Any:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in ("function", "namespace") else "hosted"


AnyTool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                          Annotated[HostedTool, Tag("hosted")]], Discriminator(_tool_type)]


def qualified_name(namespace: str | None, name: str) -> str:
    """The name the model sees for function ``name`` of ``namespace`` (``name`` alone without one):
    ``<namespace>__<name>``, or ``<namespace><name>`` when the namespace already ends with ``_``."""
    if namespace is None:
        return name
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


class Reasoning(BaseModel):
    """``reasoning``: a model without reasoning has no effort to set (refused unless null) and no reasoning to
    summarise (``summary`` accepted: there is nothing to return)."""

    model_config = _OPEN
    effort: str | None = _only(None)
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = None


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


class ResponsesStreamOptions(BaseModel):
    """``stream_options`` of ``/v1/responses``.  include_usage: accepted either way (a streamed response always ends
    with its usage, in ``response.completed``; aiperf sends it).  include_obfuscation: true pads every delta event
    with an ``obfuscation`` field of random characters (OpenAI's side-channel mitigation, see
    :mod:`kvkeeper.api.responses.events`); false or absent: no padding (unlike OpenAI, off unless asked for)."""

    model_config = _OPEN
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


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
    tools: list[AnyTool] | None = None  # functions, namespaces of functions; hosted tools are not offered
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=16)  # kept with the stored response
    user: str | None = None  # written to the access log
    safety_identifier: str | None = None  # written to the access log
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # extension (vLLM): tenant isolation
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description=RETENTION_DOC)
    # refused unless they hold their no-op value (see RESPONSES_REFUSED)
    truncation: str | None = _only(None, "disabled")
    include: list[str] | None = _only(None, [], ["reasoning.encrypted_content"])
    reasoning: Reasoning | None = None
    client_metadata: dict[str, str] | None = None  # Codex CLI's; its session_id names a session (store false)
    background: bool | None = _only(None, False)
    service_tier: str | None = _only(None, "auto", "default")
    max_tool_calls: Any = _only(None)
    top_logprobs: int | None = _only(None, 0)
    conversation: str | ConversationRef | None = None
    prompt: Any = _only(None)
    stream_options: ResponsesStreamOptions | None = None


RESPONSES_REFUSED: dict[str, tuple[tuple, str]] = {
    "truncation": ((None, "disabled"), "a prompt over the context is refused, never cut: send \"disabled\""),
    "include": ((None, [], ["reasoning.encrypted_content"]), "no extra output data is kept (no logprobs, no tool "
                                                             "sources; reasoning.encrypted_content: there is none)"),
    "background": ((None, False), "responses run in the foreground; stream them instead"),
    "service_tier": ((None, "auto", "default"), "there is one service tier: auto (or default)"),
    "max_tool_calls": ((None,), "the model calls at most the tools that one reply holds; set parallel_tool_calls"),
    "top_logprobs": ((None, 0), "logprobs are served on /v1/chat/completions"),
    "prompt": ((None,), "there are no stored prompt templates"),
    "text.verbosity": ((None, "medium"), "this model has no verbosity setting"),
    "text.format.description": ((None,), "the schema alone constrains the output; describe it in the input"),
    "reasoning.effort": ((None,), "this model has no reasoning mode: no effort to set (reasoning.summary is accepted)"),
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
