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
   as :class:`~kvkeeper.cluster.router.Policy` (a session's KV is pinned where its turns went);
2. ``prefix`` -- some replica holds the prompt's first block: the cheapest replica by the cost above;
3. ``load`` -- no replica holds any of it: the cheapest by load alone (no random draw: the exact load is known).

Cost per decision: hashing the prompt's blocks (about a microsecond each), one index walk (prompt blocks x
replicas holding them) and one pass over the replicas; measured by ``benchmarks/router_bench.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..kvcache.block_pool import block_hash
from .kv_index import KVIndex
from .router import DECISIONS, Decision, Policy


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
    usage_weight: blocks a full KV pool weighs.  Raises ValueError for negative weights or a block size < 1.
    """

    def __init__(self, index: KVIndex, namespace: str, block_size: int, load_weight: float = 8.0,
                 usage_weight: float = 4.0, vnodes: int = 64):
        if block_size < 1 or load_weight < 0 or usage_weight < 0:
            raise ValueError(f"block_size must be >= 1 and the weights >= 0 (got {block_size}, {load_weight}, "
                             f"{usage_weight})")
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
            owner = self.policy.ring(replicas).owner(session_id if session_id is not None else f"pck:{cache_key}")
            d = Decision([[owner], [r for r in replicas if r != owner]],
                         "session" if session_id is not None else "cache_key")
        else:
            d = self.by_cost(replicas, loads, self.hashes(prompt_ids) if hashes is None else hashes)
        DECISIONS.labels(d.reason).inc()
        return d

    def by_cost(self, replicas: Sequence[str], loads: Mapping[str, ReplicaLoad], hashes: Sequence[int]) -> Decision:
        """The cheapest replica first (ties: the first listed), then the others by cost."""
        matched = self.index.match(hashes) if hashes else {}
        n = len(hashes)
        idle = ReplicaLoad()
        best, best_cost, costs = None, float("inf"), {}
        for r in replicas:
            ld = loads.get(r, idle)
            c = (n - matched.get(r, 0)) + self.load_weight * (ld.running + ld.waiting) + self.usage_weight * ld.kv_usage
            costs[r] = c
            if c < best_cost:
                best, best_cost = r, c
        hit = any(r in matched for r in replicas)
        rest = sorted((r for r in replicas if r != best), key=costs.__getitem__)
        return Decision([[best], rest], "prefix" if hit else "load")
