"""From an HTTP request to engine inputs: messages, sampling params, cache namespace, session headers.

Every function raises :class:`~kvkeeper.api.errors.APIError` (400) naming the field or header at fault.
"""

from __future__ import annotations

import re

from fastapi import Request

from ..sampling.params import SamplingParams
from ..errors import KVKeeperError
from ..kvcache.compression import KVCompression
from ..kvcache.namespace import Namespace
from .errors import APIError
from .schemas import ChatCompletionRequest, TokenizeRequest, _SamplingFields

_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def check_model(model: str | None, served: str) -> None:
    """404 unless ``model`` is omitted or the served model's id."""
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                       type="not_found_error", param="model", code="model_not_found")


def messages_of(body: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """``{"role", "content"}`` dicts: text parts joined by newlines, ``developer`` read as ``system``."""
    out = []
    for i, m in enumerate(body.messages):
        c = m.content
        if c is None:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].content is missing", param=f"messages.{i}.content")
            c = ""
        elif isinstance(c, list):
            parts = []
            for j, p in enumerate(c):
                if p.type != "text" or p.text is None:
                    raise APIError(400, f"messages[{i}].content[{j}] has type {p.type!r}; only text parts "
                                        "({'type': 'text', 'text': ...}) are supported",
                                   param=f"messages.{i}.content.{j}")
                parts.append(p.text)
            c = "\n".join(parts)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": c})
    return out


def sampling_of(body: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> list[SamplingParams]:
    """One SamplingParams per choice; seeds seed, seed+1, ... when a seed is given."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported (only 0)", param=name)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 16:
        raise APIError(400, f"at most 16 stop strings, got {len(stop)}", param="stop")
    kw = dict(temperature=1.0 if body.temperature is None else body.temperature,
              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, max_tokens=max_tokens,
              stop=stop, ignore_eos=body.ignore_eos, logprobs=logprobs)
    try:
        return [SamplingParams(seed=None if body.seed is None else body.seed + i, **kw) for i in range(body.n)]
    except KVKeeperError as e:
        raise APIError(400, str(e)) from None


def namespace_of(body: _SamplingFields, request: Request, base: Namespace) -> Namespace | None:
    """The request's cache namespace: ``base`` salted by ``cache_salt`` or ``X-Cache-Salt`` (None: unsalted)."""
    salt = body.cache_salt if body.cache_salt is not None else request.headers.get("x-cache-salt")
    if salt is None:
        return None
    if not salt or len(salt) > 256:
        raise APIError(400, "cache salt must be 1 to 256 characters", param="cache_salt")
    return Namespace(base.model_revision, adapter=base.adapter, tenant_salt=salt, kv_dtype=base.kv_dtype)


def compression_of(body: _SamplingFields) -> KVCompression | None:
    if body.kv_compression is None:
        return None
    return KVCompression(body.kv_compression.policy, body.kv_compression.ratio)


def session_id_of(request: Request) -> str | None:
    sid = request.headers.get("x-session-id")
    if sid is not None and not _SESSION_ID_RE.match(sid):
        raise APIError(400, "X-Session-ID must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", param="X-Session-ID")
    return sid


def session_priority_of(request: Request) -> int | None:
    raw = request.headers.get("x-session-priority")
    if raw is None:
        return None
    p = int(raw) if re.fullmatch(r"\s*[+-]?[0-9]{1,5}\s*", raw) else None  # no "1_0", "0x10", "1e2"
    if p is None or not -1000 <= p <= 1000:
        raise APIError(400, f"X-Session-Priority must be an integer from -1000 to 1000, got {raw!r}",
                       param="X-Session-Priority")
    return p
