"""From an HTTP request to engine inputs: messages, sampling params, structured outputs, cache namespace,
session headers; and the fields a request may not carry.

Every function raises :class:`~kvkeeper.api.errors.APIError` (400) naming the field or header at fault.
"""

from __future__ import annotations

import json
import re

from fastapi import Request

from ..errors import KVKeeperError
from ..kvcache.compression import KVCompression
from ..kvcache.namespace import Namespace, tenant_namespace
from ..sampling.params import SamplingParams
from ..sampling.structured import StructuredOutput
from .errors import APIError
from .schemas import ChatCompletionRequest, ChatMessage, TokenizeRequest, _SamplingFields, refused_field, unknown_fields

_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def check_model(model: str | None, served: str, adapters=()) -> None:
    """404 unless ``model`` is omitted, the served model's id or a loaded LoRA adapter's name (``adapters``)."""
    if model is not None and model != served and model not in adapters:
        names = ", ".join([repr(served)] + [repr(a) for a in sorted(adapters)])
        raise APIError(404, f"the model {model!r} does not exist; this server serves {names} (LoRA adapters "
                            "by their names)", type="not_found_error", param="model", code="model_not_found")


def loaded_adapters(request: Request) -> dict:
    """The engine's loaded LoRA adapters by name (``LLMEngine.loras``; a read from the handler's thread)."""
    return getattr(request.app.state.engine.engine, "loras", {})


def adapter_of(model: str | None, request: Request) -> str | None:
    """The LoRA adapter a request's ``model`` field selects (None: the base model); 404 naming an unknown model."""
    st = request.app.state
    check_model(model, st.model_name, loaded_adapters(request))
    return model if model is not None and model != st.model_name else None


def check_fields(body, request: Request) -> None:
    """400 for a field refused in its value (:data:`~kvkeeper.api.schemas.REFUSED`) and, unless the server
    ignores them (``--ignore-unknown-fields``), for a field no schema declares."""
    bad = refused_field(body)
    if bad is not None:
        raise APIError(400, f"{bad[0]} is not supported: {bad[1]}", param=bad[0])
    so = getattr(body, "stream_options", None)
    if so is not None and not body.stream:
        raise APIError(400, "stream_options applies to streamed responses only: send stream: true, or leave "
                            "stream_options out", param="stream_options")
    if so is not None and so.include_obfuscation:
        raise APIError(400, "stream_options.include_obfuscation is not supported: chunks are not padded; "
                            "send false or omit it", param="stream_options.include_obfuscation")
    if getattr(request.app.state, "refuse_unknown_fields", True):
        unknown = unknown_fields(body)
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r}: this server does not implement it, and does not "
                                "silently ignore a field; remove it (or start the server with "
                                "--ignore-unknown-fields)", param=unknown[0])


def _content(i: int, m: ChatMessage) -> str:
    c = m.content
    if c is None:
        if m.role != "assistant":
            raise APIError(400, f"messages[{i}].content is missing", param=f"messages.{i}.content")
        return ""
    if isinstance(c, str):
        return c
    parts = []
    for j, p in enumerate(c):
        if p.type != "text" or p.text is None:
            raise APIError(400, f"messages[{i}].content[{j}] has type {p.type!r}; only text parts "
                                "({'type': 'text', 'text': ...}) are supported", param=f"messages.{i}.content.{j}")
        parts.append(p.text)
    return "\n".join(parts)


def _refuse_message_fields(i: int, m: ChatMessage) -> None:
    for name, why in (("refusal", "a refusal cannot be part of the history; send it as content"),
                      ("audio", "audio is not supported"),
                      ("function_call", "the deprecated functions API is not supported; use tool_calls")):
        if getattr(m, name) is not None:
            raise APIError(400, f"messages[{i}].{name} is not supported: {why}", param=f"messages.{i}.{name}")
    if m.annotations:
        raise APIError(400, f"messages[{i}].annotations are not supported (this server cites nothing); drop them",
                       param=f"messages.{i}.annotations")
    if m.tool_calls and m.role != "assistant":
        raise APIError(400, f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                       param=f"messages.{i}.tool_calls")


