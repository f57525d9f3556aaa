"""Cost of one token-exact routing decision (kvkeeper.cluster.exact_router), measured, at N replicas and B cached
blocks in the KV index: hashing the prompt's blocks, the index walk and the pass over the replicas (tokenization
excluded: the prompt's ids are given).  ``python benchmarks/cluster/router_bench.py --replicas 256 --blocks 100000``
(``--replicas`` takes several counts).  Writes ``OUT/router_bench-<config>-<date>.json`` and ``.md`` (median and
p99 per decision, the load average at the start and end) and prints the markdown; target (issue 28): under 1 ms
at 256 replicas and 100k cached blocks."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

from kvkeeper.cluster.exact_router import ExactRouter, ReplicaLoad
from kvkeeper.cluster.kv_index import KVIndex
from kvkeeper.kvcache.kv_events.wire import BlockStored, EventBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import RESULTS, cpu_model, result_name, run_date, write_report  # noqa: E402


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(replicas: int, blocks: int, prompt_tokens: int, decisions: int) -> dict:
    """Per-decision seconds of the exact router at ``replicas`` replicas and ``blocks`` distinct cached blocks."""
    rng = random.Random(0)
    names = [f"r{i}" for i in range(replicas)]
    index, bs, ns = KVIndex(), 16, "0123456789abcdef"
    router = ExactRouter(index, ns, bs)
    prompts = [[rng.randrange(49152) for _ in range(prompt_tokens)] for _ in range(64)]
    per_prompt = prompt_tokens // bs
    stored = 0
    while stored < blocks:  # prompts' chains (or their first halves) held by a few replicas each
        p = rng.choice(prompts)
        hs = router.hashes(p)[: rng.randint(1, per_prompt)]
        index.apply(rng.choice(names), EventBatch(0.0, [BlockStored(hs, None, [], bs, None, "CPU", ns)]))
        stored += len(hs)
    filler = 0
    while len(index) < blocks:  # distinct blocks up to the count asked for
        index.apply(rng.choice(names), EventBatch(0.0, [BlockStored([10**12 + filler], None, [], bs)]))
        filler += 1
    loads = {r: ReplicaLoad(rng.randint(0, 4), rng.randint(0, 2), rng.random()) for r in names}
    times = []
    for i in range(decisions):
        ids = prompts[i % len(prompts)]
        t = time.perf_counter()
        router.choose(names, loads, ids)
        times.append(time.perf_counter() - t)
    times.sort()
    return {"replicas": replicas, "cached_blocks": len(index), "prompt_tokens": prompt_tokens, "decisions": decisions,
            "median_ms": statistics.median(times) * 1e3, "p99_ms": times[int(0.99 * len(times))] * 1e3}


def markdown(res: dict) -> str:
    lines = [f"# Router decision cost ({res['date']})", "", f"{res['machine']}; load average at the start "
             f"{res['load_avg_start']}, at the end {res['load_avg_end']}.  Token-exact router "
             "(kvkeeper.cluster.exact_router), prompt ids given (tokenization excluded).", "",
             "| replicas | cached blocks | prompt tokens | median per decision (ms) | p99 (ms) | under 1 ms (median) |",
             "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['replicas']} | {r['cached_blocks']:,} | {r['prompt_tokens']:,} | {r['median_ms']:.3f} | "
                     f"{r['p99_ms']:.3f} | {'yes' if r['median_ms'] < 1 else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, nargs="+", default=[256])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decisions", type=int, default=500)
    ap.add_argument("--out", type=Path, default=RESULTS / "router_bench")
    ap.add_argument("--config", default="exact")
    a = ap.parse_args(argv)
    res = {"date": run_date(), "machine": f"{cpu_model()}, {os.cpu_count()} CPUs", "load_avg_start": _load(),
           "runs": [measure(n, a.blocks, a.prompt_tokens, a.decisions) for n in a.replicas]}
    res["load_avg_end"] = _load()
    a.out.mkdir(parents=True, exist_ok=True)
    write_report(a.out, result_name("router_bench", a.config), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
