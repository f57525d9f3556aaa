"""The conversations of ``/v1/conversations``: items the server holds for a client, and their KV.

A conversation is a list of items (messages, ``function_call``, ``function_call_output``; the model's replies
marked as such, :func:`~kvkeeper.api.responses.items.reply_items`) and its KV is the session of the same id
(:mod:`kvkeeper.sessions`): a response with ``conversation`` runs as that session's next turn, rendering every
item, so the session's reuse rule hands its KV over (the whole previous turn, or the longest common prefix when
items were deleted or added by hand).  Conversations belong to the tenant that created them (another tenant's
id: 404) and, with a data directory, are JSON files under ``DATA_DIR/conversations`` read back at start.
Touched by the HTTP handlers only (the event loop's thread).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .records import OwnedRecords


@dataclass
class Conversation:
    """``items`` as stored (ids, the server's reply marks), ``call_ids`` of every function call in them."""

    id: str
    tenant: str | None
    created_at: int = field(default_factory=lambda: int(time.time()))
    metadata: dict = field(default_factory=dict)
    items: list[dict] = field(default_factory=list)
    call_ids: set[str] = field(default_factory=set)

    def obj(self) -> dict:
        """The conversation object (OpenAI's ``Conversation``)."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationStore(OwnedRecords):
    """Conversations by tenant and id; ``data_dir``: where they are kept across restarts (None: memory only)."""

    def __init__(self, data_dir: str | os.PathLike | None = None):
        super().__init__(Conversation, "conversation", "conversation_not_found",
                         Path(data_dir) / "conversations" if data_dir is not None else None, lambda c: c.created_at)
