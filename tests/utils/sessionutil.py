"""One SessionManager per engine for tests that run sessions on a shared engine fixture."""

from __future__ import annotations

import weakref

from kvkeeper.sessions import SessionManager

_MANAGERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def sessions_of(engine, **settings) -> SessionManager:
    """The engine's session manager (made on first use with ``settings``: SessionConfig fields)."""
    m = _MANAGERS.get(engine)
    if m is None:
        m = _MANAGERS[engine] = SessionManager(engine, **settings)
    return m
