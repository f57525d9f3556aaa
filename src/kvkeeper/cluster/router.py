"""Which replica serves a request: the routing policy of ``kvkeeper serve --replicas N``, free of Ray.

Four rules, tried in order (:func:`choose`), each decision counted by reason in
``kvkeeper:cluster_routing_decisions_total{reason}``:

1. **session** -- a request with ``X-Session-ID`` goes to the replica that owns the session on a
   consistent-hash ring (:class:`HashRing`, Karger et al., "Consistent hashing and random trees",
   STOC 1997; virtual nodes as in Dynamo, DeCandia et al., SOSP 2007).  Adding or losing a replica
   remaps only the sessions of the ring arcs it gains or loses: the lost replica's sessions.
2. **cache key** -- otherwise a request with ``prompt_cache_key`` goes to the owner of ``pck:<key>`` on the same
   ring: requests naming one cache entry share one replica's prefix cache (a tenant's key scopes its entry on
   the replica, :func:`kvkeeper.api.common.protocol.cache_namespace`; the router sees no tenant, so two tenants' equal keys share a
   replica, never a cache entry).
3. **prefix** -- otherwise the replica whose published summary (:class:`PrefixSummary`) holds the
   longest run of the request's first prompt blocks (:func:`prompt_block_hashes`), as in the
   prefix-aware routers of SGLang and Ray Serve LLM's ``PrefixCacheAffinityRouter``.
4. **load** -- otherwise the less loaded of two replicas drawn at random (Mitzenmacher, "The power
   of two choices in randomized load balancing", 2001); Ray Serve probes their queue lengths.

The blocks are blocks of the request's *text* (messages as role and content, or the raw prompt),
not of its tokens: the router runs in front of the replicas without a tokenizer.  A replica
summarizes the text blocks of the prompts it served, most recent first, which follows its prefix
cache's content (a replica that served a prompt holds its KV blocks until they are evicted).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

TEXT_BLOCK_CHARS = 256  # characters of prompt text per routing block
MAX_PROMPT_BLOCKS = 16  # the first blocks of a prompt that are hashed (4,096 characters)
from .config import DEFAULT_SUMMARY_SIZE  # noqa: E402  (block hashes a replica publishes at most)
REASONS = ("session", "cache_key", "prefix", "load")

REGISTRY = CollectorRegistry(auto_describe=True)
DECISIONS = Counter("kvkeeper:cluster_routing_decisions", "Requests routed to a replica, by reason: session "
                    "(consistent hash of X-Session-ID), prefix (longest cached prompt prefix), load (less loaded "
                    "of two random replicas).", ["reason"], registry=REGISTRY)
INDEX_BLOCKS = Gauge("kvkeeper:cluster_kv_index_blocks", "KV blocks each replica's prefix cache holds as the "
                     "token-exact router's index knows them from the replica's KV events (--kv-events-config).",
                     ["replica"], registry=REGISTRY)


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring of replica ids, ``vnodes`` points each (64-bit blake2b positions).

    ``owner(key)`` is the replica of the first point clockwise of ``blake2b(key)``.  Raises
    ValueError for an empty ring or ``vnodes`` < 1.
    """

    def __init__(self, nodes: Iterable[str], vnodes: int = 64):
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.nodes = frozenset(nodes)
        if not self.nodes:
            raise ValueError("a hash ring needs at least one replica")
        points = sorted((_h(f"{n}#{i}".encode()), n) for n in self.nodes for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def owner(self, key: str) -> str:
        i = bisect.bisect(self._keys, _h(key.encode())) % len(self._keys)
        return self._owners[i]


def _message_text(m: dict) -> str:
    content = m.get("content")
    if isinstance(content, list):  # content parts: their text parts, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return f"<{m.get('role', '')}>{content if isinstance(content, str) else ''}\x1e"


def prompt_text(body: dict) -> str:
    """The text a request's prompt is made of: chat messages as ``<role>content``, or the raw prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


def prompt_block_hashes(body: dict, salt: str = "", block_chars: int = TEXT_BLOCK_CHARS,
                        max_blocks: int = MAX_PROMPT_BLOCKS) -> list[str]:
    """Chained hashes (16 hex digits each) of the first full ``block_chars``-character blocks of a
    request's prompt text (at most ``max_blocks``); block i's hash covers blocks 0..i, the model and
    ``salt`` (the tenant's cache salt: tenants never share KV).  A prompt shorter than a block gives []."""
    text = prompt_text(body)
    out, prev = [], f"{body.get('model', '')}\x1f{salt}".encode()
    for i in range(min(max_blocks, len(text) // block_chars)):
        prev = hashlib.blake2b(prev + text[i * block_chars:(i + 1) * block_chars].encode(), digest_size=8).digest()
        out.append(prev.hex())
    return out


class PrefixSummary:
    """A replica's bounded summary of the prompt blocks it holds: the ``max_size`` most recently seen
    block hashes (least recently used dropped first)."""

    def __init__(self, max_size: int = DEFAULT_SUMMARY_SIZE):
        if max_size < 1:
            raise ValueError(f"a prefix summary holds at least one hash, got max_size={max_size}")
        self.max_size = max_size
        self._lru: OrderedDict[str, None] = OrderedDict()

    def add(self, hashes: Iterable[str]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.max_size:
            self._lru.popitem(last=False)

    def __len__(self) -> int:
        return len(self._lru)

    def snapshot(self) -> list[str]:
        """The hashes, most recent last (what a replica publishes in its routing stats)."""
        return list(self._lru)


def longest_match(hashes: Sequence[str], held: set[str] | frozenset[str]) -> int:
    """Blocks of ``hashes`` (chained) held from the start: the first miss ends the match."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


@dataclass
class Candidate:
    """A replica as the policy sees it: its id and the block hashes its summary holds."""

    id: str
    prefix: frozenset[str] = field(default_factory=frozenset)


@dataclass
class Decision:
    """Replicas in order of preference (each rank a list: Ray Serve takes the least loaded of a rank that
    has room), and the reason counted."""

    ranks: list[list[str]]
    reason: str


class Policy:
    """The three rules over the current replicas; the ring is rebuilt only when the replica set changes.

    A session (or cache key) stays on the replica its first request went to while that replica is among the
    candidates (``homes``: at most ``max_homes`` keys, least recently routed dropped first); the ring places
    keys not seen yet and those whose replica left.  Without that memory a replica joining (a scale-up, or the
    second replica of ``--replicas 2`` reaching the router a moment after the first) moves about 1/N of the
    sessions away from their KV.  Each router process keeps its own memory: two gateways agree through the ring
    except on keys first routed while their views of the replica set differed.
    """

    def __init__(self, vnodes: int = 64, rng: random.Random | None = None, max_homes: int = 100_000):
        self.vnodes = vnodes
        self.rng = rng or random.Random()
        self._ring: HashRing | None = None
        self.max_homes = max_homes
        self._homes: OrderedDict[str, str] = OrderedDict()

    def ring(self, ids: Iterable[str]) -> HashRing:
        ids = frozenset(ids)
        if self._ring is None or self._ring.nodes != ids:
            self._ring = HashRing(ids, self.vnodes)
        return self._ring

    def owner(self, ids: Sequence[str], key: str) -> str:
        """The replica for a session or cache key (``key``) among ``ids``: its home while that is among ``ids``,
        else the ring's owner, which becomes its home."""
        home = self._homes.get(key)
        if home is None or home not in ids:
            home = self.ring(ids).owner(key)
        self._homes[key] = home
        self._homes.move_to_end(key)
        while len(self._homes) > self.max_homes:
            self._homes.popitem(last=False)
        return home

    def choose(self, candidates: Sequence[Candidate], session_id: str | None = None,
               prefix: Sequence[str] = (), cache_key: str | None = None) -> Decision:
        """The ranks for one request (``prefix``: its :func:`prompt_block_hashes`; ``cache_key``: its
        ``prompt_cache_key``); counts the reason.  Raises ValueError without candidates."""
        if not candidates:
            raise ValueError("no replica to route to")
        ids = [c.id for c in candidates]
        if session_id is not None or cache_key is not None:
            owner = self.owner(ids, session_id if session_id is not None else f"pck:{cache_key}")
            d = Decision([[owner], [i for i in ids if i != owner]], "session" if session_id is not None else "cache_key")
        else:
            d = self._by_prefix(candidates, prefix) or self._two_choices(ids)
        DECISIONS.labels(d.reason).inc()
        return d

    def _by_prefix(self, candidates: Sequence[Candidate], prefix: Sequence[str]) -> Decision | None:
        if not prefix:
            return None
        scores = {c.id: longest_match(prefix, c.prefix) for c in candidates}
        best = max(scores.values())
        if best == 0:
            return None
        top = [i for i, s in scores.items() if s == best]
        return Decision([top, [i for i in scores if scores[i] != best]], "prefix")

    def _two_choices(self, ids: list[str]) -> Decision:
        two = self.rng.sample(ids, 2) if len(ids) > 1 else list(ids)
        return Decision([two, [i for i in ids if i not in two]], "load")


def pick(decision: Decision, load: Callable[[str], int]) -> str:
    """The replica Ray Serve would take for ``decision`` given queue lengths: the least loaded of its first rank
    (ties: the first listed).  For tests and the fake cluster."""
    return min(decision.ranks[0], key=load)


def cache_key_of(doc: dict) -> str | None:
    """A request body's ``prompt_cache_key`` (None when absent or not a string)."""
    key = doc.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None
