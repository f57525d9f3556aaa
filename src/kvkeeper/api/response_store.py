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

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..sessions.disk import session_dir_name
from ..sessions.session import session_key
from .errors import APIError

log = logging.getLogger(__name__)


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


class ResponseStore:
    """Stored responses by tenant and id, at most ``max_responses`` (the oldest forgotten first: its session is
    then closed by :meth:`put`'s caller through the ids it returns).  ``data_dir``: where they are kept across
    restarts (None: in memory only); unreadable files are logged and skipped."""

    def __init__(self, max_responses: int = 10_000, data_dir: str | os.PathLike | None = None):
        self.max_responses = max_responses
        self._by_key: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self.dir = Path(data_dir) / "responses" if data_dir is not None else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._load()

    def _path(self, tenant: str | None, rid: str) -> Path:
        return self.dir / f"{session_dir_name(session_key(tenant, rid))}.json"

    def _load(self) -> None:
        found = []
        for p in self.dir.glob("*.json"):
            try:
                d = json.loads(p.read_text())
                found.append(StoredResponse(**{**d, "call_ids": set(d["call_ids"])}))
            except (OSError, ValueError, TypeError, KeyError) as e:
                log.warning("skipping the stored response %s: %s", p, e)
        for r in sorted(found, key=lambda r: r.stored_at):
            self._by_key[(r.tenant, r.id)] = r

    def _write(self, r: StoredResponse) -> None:
        path = self._path(r.tenant, r.id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**asdict(r), "call_ids": sorted(r.call_ids)}, ensure_ascii=False))
        os.replace(tmp, path)

    def get(self, tenant: str | None, rid: str, param: str | None = None) -> StoredResponse:
        """``tenant``'s stored response ``rid``; APIError 404 for an unknown id (another tenant's included)."""
        r = self._by_key.get((tenant, rid))
        if r is None:
            raise APIError(404, f"no stored response {rid!r} (it was never stored, was deleted, or belongs to another "
                                "API key)", type="not_found_error", param=param, code="response_not_found")
        return r

    def put(self, r: StoredResponse) -> list[StoredResponse]:
        """Store ``r``; returns the responses forgotten to stay within ``max_responses``."""
        self._by_key[(r.tenant, r.id)] = r
        if self.dir is not None:
            self._write(r)
        dropped = []
        while len(self._by_key) > self.max_responses:
            dropped.append(self._forget(*next(iter(self._by_key))))
        return dropped

    def delete(self, tenant: str | None, rid: str) -> StoredResponse:
        """Forget ``tenant``'s response ``rid`` and return it; APIError 404 as :meth:`get`."""
        self.get(tenant, rid)
        return self._forget(tenant, rid)

    def _forget(self, tenant: str | None, rid: str) -> StoredResponse:
        r = self._by_key.pop((tenant, rid), None)
        if self.dir is not None:
            self._path(tenant, rid).unlink(missing_ok=True)
        return r

    def __len__(self) -> int:
        return len(self._by_key)
