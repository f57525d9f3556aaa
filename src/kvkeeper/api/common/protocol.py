"""The rules request bodies share, each checked here once for every endpoint (chat, text completions, the
Responses API): the model a body names, refused and unknown fields (:func:`check_body`), the sampling fields (one
SamplingParams per choice: :func:`sampling_params`; logit bias, stop strings, seeds), the output constraint and
its clash with tools (:func:`structured_output`, :func:`output_constraint`), the cache namespace
(:func:`cache_namespace`), a session's compression and KV compression.

Prompt caching (OpenAI's ``prompt_cache_key``, :func:`cache_namespace`): the key names the cache entry a
request's prefixes belong to: requests of one tenant with the same key share their cached prefixes, requests with
another key (or none) never hit them, and another tenant's requests never do, whatever key they send (the key
narrows the tenant's namespace like ``cache_salt``: :func:`~kvkeeper.kvcache.namespace.tenant_namespace`).  With
``cache_salt`` as well, both narrow it.

Every function raises :class:`~kvkeeper.api.common.errors.APIError` naming the field at fault (400; 404 for a
model that is not served).  Token ids are checked against the vocabulary by the engine (an
``InvalidRequestError`` naming the field, a 400).
"""

from __future__ import annotations

import json
import re

from ...errors import KVKeeperError
from ...kvcache.compression import KVCompression
from ...kvcache.namespace import tenant_namespace
from ...sampling.params import SamplingParams
from ...sampling.structured import StructuredOutput
from .context import RequestContext
from .errors import APIError
from .schemas import RETENTION_SECONDS, StreamOptions, _SamplingFields, refused_field, unknown_fields
from .tools import ToolUse


def check_body(body, ctx: RequestContext, refused: dict[str, tuple[tuple, str]] | None = None) -> str | None:
    """The LoRA adapter ``body.model`` selects (None: omitted or the base model; 404 for a model not served),
    after the body's field rules: 400 for a field refused in its value (:data:`~kvkeeper.api.common.schemas.REFUSED`),
    ``stream_options`` without ``stream`` and, unless the server ignores them (``--ignore-unknown-fields``),
    a field no schema declares.  refused: the table of refused fields (default
    :data:`~kvkeeper.api.common.schemas.REFUSED`; the Responses API's is its own)."""
    adapter = ctx.served.adapter(body.model)
    bad = refused_field(body, refused)
    if bad is not None:
        raise APIError(400, f"{bad[0]} is not supported: {bad[1]}", param=bad[0])
    so = getattr(body, "stream_options", None)
    if so is not None and not body.stream:
        raise APIError(400, "stream_options applies to streamed responses only: send stream: true, or leave "
                            "stream_options out", param="stream_options")
    if not isinstance(so, StreamOptions):  # the Responses API's (include_usage, include_obfuscation): its own rules
        so = None
    if so is not None and so.continuous_usage_stats and not so.include_usage:
        raise APIError(400, "stream_options.continuous_usage_stats puts the usage in every chunk: it needs "
                            "include_usage: true", param="stream_options.continuous_usage_stats")
    if so is not None and so.include_obfuscation:
        raise APIError(400, "stream_options.include_obfuscation is not supported: chunks are not padded; "
                            "send false or omit it", param="stream_options.include_obfuscation")
    refuse_unknown(body, ctx)
    return adapter.name if adapter is not None else None


def refuse_unknown(body, ctx: RequestContext) -> None:
    """400 naming the first field of ``body`` no schema declares (unless the server ignores them)."""
    if ctx.refuse_unknown_fields:
        unknown = unknown_fields(body)
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r}: this server does not implement it, and does not "
                                "silently ignore a field; remove it (or start the server with "
                                "--ignore-unknown-fields)", param=unknown[0])


def generation_fields(body: _SamplingFields, ctx: RequestContext, lora: str | None) -> dict:
    """The :class:`~kvkeeper.api.common.streams.GenerationRequest` fields both completions endpoints take from the
    body and its context: the cache namespace (:func:`cache_namespace`), the LoRA adapter (``lora``, which the
    engine thread puts the namespace under), the session headers (``X-Session-Compression`` /
    ``X-Session-Compression-Ratio`` included: :func:`session_compression`) and ``kv_compression``."""
    kv = body.kv_compression
    return dict(namespace=cache_namespace(body, ctx), lora=lora, session_id=ctx.session_id,
                retention=retention_of(body.prompt_cache_retention), cache_key=body.prompt_cache_key,
                session_priority=ctx.session_priority, tenant=ctx.tenant, quota=ctx.quota,
                compression=None if kv is None else KVCompression(kv.policy, kv.ratio),
                session_compression=session_compression(ctx.session_compression, ctx.session_compression_ratio))


