"""Cost of one token-exact routing decision (kvkeeper.cluster.exact_router), measured, at N replicas and B cached
blocks in the KV index: hashing the prompt's blocks, the index walk and the pass over the replicas (tokenization
excluded: the prompt's ids are given).  ``python benchmarks/router_bench.py --replicas 256 --blocks 100000``."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvkeeper.cluster.exact_router import ExactRouter, ReplicaLoad
from kvkeeper.cluster.kv_index import KVIndex
from kvkeeper.kvcache.kv_events import BlockStored, EventBatch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decisions", type=int, default=500)
    a = ap.parse_args()
    rng = random.Random(0)
    names = [f"r{i}" for i in range(a.replicas)]
    index, bs, ns = KVIndex(), 16, "0123456789abcdef"
    router = ExactRouter(index, ns, bs)
    prompts = [[rng.randrange(49152) for _ in range(a.prompt_tokens)] for _ in range(64)]
    per_prompt = a.prompt_tokens // bs
    stored = 0
    while stored < a.blocks:  # prompts' chains (or their first halves) held by a few replicas each
        p = rng.choice(prompts)
        hs = router.hashes(p)[: rng.randint(1, per_prompt)]
        index.apply(rng.choice(names), EventBatch(0.0, [BlockStored(hs, None, [], bs, None, "CPU", ns)]))
        stored += len(hs)
    filler = 0
    while len(index) < a.blocks:  # distinct blocks up to the count asked for
        index.apply(rng.choice(names), EventBatch(0.0, [BlockStored([10**12 + filler], None, [], bs)]))
        filler += 1
    loads = {r: ReplicaLoad(rng.randint(0, 4), rng.randint(0, 2), rng.random()) for r in names}
    times = []
    for i in range(a.decisions):
        ids = prompts[i % len(prompts)]
        t = time.perf_counter()
        router.choose(names, loads, ids)
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{a.replicas} replicas, {len(index)} cached blocks, {a.prompt_tokens}-token prompts: per decision "
          f"median {statistics.median(times) * 1e3:.3f} ms, p99 {times[int(0.99 * len(times))] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
