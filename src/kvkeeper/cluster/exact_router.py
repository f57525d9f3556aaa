"""The token-exact cache-aware router: replicas scored by the KV blocks they hold of a prompt against their load.

The gateway tokenizes the prompt as a replica does (the chat template applied, control tokens only from the
template: a replica's :class:`~kvkeeper.engine.input_processor.InputProcessor`), chains the full blocks' hashes
as the replica's prefix cache does (:func:`kvkeeper.kvcache.block_pool.block_hash` over the namespace digest the
replicas' KV events carry), and asks the :class:`~kvkeeper.cluster.kv_index.KVIndex` how many leading blocks each
replica holds.  This is llm-d's precise prefix-cache scorer and Dynamo's KV router: each replica's cost is

    cost = (prompt blocks - cached blocks) + load_weight * (running + waiting requests) + usage_weight * kv_usage

in blocks to prefill (``kv_usage`` in 0..1), and the request goes to the cheapest.  Rules, in order (reasons of
``kvkeeper:cluster_routing_decisions_total``):

1. ``session`` / ``cache_key`` -- ``X-Session-ID`` or ``prompt_cache_key``: the owner on the consistent-hash ring,
   as :class:`~kvkeeper.cluster.router.Policy` (a session's KV is pinned where its turns went; it stays on that
   replica while the replica lives, even when others join);
2. ``prefix`` -- the best replica holds at least ``match_threshold`` (0.5) of the prompt's blocks: the cheapest
   replica by the cost above;
3. ``load`` -- otherwise (a fresh conversation, which shares at most a short system prompt): the cheapest by load
   alone, ties to the replica holding the fewest cached blocks (no random draw: the exact load is known).  This is
   SGLang's cache-aware router's rule (its ``cache_threshold``: below it a request goes to the worker with the
   smallest cache tree): a small shared prefix must not pull every new conversation onto the replicas that
   happened to serve the first ones, which would leave the others idle.

Cost per decision: hashing the prompt's blocks (about a microsecond each), one index walk (prompt blocks x
replicas holding them) and one pass over the replicas; measured by ``benchmarks/cluster/router_bench.py``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..kvcache.block_pool import block_hash
from .kv_index import KVIndex
from .router import DECISIONS, Decision, Policy
from ..engine.handle import EngineHandle

log = logging.getLogger(__name__)


@dataclass
class ReplicaLoad:
    """What a replica reports of its load: requests running and waiting, and the share of its KV blocks in use."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def token_block_hashes(ids: Sequence[int], namespace: str, block_size: int) -> list[int]:
    """The chained hashes of the full blocks a replica could reuse for prompt ``ids`` (its prefix match leaves the
    last token to compute, so ``(len(ids) - 1) // block_size`` blocks) under the namespace digest ``namespace``."""
    out: list[int] = []
    parent = None
    for i in range((len(ids) - 1) // block_size):
        parent = block_hash(parent, namespace, ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


class ExactRouter:
    """Routes on the KV index (see the module docstring).

    namespace: the replicas' namespace digest for requests without tenant or salt (``engine.namespace.digest``).
    block_size: the replicas' KV block size (tokens).  load_weight: blocks of prefill one queued request weighs;
    usage_weight: blocks a full KV pool weighs.  match_threshold: the share of the prompt's blocks the best replica
    must hold for the prefix to count (rule 2).  Raises ValueError for negative weights, a block size < 1 or a
    threshold outside 0..1.  rng: the draw between replicas tied on cost and cached blocks.
    """

    def __init__(self, index: KVIndex, namespace: str, block_size: int, load_weight: float = 8.0,
                 usage_weight: float = 4.0, vnodes: int = 64, match_threshold: float = 0.5,
                 rng: random.Random | None = None):
        if block_size < 1 or load_weight < 0 or usage_weight < 0 or not 0 <= match_threshold <= 1:
            raise ValueError(f"block_size must be >= 1, the weights >= 0 and match_threshold in 0..1 (got "
                             f"{block_size}, {load_weight}, {usage_weight}, {match_threshold})")
        self.match_threshold = match_threshold
        self.rng = rng or random.Random()
        self.index = index
        self.namespace = namespace
        self.block_size = block_size
        self.load_weight = load_weight
        self.usage_weight = usage_weight
        self.policy = Policy(vnodes)

    def hashes(self, ids: Sequence[int]) -> list[int]:
        return token_block_hashes(ids, self.namespace, self.block_size)

    def choose(self, replicas: Sequence[str], loads: Mapping[str, ReplicaLoad], prompt_ids: Sequence[int] = (),
               session_id: str | None = None, cache_key: str | None = None,
               hashes: Sequence[int] | None = None) -> Decision:
        """The ranks for one request (``prompt_ids``: its tokens as the replica would compute them, or ``hashes``
        already computed).  Raises ValueError without replicas."""
        if not replicas:
            raise ValueError("no replica to route to")
        if session_id is not None or cache_key is not None:
            owner = self.policy.owner(replicas, session_id if session_id is not None else f"pck:{cache_key}")
            d = Decision([[owner], [r for r in replicas if r != owner]],
                         "session" if session_id is not None else "cache_key")
        else:
            d = self.by_cost(replicas, loads, self.hashes(prompt_ids) if hashes is None else hashes)
        DECISIONS.labels(d.reason).inc()
        return d

    def by_cost(self, replicas: Sequence[str], loads: Mapping[str, ReplicaLoad], hashes: Sequence[int]) -> Decision:
        """The cheapest replica first, then the others by cost (rules 2 and 3 of the module docstring).  Ties go to
        the replica holding the fewest cached blocks, then to a random one of those (``rng``): new conversations
        spread over the replicas whose caches hold the least, and over all of them when every pool is full, so that
        sticky conversations do not pile onto the first replicas listed."""
        matched = self.index.match(hashes) if hashes else {}
        n = len(hashes)
        hit = any(matched.get(r, 0) >= max(1.0, self.match_threshold * n) for r in replicas)
        if not hit:  # rule 3: a fresh conversation goes by load (module docstring)
            matched = {}
        idle = ReplicaLoad()
        best, best_key, costs = None, (float("inf"), 0, 0.0), {}
        held, draw = self.index.num_blocks, self.rng.random
        for r in replicas:
            ld = loads.get(r, idle)
            c = (n - matched.get(r, 0)) + self.load_weight * (ld.running + ld.waiting) + self.usage_weight * ld.kv_usage
            costs[r] = c
            if c <= best_key[0]:
                key = (c, held(r), draw())
                if key < best_key:
                    best, best_key = r, key
        rest = sorted((r for r in replicas if r != best), key=costs.__getitem__)
        return Decision([[best], rest], "prefix" if hit else "load")


class ClusterExactRouter:
    """The token-exact router of ``kvkeeper serve --replicas N --kv-events-config``: follows the replicas' KV
    event streams as they come and go, and routes each request with :class:`ExactRouter` (free of Ray: the Ray
    Serve request router, :class:`kvkeeper.cluster.deployment.KVKeeperRequestRouter`, hands it its candidates).

    Each candidate is ``(replica id, routing stats, ongoing requests or None)``; the routing stats a replica
    publishes (:func:`replica_routing_stats`) name its event endpoints, its block size, its base namespace and its
    load.  The request's hint is the gateway's (:func:`kvkeeper.cluster.deployment.routing_hint`): ``session``,
    ``cache_key``, and ``tokens`` with the namespace ``salt`` (:mod:`kvkeeper.cluster.gateway_tokens`); the tokens
    are replaced in the hint by their block hashes on the first decision (a retried request is not hashed twice,
    and the hashes, 1/block_size of the tokens, are what travels on to the replica).

    A replica's requests weigh its ongoing requests as Ray Serve counts them (else its engine's running and
    waiting requests from its stats, a second old at most); its KV usage comes from its stats.  ``subscriber``:
    a :class:`~kvkeeper.cluster.kv_subscriber.KVEventSubscriber` factory (tests); the weights are
    :class:`ExactRouter`'s.
    """

    def __init__(self, load_weight: float = 8.0, usage_weight: float = 4.0, match_threshold: float = 0.5,
                 vnodes: int = 64, subscriber=None):
        self.index = KVIndex()
        self.weights = dict(load_weight=load_weight, usage_weight=usage_weight, match_threshold=match_threshold,
                            vnodes=vnodes)
        self.router: ExactRouter | None = None
        self._make_subscriber = subscriber
        self.sub = None
        self._feeds: dict[str, tuple] = {}
        self._digests: dict[tuple, str] = {}
        self._lagging: dict[str, int] = {}  # replica -> the seq it lagged behind (behind() skips it until then)

    def _subscriber(self):
        if self.sub is None:
            if self._make_subscriber is not None:
                self.sub = self._make_subscriber(self.index)
            else:
                from .kv_subscriber import KVEventSubscriber

                self.sub = KVEventSubscriber(self.index, []).start()
        return self.sub

    def follow(self, replica: str, stats: dict) -> bool:
        """Follow ``replica``'s events as its ``stats`` advertise them; whether it advertises any."""
        ev = (stats or {}).get("kv_events")
        if not ev:
            return False
        from .kv_subscriber import Feed

        feed = Feed(replica, ev["endpoint"], ev.get("replay_endpoint"), ev.get("topic", ""))
        if self._feeds.get(replica) != feed:
            self._subscriber().follow(feed)
            self._feeds[replica] = feed
        return True

    def forget_others(self, alive) -> None:
        """Stop following the replicas not in ``alive`` (they left the deployment); their blocks leave the index."""
        alive = set(alive)
        for r in [r for r in self._feeds if r not in alive]:
            del self._feeds[r]
            self.sub.forget(r)

    def behind(self, after: Mapping[str, int]) -> bool:
        """Whether the index has yet to apply, for some followed replica, the KV event batch ``after[replica]``
        (the seq a replica's answer carried: its events up to that answer).  Skipped: replicas not followed, those
        whose stream never reached the index (an endpoint the router cannot reach), and those :meth:`give_up`
        marked until they catch up."""
        sub = self.sub
        if sub is None:
            return False
        for r, seq in after.items():
            if r not in self._feeds:
                continue
            applied = sub.last_seq(r)
            if applied is None:
                continue
            lag = self._lagging.get(r)
            if lag is not None:
                if applied < lag:
                    continue
                del self._lagging[r]
            if applied < seq:
                return True
        return False

    def give_up(self, after: Mapping[str, int]) -> None:
        """The replicas still :meth:`behind` ``after`` are not waited for again until their index catches up."""
        for r, seq in after.items():
            applied = self.sub.last_seq(r) if self.sub is not None else None
            if r in self._feeds and applied is not None and applied < seq and r not in self._lagging:
                log.warning("KV events of replica %s lag (applied %d, its last answer %d): routing without them",
                            r, applied, seq)
                self._lagging[r] = seq

    def export(self, names: Mapping[str, str]) -> None:
        """Set ``kvkeeper:cluster_kv_index_blocks{replica}`` for ``{replica id: label}`` (the blocks each holds)."""
        from .router import INDEX_BLOCKS

        for rid, name in names.items():
            INDEX_BLOCKS.labels(name).set(self.index.num_blocks(rid))

    def digest(self, base: dict, salt: str) -> str:
        """The namespace digest of a request with namespace salt ``salt`` (:func:`salt_hash`) on replicas whose
        base namespace is ``base`` (``{"model_revision", "kv_dtype", "digest"}``)."""
        if not salt:
            return base["digest"]
        key = (base["model_revision"], base["kv_dtype"], salt)
        d = self._digests.get(key)
        if d is None:
            from ..kvcache.namespace import Namespace

            ns = Namespace(base["model_revision"], tenant_salt=salt, kv_dtype=base["kv_dtype"])
            d = self._digests[key] = ns.digest
        return d

    def choose(self, candidates: Sequence[tuple[str, dict, int | None]], hint: dict) -> Decision | None:
        """The ranks for one request, or None while no candidate advertises KV events (the caller falls back to
        the text-hash router).  Raises ValueError without candidates."""
        if not candidates:
            raise ValueError("no replica to route to")
        base = None
        for rid, stats, _ in candidates:
            if self.follow(rid, stats) and base is None:
                base = stats
        if base is None:
            return None
        bs = int(base["block_size"])
        if self.router is None or self.router.block_size != bs or self.router.namespace != base["namespace"]["digest"]:
            self.router = ExactRouter(self.index, base["namespace"]["digest"], bs, rng=self.router.rng if self.router
                                      else None, **self.weights)
        hashes = hint.get("hashes")
        if hashes is None:
            tokens = hint.pop("tokens", None)
            hashes = token_block_hashes(tokens, self.digest(base["namespace"], hint.get("salt") or ""), bs) \
                if tokens else []
            hint["hashes"] = hashes
        loads = {}
        for rid, stats, ongoing in candidates:
            ld = (stats or {}).get("load") or {}
            busy = ongoing if ongoing is not None else int(ld.get("running", 0)) + int(ld.get("waiting", 0))
            loads[rid] = ReplicaLoad(running=busy, kv_usage=float(ld.get("kv_usage", 0.0)))
        lock = self.sub.lock if self.sub is not None else _NO_LOCK
        with lock:
            return self.router.choose([c[0] for c in candidates], loads, session_id=hint.get("session"),
                                      cache_key=hint.get("cache_key"), hashes=hashes)

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()
            self.sub = None


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_LOCK = _NoLock()


def replica_routing_stats(engine: EngineHandle, publisher, node_ip: str, load: dict) -> dict:
    """What a replica adds to its Ray Serve routing stats for :class:`ClusterExactRouter`: its event endpoints as
    bound (``publisher``: the engine's :class:`~kvkeeper.kvcache.kv_events.publisher.ZmqEventPublisher`; a wildcard host
    replaced by ``node_ip``), its block size, its base namespace (model revision and KV dtype, the digest; no tenant
    or salt) and ``load`` (``{"running", "waiting", "kv_usage"}``).  {} without a publisher."""
    if publisher is None:
        return {}
    from .replica_events import advertised

    ns = engine.namespace
    return {"kv_events": {"endpoint": advertised(publisher.bound_endpoint, node_ip),
                          "replay_endpoint": advertised(publisher.bound_replay_endpoint, node_ip),
                          "topic": publisher.cfg.topic},
            "block_size": engine.block_size,
            "namespace": {"model_revision": ns.model_revision, "kv_dtype": ns.kv_dtype, "digest": ns.digest},
            "load": load}
