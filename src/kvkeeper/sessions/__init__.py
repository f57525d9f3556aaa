"""Conversations on top of the engine: sessions and their turn protocol, the session manager, offload
tiers (host memory, disk), context budgets and policies (the KV circuit breaker is
:mod:`kvkeeper.sessions.breaker`)."""

from .manager import SessionConfig, SessionManager
from .session import Session, Turn

__all__ = ["Session", "SessionConfig", "SessionManager", "Turn"]
