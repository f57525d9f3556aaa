"""A request's headers and caller, parsed once: the :class:`RequestContext` a body converts itself under.

Headers: ``X-Session-ID`` (or the first of :data:`SESSION_HEADERS` present: the headers coding agents name their
session with; ``serve --session-headers`` sets the list), ``X-Session-Priority``, ``X-Cache-Salt``,
``X-Context-Policy`` / ``X-Context-Budget`` (chat only).  Every parser raises
:class:`~kvkeeper.api.common.errors.APIError` (400) naming
the header at fault.

What a request reaches of the server's sessions (:func:`managed_sessions`, :func:`owned_session`): only its
caller's tenant's, another tenant's id answering 404 exactly as an unknown one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from ...sessions.context import CONTEXT_POLICIES
from .auth import Caller
from .errors import APIError
from .served import ServedModels

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_CONTEXT_HEADERS = ("X-Context-Policy", "X-Context-Budget")
# The headers that name a session, first found wins: kvkeeper's and OpenCode's, Claude Code's, Codex CLI's.
SESSION_HEADERS = ("X-Session-ID", "X-Claude-Code-Session-Id", "session-id")


@dataclass(frozen=True)
class RequestContext:
    """What a request body is converted under, besides itself.

    served: the engine thread's snapshot (:class:`~kvkeeper.api.common.served.ServedModels`).  tenant, quota: the
    caller's (:mod:`kvkeeper.api.common.auth`).  refuse_unknown_fields: 400 for a field no schema declares.
    session_id, session_priority, cache_salt: the headers' values (None: absent).  context_policy,
    context_budget (tokens): ``X-Context-Policy`` / ``X-Context-Budget`` (policy lower-cased).
    session_compression, session_compression_ratio: ``X-Session-Compression`` / ``X-Session-Compression-Ratio``
    (:mod:`kvkeeper.sessions.compress`).
    """

    served: ServedModels
    tenant: str | None = None
    quota: Any = None
    refuse_unknown_fields: bool = True
    session_id: str | None = None
    session_priority: int | None = None
    cache_salt: str | None = None
    context_policy: str | None = None
    context_budget: int | None = None
    session_compression: str | None = None
    session_compression_ratio: float | None = None


def request_context(request: Request, who: Caller, chat: bool = True) -> RequestContext:
    """Parse the request's headers; ``chat`` False (``/v1/completions``) refuses the context headers."""
    h, st = request.headers, request.app.state
    if not chat:
        _refuse_context_headers(request)
    sid = session_header(request)
    policy, budget = context_headers(request)
    comp, ratio = compression_headers(request)
    return RequestContext(st.engine.served, who.tenant, who.quota, _refuse_unknown(request), sid,
                          _session_priority(h.get("x-session-priority")), h.get("x-cache-salt"), policy, budget,
                          comp, ratio)


def body_session(ctx: RequestContext, conversation_id: str | None) -> RequestContext:
    """``ctx`` with the session a body's ``conversation_id`` names (vLLM's multi-turn benchmark sends one per
    conversation; chat completions map it to a session as ``X-Session-ID``).  400 naming ``conversation_id`` for an
    id that is not 1 to 128 characters of ``A-Z a-z 0-9 . _ : -``, or that differs from a session header's."""
    if conversation_id is None:
        return ctx
    if not SESSION_ID_RE.match(conversation_id):
        raise APIError(400, "conversation_id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
                       param="conversation_id")
    if ctx.session_id is not None and ctx.session_id != conversation_id:
        raise APIError(400, f"conversation_id {conversation_id!r} names another session than the session header "
                            f"({ctx.session_id!r}); send one of them", param="conversation_id")
    return replace(ctx, session_id=conversation_id)


def session_header(request: Request) -> str | None:
    """The session id of the first of the app's session headers (``app.state.session_headers``, default
    :data:`SESSION_HEADERS`) the request has; 400 naming the header for an id that is not 1 to 128 characters of
    ``A-Z a-z 0-9 . _ : -``."""
    for name in getattr(request.app.state, "session_headers", None) or SESSION_HEADERS:
        sid = request.headers.get(name)
        if sid is not None:
            if not SESSION_ID_RE.match(sid):
                raise APIError(400, f"{name} must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", param=name)
            return sid
    return None