def _tool_calls(i: int, m: ChatMessage, seen_ids: set[str]) -> list[dict]:
    out = []
    for j, c in enumerate(m.tool_calls or []):
        try:
            args = json.loads(c.function.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be the JSON text of an "
                                "object, as a response's tool call gave it", param=f"messages.{i}.tool_calls.{j}")
        if c.id is not None:
            seen_ids.add(c.id)
        out.append({"id": c.id, "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments}})
    return out


def messages_of(body: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """``{"role", "content"}`` dicts (text parts joined by newlines, ``developer`` read as ``system``), with an
    assistant's ``tool_calls``, a tool message's ``tool_call_id`` (which must answer an earlier call) and a
    ``name`` when given (the engine refuses it when the chat template has no names)."""
    out, call_ids = [], set()
    for i, m in enumerate(body.messages):
        _refuse_message_fields(i, m)
        d = {"role": "system" if m.role == "developer" else m.role, "content": _content(i, m)}
        if m.tool_calls:
            d["tool_calls"] = _tool_calls(i, m, call_ids)
        if m.role == "tool":
            if m.tool_call_id is None or m.tool_call_id not in call_ids:
                raise APIError(400, f"messages[{i}].tool_call_id must be the id of a tool call of an earlier "
                                    f"assistant message, got {m.tool_call_id!r}", param=f"messages.{i}.tool_call_id")
            d["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id is not None:
            raise APIError(400, f"messages[{i}].tool_call_id belongs to tool messages only",
                           param=f"messages.{i}.tool_call_id")
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def logit_bias_of(body: _SamplingFields) -> dict[int, float]:
    """``{token id: bias}`` from OpenAI's ``{"id as a string": bias}``; 400 for other keys or out-of-range biases."""
    out = {}
    for k, v in (body.logit_bias or {}).items():
        if not re.fullmatch(r"[0-9]{1,9}", k.strip()):
            raise APIError(400, f"logit_bias keys must be token ids written as strings, e.g. {{\"35716\": -100}}; "
                                f"got {k!r}", param="logit_bias")
        if not -100 <= v <= 100:
            raise APIError(400, f"logit_bias values must be between -100 and 100, got {v} for token {k}",
                           param="logit_bias")
        out[int(k)] = float(v)
    return out


def structured_of(body: _SamplingFields) -> StructuredOutput | None:
    """The output constraint of ``response_format``, vLLM's ``guided_*`` or ``structured_outputs`` (at most one)."""
    found: list[StructuredOutput] = []
    rf = body.response_format
    if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
        raise APIError(400, f"response_format.json_schema is only used with type json_schema, not {rf.type!r}: "
                            "remove it or set type to json_schema", param="response_format.json_schema")
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None and rf.json_schema.description:
        raise APIError(400, "response_format.json_schema.description is not used by this server (the schema "
                            "alone constrains the output): describe the format in the messages instead",
                       param="response_format.json_schema.description")
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutput("json_object", None, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format.json_schema is missing: give {\"name\": ..., \"schema\": {...}}",
                           param="response_format.json_schema")
        schema = rf.json_schema.json_schema
        found.append(StructuredOutput("json_schema", schema or {"type": "object"}, "response_format"))
    found += _guided(body)
    if len(found) > 1:
        raise APIError(400, f"{found[1].param} and {found[0].param} both constrain the output: give one",
                       param=found[1].param)
    return found[0] if found else None


def _schema(v, param: str) -> dict:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise APIError(400, f"{param} must be a JSON schema (an object, or its JSON text)", param=param) from None
    if not isinstance(v, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param=param)
    return v


def _guided(body: _SamplingFields) -> list[StructuredOutput]:
    out = []
    if body.guided_json is not None:
        out.append(StructuredOutput("json_schema", _schema(body.guided_json, "guided_json"), "guided_json"))
    for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            out.append(StructuredOutput(kind, getattr(body, name), name))
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]
        if so.json_object:
            given.append(("json_object", None))
        if len(given) != 1:
            raise APIError(400, "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                           param="structured_outputs")
        k, v = given[0]
        param = f"structured_outputs.{k}"
        kind = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}[k]
        out.append(StructuredOutput(kind, _schema(v, param) if k == "json" else v, param))
    return out


def sampling_of(body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                structured: StructuredOutput | None = None, prompt_logprobs: int | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice; seeds seed, seed+1, ... when a seed is given.  Prompt logprobs go to the
    first choice only (the others share its prompt)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 16:
        raise APIError(400, f"at most 16 stop strings, got {len(stop)}", param="stop")
    kw = dict(temperature=1.0 if body.temperature is None else body.temperature,
              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, max_tokens=max_tokens,
              min_p=body.min_p or 0.0, stop=stop, stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
              logprobs=logprobs, presence_penalty=body.presence_penalty or 0.0,
              frequency_penalty=body.frequency_penalty or 0.0,
              repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
              logit_bias=logit_bias_of(body), bad_words=body.bad_words or [], structured=structured)
    if body.seed is not None and body.seed + body.n - 1 > 2**63 - 1:
        raise APIError(400, f"seed + n - 1 must fit in 64 bits (choice i uses seed + i): seed {body.seed}, n {body.n}",
                       param="seed")
    try:
        return [SamplingParams(seed=None if body.seed is None else body.seed + i,
                               prompt_logprobs=prompt_logprobs if i == 0 else None, **kw) for i in range(body.n)]
    except KVKeeperError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


def namespace_of(body: _SamplingFields, request: Request, base: Namespace, tenant: str | None = None
                 ) -> Namespace | None:
    """The request's cache namespace: ``base`` under the LoRA adapter its ``model`` names (its id: name and
    content hash), salted by the caller's ``tenant`` and the client's ``cache_salt`` or ``X-Cache-Salt``
    (:func:`~kvkeeper.kvcache.namespace.salt_hash`: the salt narrows the tenant's namespace, never widens it);
    None (the engine's own) for the base model, no tenant and no salt."""
    lora = adapter_of(body.model, request)
    if lora is not None:
        try:
            base = request.app.state.engine.engine.lora_namespace(lora, base)
        except KVKeeperError as e:  # unloaded since adapter_of looked
            raise APIError(404, str(e), type="not_found_error", param="model", code="model_not_found") from None
    salt = body.cache_salt if body.cache_salt is not None else request.headers.get("x-cache-salt")
    if salt is not None and (not salt or len(salt) > 256):
        raise APIError(400, "cache salt must be 1 to 256 characters", param="cache_salt")
    if salt is None and tenant is None:
        return base if lora is not None else None
    return tenant_namespace(base, tenant, salt)


def compression_of(body: _SamplingFields) -> KVCompression | None:
    if body.kv_compression is None:
        return None
    return KVCompression(body.kv_compression.policy, body.kv_compression.ratio)


def session_id_of(request: Request) -> str | None:
    sid = request.headers.get("x-session-id")
    if sid is not None and not _SESSION_ID_RE.match(sid):
        raise APIError(400, "X-Session-ID must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", param="X-Session-ID")
    return sid


_POLICIES = ("full", "last", "summary", "memory", "hybrid")


def context_of(body: ChatCompletionRequest, request: Request) -> tuple[str | None, int | None] | None:
    """(policy, budget) from ``context_policy`` / ``context_budget`` or ``X-Context-Policy`` /
    ``X-Context-Budget`` (the body wins); None when neither is given (the session keeps its own)."""
    policy = body.context_policy or request.headers.get("x-context-policy")
    raw = request.headers.get("x-context-budget")
    budget = body.context_budget
    if budget is None and raw is not None:
        if not re.fullmatch(r"\s*[0-9]{1,7}\s*", raw) or int(raw) < 16:
            raise APIError(400, f"X-Context-Budget must be a number of tokens, at least 16, got {raw!r}",
                           param="X-Context-Budget")
        budget = int(raw)
    if policy is not None and policy.strip().lower() not in _POLICIES:
        raise APIError(400, f"X-Context-Policy must be one of {', '.join(_POLICIES)}, got {policy!r}",
                       param="X-Context-Policy")
    if policy is None and budget is None:
        return None
    return (policy.strip().lower() if policy else None), budget


def refuse_context_headers(request: Request) -> None:
    """``X-Context-Policy`` / ``X-Context-Budget`` on ``/v1/completions``: 400 naming the header (a context policy
    rewrites a conversation's messages; a text completion has none, so the header would be ignored)."""
    for name in ("X-Context-Policy", "X-Context-Budget"):
        if request.headers.get(name) is not None:
            raise APIError(400, f"{name} applies to chat sessions only (/v1/chat/completions with X-Session-ID): "
                                "a context policy keeps or drops a conversation's messages, and a text completion "
                                "has none; remove the header", param=name)


def session_priority_of(request: Request) -> int | None:
    raw = request.headers.get("x-session-priority")
    if raw is None:
        return None
    p = int(raw) if re.fullmatch(r"\s*[+-]?[0-9]{1,5}\s*", raw) else None  # no "1_0", "0x10", "1e2"
    if p is None or not -1000 <= p <= 1000:
        raise APIError(400, f"X-Session-Priority must be an integer from -1000 to 1000, got {raw!r}",
                       param="X-Session-Priority")
    return p
