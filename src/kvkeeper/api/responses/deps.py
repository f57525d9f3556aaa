"""What the two routes of this package share (FastAPI dependencies and helpers): the app's stored responses and
conversations (opened on first use, expired by ``--session-ttl``), closing the sessions behind them (engine
thread) and the query of an item list (:class:`Paging`)."""

from __future__ import annotations

from typing import Literal

from fastapi import Query, Request

from ...sessions.session import session_key
from .conversation_store import ConversationStore
from .items import item_page
from .store import ResponseStore


def _session_config(request: Request):
    sessions = request.app.state.engine.sessions
    return sessions.config if sessions is not None else None


def response_store(request: Request) -> ResponseStore:
    """The app's stored responses (opened on first use: read back from the sessions' data directory, if any),
    those unused for ``--session-ttl`` forgotten first (their sessions expire on the engine thread)."""
    st, cfg = request.app.state, _session_config(request)
    if getattr(st, "responses", None) is None:
        st.responses = ResponseStore(data_dir=cfg.data_dir if cfg is not None else None)
    st.responses.expire(cfg.session_ttl_s if cfg is not None else None)
    return st.responses


def conversation_store(request: Request) -> ConversationStore:
    """The app's conversations (opened on first use and expired, as :func:`response_store`)."""
    st, cfg = request.app.state, _session_config(request)
    if getattr(st, "conversations", None) is None:
        st.conversations = ConversationStore(cfg.data_dir if cfg is not None else None)
    st.conversations.expire(cfg.session_ttl_s if cfg is not None else None)
    return st.conversations


async def close_sessions(request: Request, tenant: str | None, ids: list[str]) -> None:
    """Close the sessions of these responses (those still open), on the engine thread."""
    sessions = request.app.state.engine.sessions
    if sessions is None or not ids:
        return

    def close(_):
        for rid in ids:
            key = session_key(tenant, rid)
            if key in sessions:
                sessions.close(key)

    await request.app.state.engine.call(close)


class Paging:
    """The query of an item list: ``order`` ("desc", the default, or "asc"), ``limit`` (1-100, default 20) and
    ``after`` (an item id)."""

    def __init__(self, order: Literal["asc", "desc"] = "desc", limit: int = Query(20, ge=1, le=100),
                 after: str | None = None):
        self.order, self.limit, self.after = order, limit, after

    def page(self, items: list[dict]) -> dict:
        return item_page(items, self.order, self.limit, self.after)