def served_context(request: Request) -> RequestContext:
    """The context of a body that reads no header and no caller (``/tokenize``, ``/detokenize``)."""
    return RequestContext(request.app.state.engine.served, refuse_unknown_fields=_refuse_unknown(request))


def _refuse_unknown(request: Request) -> bool:
    return getattr(request.app.state, "refuse_unknown_fields", True)


def context_headers(request: Request) -> tuple[str | None, int | None]:
    """(policy, budget) of ``X-Context-Policy`` / ``X-Context-Budget`` (None where absent)."""
    policy = request.headers.get("x-context-policy")
    raw = request.headers.get("x-context-budget")
    budget = None
    if raw is not None:
        if not re.fullmatch(r"\s*[0-9]{1,7}\s*", raw) or int(raw) < 16:
            raise APIError(400, f"X-Context-Budget must be a number of tokens, at least 16, got {raw!r}",
                           param="X-Context-Budget")
        budget = int(raw)
    if policy is not None and policy.strip().lower() not in CONTEXT_POLICIES:
        raise APIError(400, f"X-Context-Policy must be one of {', '.join(CONTEXT_POLICIES)}, got {policy!r}",
                       param="X-Context-Policy")
    return (policy.strip().lower() if policy is not None else None), budget


def compression_headers(request: Request) -> tuple[str | None, float | None]:
    """(policy, ratio) of ``X-Session-Compression`` / ``X-Session-Compression-Ratio`` (None where absent); a 400
    naming the header for an unknown policy or a ratio that is not a number in [0, 1)."""
    from ...sessions.compress import SESSION_COMPRESSION_POLICIES

    policy = request.headers.get("x-session-compression")
    raw = request.headers.get("x-session-compression-ratio")
    ratio = None
    if raw is not None:
        try:
            ratio = float(raw) if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", raw) else None
        except ValueError:
            ratio = None
        if ratio is None or not 0 <= ratio < 1:
            raise APIError(400, f"X-Session-Compression-Ratio must be a number in [0, 1) (the fraction of the session's "
                                f"KV dropped at the end of each turn), got {raw!r}", param="X-Session-Compression-Ratio")
    if policy is not None and policy.strip().lower() not in SESSION_COMPRESSION_POLICIES:
        names = ", ".join(SESSION_COMPRESSION_POLICIES)
        raise APIError(400, f"X-Session-Compression must be one of {names}, got {policy!r}",
                       param="X-Session-Compression")
    return (policy.strip().lower() if policy is not None else None), ratio


def _refuse_context_headers(request: Request) -> None:
    """``X-Context-Policy`` / ``X-Context-Budget`` on ``/v1/completions``: 400 naming the header (a context policy
    rewrites a conversation's messages; a text completion has none, so the header would be ignored)."""
    for name in _CONTEXT_HEADERS:
        if request.headers.get(name) is not None:
            raise APIError(400, f"{name} applies to chat sessions only (/v1/chat/completions with X-Session-ID): "
                                "a context policy keeps or drops a conversation's messages, and a text completion "
                                "has none; remove the header", param=name)


def _session_priority(raw: str | None) -> int | None:
    if raw is None:
        return None
    p = int(raw) if re.fullmatch(r"\s*[+-]?[0-9]{1,5}\s*", raw) else None  # no "1_0", "0x10", "1e2"
    if p is None or not -1000 <= p <= 1000:
        raise APIError(400, f"X-Session-Priority must be an integer from -1000 to 1000, got {raw!r}",
                       param="X-Session-Priority")
    return p


def managed_sessions(request: Request):
    """The server's SessionManager; 404 when the server keeps no sessions."""
    sessions = request.app.state.engine.sessions
    if sessions is None:
        raise APIError(404, "this server keeps no sessions", type="not_found_error", code="session_not_found")
    return sessions


def owned_session(sessions, tenant: str | None, sid: str):
    """``tenant``'s open session ``sid`` (engine thread); 404 when it has none of that id (another tenant's
    session of the same id included: the answer does not tell them apart)."""
    s = sessions.find(tenant, sid)
    if s is None:
        raise APIError(404, f"no open session {sid!r}", type="not_found_error", code="session_not_found")
    return s
