"""The stored responses of ``/v1/responses``: what a later request names with ``previous_response_id``.

A stored response keeps its response object, its input items and the conversation through it (chat messages,
the model's replies as it generated them, without the request's ``instructions``); its KV is the session of the
same id (:mod:`kvkeeper.sessions`), which the next response forks.  Responses belong to the tenant that created
them: another tenant's id reads as unknown (404).  Touched by the HTTP handlers only (the event loop's thread).

With a data directory (``--data-dir``) every stored response is also a JSON file under ``DATA_DIR/responses``
(written atomically, removed on delete) and the store is read back at start: with the sessions the disk tier
saves at shutdown, a stored response is continued after a restart with its KV restored from disk.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .records import OwnedRecords


@dataclass
class StoredResponse:
    """One stored response: ``body`` (the response object as served), ``input_items`` (as stored),
    ``history`` (chat message dicts of the conversation through this response), ``call_ids`` (every function
    call id the conversation made so far), ``tenant`` (the owner; None without keys)."""

    id: str
    tenant: str | None
    body: dict
    input_items: list[dict]
    history: list[dict]
    call_ids: set[str] = field(default_factory=set)
    stored_at: float = field(default_factory=time.time)


class ResponseStore(OwnedRecords):
    """Stored responses by tenant and id, at most ``max_responses`` (the oldest forgotten first: its session is
    then closed by :meth:`put`'s caller through the responses it returns).  ``data_dir``: where they are kept
    across restarts (None: in memory only); unreadable files are logged and skipped."""

    def __init__(self, max_responses: int = 10_000, data_dir: str | os.PathLike | None = None):
        super().__init__(StoredResponse, "stored response", "response_not_found",
                         Path(data_dir) / "responses" if data_dir is not None else None, lambda r: r.stored_at)
        self.max_responses = max_responses

    def put(self, r: StoredResponse) -> list[StoredResponse]:
        """Store ``r``; returns the responses forgotten to stay within ``max_responses``."""
        self.save(r)
        return [self.delete(*next(iter(self.by_key))) for _ in range(len(self) - self.max_responses)]
