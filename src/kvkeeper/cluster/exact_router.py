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
2. ``prefix`` -- the best replica holds at least ``match_threshold`` (0.5) of the prompt's blocks: the cheapest
   replica by the cost above;
3. ``load`` -- otherwise (a fresh conversation, which shares at most a short system prompt): the cheapest by load
   alone, ties to the replica holding the fewest cached blocks (no random draw: the exact load is known).  This is
   SGLang's cache-aware router's rule (its ``cache_threshold``: below it a request goes to the worker with the
   smallest cache tree): a small shared prefix must not pull every new conversation onto the replicas that
   happened to serve the first ones, which would leave the others idle.

Cost per decision: hashing the prompt's blocks (about a microsecond each), one index walk (prompt blocks x
replicas holding them) and one pass over the replicas; measured by ``benchmarks/router_bench.py``.
"""

from __future__ import annotations

import random
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
            owner = self.policy.ring(replicas).owner(session_id if session_id is not None else f"pck:{cache_key}")
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
