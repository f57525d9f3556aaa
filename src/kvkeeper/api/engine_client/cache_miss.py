"""Why a request missed the cache: a session's or cache key's request compared with its predecessor.

A request that names a session (``X-Session-ID`` and the agents' session headers, or a body's
``conversation_id``) or a ``prompt_cache_key`` is remembered by that key (its tenant's): the token ids of its
prompt plus its reply, and its cache namespace.  The next request of the same key should read from the cache
everything the two share; when it reads less, :func:`classify` says why, one of :data:`REASONS`:

* ``content_changed``: the prompts differ at ``at`` (a timestamp in the system prompt, a reordered tool list, an
  edited earlier message) and everything before it was read;
* ``namespace_changed``: the cache salt (``cache_salt`` / ``X-Cache-Salt``), the tenant, the LoRA adapter or the
  KV dtype differ from the predecessor's, so none of its KV can be read;
* ``evicted``: the prompts agree further than what was read: the blocks were evicted from the pool, or the
  session holding them was closed (its ``--session-ttl`` ran out, or a client closed it).  A TTL expiry is not
  told apart from an eviction (``expired`` is not reported);
* ``none``: nothing was lost (not counted, no header).

Reads are block-granular (the prefix cache keeps full blocks; a session turn whose prompt does not extend the
session's KV reads from it too) and the last prompt token is always computed, so the expected read is
``min(common, len(prompt) - 1)`` rounded down to a block: a loss within the last partial block is not reported.
Bounded: :class:`MissLog` remembers at most ``max_keys`` keys (the oldest forgotten first) and the last
``max_recent`` explanations.  Runs on the engine thread; :meth:`MissLog.recent` copies under a lock.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Callable, Hashable

from ...sessions.session import common_prefix

REASONS = ("content_changed", "namespace_changed", "evicted")  # the counted ones; "none" is neither sent nor counted
CONTEXT_CHARS = 40  # at most this many characters of text each side of the parting point


def classify(prev_ids: list[int], prev_ns, ids: list[int], ns, cached: int, block_size: int = 1) -> tuple[str, int]:
    """``(reason, at)`` for a prompt ``ids`` (namespace ``ns``) that read ``cached`` tokens from the cache after
    its predecessor's prompt plus reply ``prev_ids`` (namespace ``prev_ns``).  ``at``: the token index where the
    two parted (their common prefix's length).  ``block_size``: the granularity of reads (1: any token).
    reason: ``"none"`` when ``cached`` covers what could be read, else one of :data:`REASONS`."""
    at = common_prefix(prev_ids, ids)
    reusable = max(0, min(at, len(ids) - 1)) // block_size * block_size
    if prev_ns != ns and at > 0 and cached < reusable:
        return "namespace_changed", at
    if cached < reusable:
        return "evicted", at
    if at < len(prev_ids) and at < len(ids):
        return "content_changed", at
    return "none", at


@dataclass
class CacheMiss:
    """One explanation: ``key`` (the session id or ``prompt_cache_key``), ``kind`` ("session" / "cache_key"),
    ``reason`` (:data:`REASONS`), ``at`` (token index where the prompts parted), ``cached`` (tokens read),
    ``previous_tokens`` (the predecessor's prompt plus reply), ``prompt_tokens``, ``before`` (the shared text just
    before ``at``), ``previous`` / ``current`` (each prompt's text from ``at``; at most :data:`CONTEXT_CHARS`
    characters each), ``request_id``."""

    key: str
    kind: str
    reason: str
    at: int
    cached: int
    previous_tokens: int
    prompt_tokens: int
    before: str
    previous: str
    current: str
    request_id: str

    def header(self) -> str:
        """The ``X-KVKeeper-Cache-Miss`` value: ``reason=...; at=...; cached=...; previous=...; current=...``,
        the texts JSON strings with every non-ASCII character escaped (so the header stays ASCII)."""
        p, c = (json.dumps(t, ensure_ascii=True) for t in (self.previous[:16], self.current[:16]))
        return f"reason={self.reason}; at={self.at}; cached={self.cached}; previous={p}; current={c}"

    def to_dict(self) -> dict:
        return asdict(self)


class MissLog:
    """Per key the predecessor's token ids and namespace; the last explanations.

    decode: token ids -> text (the tokenizer's)."""

    def __init__(self, decode: Callable[[list[int]], str], max_keys: int = 4096, max_recent: int = 256):
        self.decode, self.max_keys = decode, max_keys
        self._last: OrderedDict[Hashable, tuple[array, object]] = OrderedDict()  # prompt + reply ids
        self._recent: deque[CacheMiss] = deque(maxlen=max_recent)
        self._lock = threading.Lock()

    def observe(self, key: Hashable, name: tuple[str, str], request_id: str, prompt: list[int], reply: list[int],
                ns, cached: int, block_size: int = 1) -> CacheMiss | None:
        """Compare a finished request (``prompt`` ids, ``cached`` of them read, namespace ``ns``) with its key's
        predecessor and remember it (``prompt + reply``) as the next one's; ``name``: (kind, key) as reported;
        ``block_size``: tokens per KV block (see :func:`classify`).  Returns the explanation, None when there was
        no predecessor or nothing was lost."""
        prev = self._last.pop(key, None)
        ids = array("i", prompt)  # 4 bytes a token: a 20k-token agent prompt is 80 kB, not ~0.7 MB as a list
        ids.extend(reply)
        self._last[key] = (ids, ns)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        if prev is None:
            return None
        reason, at = classify(prev[0], prev[1], prompt, ns, cached, block_size)
        if reason == "none":
            return None
        before = self.decode(prompt[max(0, at - 16):at])[-CONTEXT_CHARS:]
        miss = CacheMiss(name[1], name[0], reason, at, cached, len(prev[0]), len(prompt), before,
                         self.decode(prev[0][at:at + 16].tolist())[:CONTEXT_CHARS],
                         self.decode(prompt[at:at + 16])[:CONTEXT_CHARS], request_id)
        with self._lock:
            self._recent.append(miss)
        return miss

    def recent(self, limit: int | None = None) -> list[dict]:
        """The last ``limit`` explanations (all kept: None), newest last."""
        with self._lock:
            items = list(self._recent)
        return [m.to_dict() for m in (items[-limit:] if limit else items)]
