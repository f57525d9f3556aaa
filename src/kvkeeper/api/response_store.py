"""The stored responses of ``/v1/responses``: what a later request names with ``previous_response_id``.

A stored response keeps its response object, its input items and the conversation through it (chat messages,
the model's replies as it generated them, without the request's ``instructions``); its KV is the session of the
same id (:mod:`kvkeeper.sessions`), which the next response forks.  Responses belong to the tenant that created
them: another tenant's id reads as unknown (404).  Touched by the HTTP handlers only (the event loop's thread).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .errors import APIError


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
    then closed by :meth:`put`'s caller through the ids it returns)."""

    def __init__(self, max_responses: int = 10_000):
        self.max_responses = max_responses
        self._by_key: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()

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
        dropped = []
        while len(self._by_key) > self.max_responses:
            dropped.append(self._by_key.popitem(last=False)[1])
        return dropped

    def delete(self, tenant: str | None, rid: str) -> StoredResponse:
        """Forget ``tenant``'s response ``rid`` and return it; APIError 404 as :meth:`get`."""
        r = self.get(tenant, rid)
        del self._by_key[(tenant, rid)]
        return r

    def __len__(self) -> int:
        return len(self._by_key)
