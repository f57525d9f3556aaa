"""What the request bodies of the OpenAI-compatible endpoints share (pydantic v2 models): messages, tools, output
formats, the sampling fields of chat and text completions, and the refused and unknown fields' rules.  Each
endpoint's own body is in its package (``chat/protocol.py``, ``completions/protocol.py``,
``observability/protocol.py``, ``responses/schema.py``).

Validation failures become 400 errors (see :mod:`kvkeeper.api.common.errors`).  Every field here is
either applied or refused with a 400 that names it: the fields in :data:`REFUSED` are accepted only
with their no-op value (so a client library that always sends, say, ``store: false`` still works).
Fields no model here declares are collected (``extra="allow"``) and refused by the routes
(:func:`unknown_fields`), unless the server runs with ``--ignore-unknown-fields``.
Token counts are in tokens; ``temperature`` 0 means greedy.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Unknown fields are kept, to be refused by name (or ignored with --ignore-unknown-fields); the published
# schema (/openapi.json) says what the server accepts by default: no additional properties.  Strict types, as
# OpenAI's API: no "5" or true for an integer, no "yes" or 1 for a boolean (an integer is still a number).
_OPEN = ConfigDict(extra="allow", strict=True, json_schema_extra={"additionalProperties": False})


# prompt_cache_retention (chat, completions, responses) -> seconds the prompt's full blocks are held against LRU
# eviction (kvkeeper.kvcache.retention); None: no hold.  Any other value is a 400 naming the field.
RETENTION_SECONDS: dict[str | None, float | None] = {None: None, "in_memory": None, "24h": 24 * 3600.0}
RETENTION_DOC = ("How long the prompt's cached prefix is kept: in_memory (default) = until evicted, least recently "
                 "used first; 24h = its full blocks are held against eviction for 24 hours (renewed by each request "
                 "that sends it again), within the server's --kv-hold-share of the KV blocks; under pressure the "
                 "oldest hold gives way, so a request is never refused for a hold")


def _only(*noop: Any) -> Any:
    """A field refused unless it holds one of its no-op values: the published schema allows only those
    (the server answers other values with a 400 that names the field and says why)."""
    return Field(None, json_schema_extra={"enum": list(noop)})


class StreamOptions(BaseModel):
    model_config = _OPEN
    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): usage in every chunk (needs include_usage)
    include_obfuscation: bool | None = _only(None, False)  # refused when true: chunks are not padded


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = _OPEN
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _OPEN
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCall(BaseModel):
    """A call in an assistant message of the history (as a response's ``tool_calls`` gave it)."""

    model_config = _OPEN
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _OPEN
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # applied when the chat template reads names, else refused
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the id of the call it answers
    refusal: str | None = _only(None)  # refused when set
    audio: Any = _only(None)  # refused when set
    function_call: Any = _only(None)  # refused when set (deprecated functions API)
    annotations: list[Any] | None = _only(None, [])  # a response message's (url citations): refused unless empty


class FunctionDefinition(BaseModel):
    model_config = _OPEN
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; omitted: no arguments ({})
    strict: bool | None = None  # calls are always constrained to the schema (see README)


class Tool(BaseModel):
    model_config = _OPEN
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _OPEN
    name: str


class NamedToolChoice(BaseModel):
    model_config = _OPEN
    type: Literal["function"]
    function: FunctionName


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True,
                              json_schema_extra={"additionalProperties": False})
    name: str = Field("response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # omitted: any JSON object
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = _OPEN
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (its current name for the ``guided_*`` fields): exactly one of them."""

    model_config = _OPEN
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class PredictionContent(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``, the text the reply is
    expected to repeat; the engine drafts from it (speculative decoding) and the reply is unchanged."""

    model_config = _OPEN
    type: Literal["content"]
    content: str | list[ContentPart]


class KVCompressionSpec(BaseModel):
    """Extension: compress the prompt's KV after prefill (see kvkeeper.kvcache.compression)."""

    model_config = _OPEN
    policy: Literal["streaming_llm", "h2o", "snapkv", "knorm"]
    ratio: float = Field(0.5, ge=0, lt=1)


# Fields the OpenAI schemas declare nullable but that have a non-null default here: null means the default.
_NULL_IS_DEFAULT = ("n", "stream", "logprobs", "echo")


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _OPEN

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``"n": null`` (and ``stream``, chat's ``logprobs``, ``echo``) as if the field were left out, as OpenAI."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in _NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items() if not (k in _NULL_IS_DEFAULT and v is None)}
        return data
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM): 0 or -1 = off
    min_p: float | None = Field(None, ge=0, le=1)  # extension (vLLM)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64; with n > 1 also seed + n - 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # written to the access log
    safety_identifier: str | None = None  # written to the access log
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # extension (vLLM)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={  # token id (as a string) -> bias
        "propertyNames": {"pattern": "^[0-9]{1,9}$"}, "additionalProperties": {"minimum": -100, "maximum": 100}})
    bad_words: list[str] | None = None  # extension (vLLM)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extension (vLLM, older names of structured_outputs)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    min_tokens: int | None = Field(None, ge=0)  # extension (vLLM): EOS and stop tokens masked until this many
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # extension (vLLM): tenant isolation
    kv_compression: KVCompressionSpec | None = None  # extension: drop prompt KV after prefill
    return_token_ids: bool = False  # extension (vLLM): prompt and output token ids in the response
    speculative_decoding: bool = True  # extension: false opts the request out of speculative decoding
    # OpenAI fields refused unless they hold their no-op value (see REFUSED)
    service_tier: str | None = _only(None, "auto", "default")
    store: bool | None = _only(None, False)
    metadata: dict[str, Any] | None = _only(None, {})
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)  # scopes the prefix cache (cache_namespace)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description=RETENTION_DOC)
    prompt_cache_options: Any = _only(None)
    moderation: Any = _only(None)