def retention_of(value: str | None) -> tuple[None, float] | None:
    """The retention hold of ``prompt_cache_retention`` (:data:`~kvkeeper.api.common.schemas.RETENTION_SECONDS`):
    ``(None, seconds)`` (the whole prompt's full blocks) for "24h", None (no hold) for "in_memory" or none."""
    seconds = RETENTION_SECONDS[value]
    return None if seconds is None else (None, seconds)


def session_compression(policy: str | None, ratio: float | None) -> tuple[str | None, float | None] | None:
    """A session's compression as the engine's request takes it: ``(policy, ratio)``, None for neither."""
    return None if policy is None and ratio is None else (policy, ratio)


def cache_namespace(body, ctx: RequestContext):
    """The request's prefix-cache namespace (every endpoint's one rule): the served one under the caller's tenant,
    the client's ``cache_salt`` (or ``X-Cache-Salt``) and ``prompt_cache_key``, each a component of its own
    (:func:`~kvkeeper.kvcache.namespace.tenant_namespace`: typed and length-prefixed, so no salt can spell a key;
    a salt narrows the tenant's namespace, never widens it); None for none of them.  ``prompt_cache_key``: requests
    of one tenant with the same key share their cached prefixes, other keys (or none) never hit them.  Raises
    APIError (400) for a salt or key that is empty or longer than 256 characters."""
    salt = body.cache_salt if body.cache_salt is not None else ctx.cache_salt
    key = body.prompt_cache_key
    for value, param in ((salt, "cache_salt"), (key, "prompt_cache_key")):
        if value is not None and (not value or len(value) > 256):
            raise APIError(400, f"{param} must be 1 to 256 characters", param=param)
    if salt is None and key is None and ctx.tenant is None:
        return None
    return tenant_namespace(ctx.served.namespace, ctx.tenant, salt, key)


def prediction_text(body) -> str | None:
    """The text of chat's ``prediction`` (OpenAI's Predicted Outputs; its text parts joined), None without one;
    400 for a part that is not text."""
    pred = getattr(body, "prediction", None)
    if pred is None:
        return None
    if isinstance(pred.content, str):
        return pred.content
    for i, part in enumerate(pred.content):
        if part.type != "text" or part.text is None:
            raise APIError(400, f"prediction.content.{i}: only text parts are supported (type \"text\" with its "
                                "\"text\")", param=f"prediction.content.{i}")
    return "".join(part.text for part in pred.content)


def logit_bias_of(body) -> dict[int, float]:
    """``{token id: bias}`` from OpenAI's ``{"id as a string": bias}`` (none for a body without ``logit_bias``); 400
    for other keys or out-of-range biases."""
    out = {}
    for k, v in (getattr(body, "logit_bias", None) or {}).items():
        if not re.fullmatch(r"[0-9]{1,9}", k.strip()):
            raise APIError(400, f"logit_bias keys must be token ids written as strings, e.g. {{\"35716\": -100}}; "
                                f"got {k!r}", param="logit_bias")
        if not -100 <= v <= 100:
            raise APIError(400, f"logit_bias values must be between -100 and 100, got {v} for token {k}",
                           param="logit_bias")
        out[int(k)] = float(v)
    return out


def structured_output(body: _SamplingFields) -> StructuredOutput | None:
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
        schema = rf.json_schema.json_schema  # omitted: any JSON object; {} is any JSON value, as at every door
        found.append(json_output({"type": "object"} if schema is None else schema, "response_format"))
    found += _guided(body)
    if len(found) > 1:
        raise APIError(400, f"{found[1].param} and {found[0].param} both constrain the output: give one",
                       param=found[1].param)
    return found[0] if found else None


