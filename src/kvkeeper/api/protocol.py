"""The rules request bodies share, each checked here once: the model a body names, refused and unknown
fields, and the fields chat and text completions share (one SamplingParams per choice, the output
constraint, logit bias, stop strings, seeds, the cache namespace, KV compression).

Every function raises :class:`~kvkeeper.api.errors.APIError` naming the field at fault (400; 404 for a
model that is not served).  Token ids are checked against the vocabulary by the engine (an
``InvalidRequestError`` naming the field, a 400).
"""

from __future__ import annotations

import json
import re

from ..errors import KVKeeperError
from ..kvcache.compression import KVCompression
from ..sampling.params import SamplingParams
from ..sampling.structured import StructuredOutput
from .errors import APIError
from .prompt_cache import cache_namespace
from .request_parsing import RequestContext
from .schemas import _SamplingFields, refused_field, unknown_fields


def check_body(body, ctx: RequestContext) -> str | None:
    """The LoRA adapter ``body.model`` selects (None: omitted or the base model; 404 for a model not served),
    after the body's field rules: 400 for a field refused in its value (:data:`~kvkeeper.api.schemas.REFUSED`),
    ``stream_options`` without ``stream`` and, unless the server ignores them (``--ignore-unknown-fields``),
    a field no schema declares."""
    adapter = ctx.served.adapter(body.model)
    bad = refused_field(body)
    if bad is not None:
        raise APIError(400, f"{bad[0]} is not supported: {bad[1]}", param=bad[0])
    so = getattr(body, "stream_options", None)
    if so is not None and not body.stream:
        raise APIError(400, "stream_options applies to streamed responses only: send stream: true, or leave "
                            "stream_options out", param="stream_options")
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
    """The :class:`~kvkeeper.api.streams.GenerationRequest` fields both completions endpoints take from the
    body and its context: the cache namespace (the served one salted by the caller's tenant and the client's
    ``cache_salt`` or ``X-Cache-Salt``, narrowed by ``prompt_cache_key``: :mod:`~kvkeeper.api.prompt_cache`;
    :func:`~kvkeeper.kvcache.namespace.tenant_namespace`: a salt narrows the tenant's namespace, never widens
    it; None for neither), the LoRA adapter (``lora``, which the
    engine thread puts the namespace under), the session headers (``X-Session-Compression`` /
    ``X-Session-Compression-Ratio`` included) and ``kv_compression``."""
    ns = cache_namespace(ctx.served.namespace, ctx.tenant, body.cache_salt if body.cache_salt is not None
                         else ctx.cache_salt, body.prompt_cache_key)
    kv = body.kv_compression
    return dict(namespace=ns, lora=lora, session_id=ctx.session_id, session_priority=ctx.session_priority,
                compression=None if kv is None else KVCompression(kv.policy, kv.ratio), tenant=ctx.tenant,
                quota=ctx.quota, session_compression=None if ctx.session_compression is None
                and ctx.session_compression_ratio is None else (ctx.session_compression, ctx.session_compression_ratio))


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


def sampling_params(body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutput | None = None, prompt_logprobs: int | None = None,
                    prediction: str | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice; seeds seed, seed+1, ... when a seed is given.  Prompt logprobs go to the
    first choice only (the others share its prompt).  prediction: the text of chat's ``prediction`` (every choice
    drafts from it); ``speculative_decoding`` false opts out of speculative decoding."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 16:
        raise APIError(400, f"at most 16 stop strings, got {len(stop)}", param="stop")
    kw = dict(temperature=1.0 if body.temperature is None else body.temperature,
              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, max_tokens=max_tokens,
              min_p=body.min_p or 0.0, stop=stop, stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
              logprobs=logprobs, presence_penalty=body.presence_penalty or 0.0,
              frequency_penalty=body.frequency_penalty or 0.0,
              repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
              logit_bias=logit_bias_of(body), bad_words=body.bad_words or [], structured=structured,
              prediction=prediction or None, speculative=body.speculative_decoding)
    if body.seed is not None and body.seed + body.n - 1 > 2**63 - 1:
        raise APIError(400, f"seed + n - 1 must fit in 64 bits (choice i uses seed + i): seed {body.seed}, n {body.n}",
                       param="seed")
    try:
        return [SamplingParams(seed=None if body.seed is None else body.seed + i,
                               prompt_logprobs=prompt_logprobs if i == 0 else None, **kw) for i in range(body.n)]
    except KVKeeperError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None