_NOT_STORED = "this server keeps no stored completions"
# Request fields refused with 400 unless they hold one of their no-op values: (no-op values, why).
REFUSED: dict[str, tuple[tuple, str]] = {
    "audio": ((None,), "audio output is not supported; this server generates text"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "function_call": ((None,), "the deprecated functions API is not supported; use tools and tool_choice"),
    "functions": ((None,), "the deprecated functions API is not supported; use tools and tool_choice"),
    "reasoning_effort": ((None,), "this model has no reasoning mode"),
    "verbosity": ((None,), "this model has no verbosity setting; ask for brevity in the messages"),
    "web_search_options": ((None,), "web search is not available"),
    "service_tier": ((None, "auto", "default"), "there is one service tier: auto (or default)"),
    "store": ((None, False), _NOT_STORED),
    "metadata": ((None, {}), f"metadata is kept only with stored completions; {_NOT_STORED}"),
    "prompt_cache_options": ((None,), "cached prefixes stay until evicted (least recently used first)"),
    "moderation": ((None,), "there is no moderation model"),
    "suffix": ((None, ""), "insertion (a suffix after the completion) is not supported"),
}


def refused_field(body: BaseModel, table: dict[str, tuple[tuple, str]] | None = None) -> tuple[str, str] | None:
    """(field, why) of the first field of ``table`` (default :data:`REFUSED`; the Responses API passes its own) that
    ``body`` sets to something else than a no-op.  A dotted name is a field of a field (``text.verbosity``; an
    absent parent reads as None); a name the body's schema does not declare is skipped."""
    for name, (noop, why) in (REFUSED if table is None else table).items():
        obj: Any = body
        for part in name.split("."):
            if obj is not None and part not in type(obj).model_fields:
                break
            obj = getattr(obj, part) if obj is not None else None
        else:
            if obj not in noop:
                return name, why
    return None


def unknown_fields(obj: Any, where: str = "") -> list[str]:
    """Dotted paths of the fields no model declares, anywhere in a parsed body (e.g. ``messages.0.foo``)."""
    out: list[str] = []
    if isinstance(obj, BaseModel):
        out += [f"{where}{k}" for k in (obj.model_extra or {})]
        for name in type(obj).model_fields:
            out += unknown_fields(getattr(obj, name), f"{where}{name}.")
    elif isinstance(obj, list):
        for i, x in enumerate(obj):
            out += unknown_fields(x, f"{where}{i}.")
    return out