def json_output(v, param: str) -> StructuredOutput:
    """The output constraint of a JSON schema (a dict or its JSON text) given in the request field ``param``: the one
    door of ``response_format``, ``guided_json`` and ``structured_outputs.json`` to the grammar compiler (which
    bounds what the schema leaves unbounded, :func:`kvkeeper.sampling.structured.bounded_schema`)."""
    return StructuredOutput("json_schema", _schema(v, param), param)


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
        out.append(json_output(body.guided_json, "guided_json"))
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
        out.append(json_output(v, param) if k == "json" else StructuredOutput(kind, v, param))
    return out


def _field(body, name: str, default):
    """``body.name``, or ``default`` when it is None or the body's schema has no such field (the Responses API's
    body has none of the completions' extension fields)."""
    value = getattr(body, name, None)
    return default if value is None else value


def sampling_params(body, max_tokens: int | None, logprobs: int | None = None,
                    structured: StructuredOutput | None = None, prompt_logprobs: int | None = None,
                    prediction: str | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice of a body of any endpoint (chat, text completions, responses): the one
    conversion of the sampling fields.  Seeds seed, seed+1, ... when a seed is given.  Prompt logprobs go to the
    first choice only (the others share its prompt).  prediction: the text of chat's ``prediction`` (every choice
    drafts from it; "" for an empty one, which drafts nothing but is still reported in the usage);
    ``speculative_decoding`` false opts out of speculative decoding.  A field the body's schema
    lacks takes its default (one choice, no seed, no stop strings...).  max_tokens: the endpoint's field
    (``max_completion_tokens`` / ``max_tokens`` / ``max_output_tokens``).  Raises APIError (400) naming the field
    at fault."""
    stop = _field(body, "stop", [])
    stop = [stop] if isinstance(stop, str) else list(stop)
    if len(stop) > 16:
        raise APIError(400, f"at most 16 stop strings, got {len(stop)}", param="stop")
    kw = dict(temperature=_field(body, "temperature", 1.0), top_p=_field(body, "top_p", 1.0),
              top_k=_field(body, "top_k", 0), max_tokens=max_tokens, min_p=_field(body, "min_p", 0.0), stop=stop,
              stop_token_ids=_field(body, "stop_token_ids", []), ignore_eos=_field(body, "ignore_eos", False),
              logprobs=logprobs, presence_penalty=_field(body, "presence_penalty", 0.0),
              frequency_penalty=_field(body, "frequency_penalty", 0.0),
              repetition_penalty=_field(body, "repetition_penalty", 1.0), logit_bias=logit_bias_of(body),
              min_tokens=_field(body, "min_tokens", 0),
              bad_words=_field(body, "bad_words", []), structured=structured, prediction=prediction,
              speculative=_field(body, "speculative_decoding", True))
    n, seed = _field(body, "n", 1), _field(body, "seed", None)
    if seed is not None and seed + n - 1 > 2**63 - 1:
        raise APIError(400, f"seed + n - 1 must fit in 64 bits (choice i uses seed + i): seed {seed}, n {n}",
                       param="seed")
    try:
        return [SamplingParams(seed=None if seed is None else seed + i,
                               prompt_logprobs=prompt_logprobs if i == 0 else None, **kw) for i in range(n)]
    except KVKeeperError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


def output_constraint(fmt: StructuredOutput | None, tools: ToolUse | None) -> StructuredOutput | None:
    """The output's grammar, the one rule of every endpoint: the requested format's (``fmt``: from
    ``response_format``, ``guided_*``, ``structured_outputs`` or the Responses API's ``text.format``) or the tool
    calls' (None for neither).  A JSON format (``json_schema``, ``json_object``) beside tool_choice ``auto`` is the
    final answer's: the output is either one JSON value of the format or calls (OpenAI's rule; Codex CLI's
    ``--output-schema`` sends its tools with it).  Any other pair is a 400 naming the format's field."""
    calls = tools.structured() if tools is not None else None
    if fmt is not None and calls is not None and tools.choice == "auto" and fmt.kind in ("json_schema", "json_object"):
        return tools.structured_or_json(fmt.spec if fmt.kind == "json_schema" else {"type": "object"}, fmt.param)
    if fmt is not None and calls is not None:
        raise APIError(400, f"{fmt.param} and tools (tool_choice {tools.choice}) both constrain the output; send "
                            f"tool_choice \"none\" or drop {fmt.param}", param=fmt.param)
    return fmt or calls
