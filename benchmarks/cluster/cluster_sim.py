#!/usr/bin/env python
"""The cluster simulator's command line: runs of ``kvkeeper serve --replicas N`` simulated at any scale, the 2-replica
validation against cluster_bench's measured results, reports and plots (the simulator itself, what is real and what
is modelled: tests/utils/cluster_sim.py, which the suite checks).

    .venv/bin/python benchmarks/cluster/cluster_sim.py --replicas 8 --json OUT.json [--routers default,ring,text,exact]
    .venv/bin/python benchmarks/cluster/cluster_sim.py --validate --json OUT.json   # 2 replicas against cluster_bench
    .venv/bin/python benchmarks/cluster/cluster_sim.py --replicas 64 --lose-replica-at 0.5 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.utils
from tests.utils.cluster_sim import (ROUTERS, build_trace, ideal_hit_rate, load_costs, load_data,  # noqa: E402
                                     simulate, tag_maker, validate, working_set_blocks)


def run(a) -> dict:
    costs = load_costs(a.costs)
    system, gen, convs = load_data(a.max_tokens)
    n_conv = a.conversations or a.conversations_per_replica * a.replicas
    rate = a.rate * a.replicas
    trace = build_trace(convs, n_conv, rate, a.think_s, a.seed, tag_maker(a.max_tokens))
    turns = [inst.turn(k, system, gen) for inst in trace for k in range(len(inst.conv.turns))]
    ws = working_set_blocks(trace, system, gen, rate, a.think_s)
    if a.pool_basis == "replica":
        ws /= a.replicas
    blocks = a.kv_blocks or max(1, math.ceil(a.pool_fraction * ws))
    res = {"replicas": a.replicas, "conversations": n_conv, "turns": len(turns), "seed": a.seed,
           "arrival_rate_per_s": rate, "think_s": a.think_s, "max_tokens": a.max_tokens,
           "working_set_blocks": ws, "pool_basis": a.pool_basis, "pool_blocks_per_replica": blocks,
           "pool_fraction": blocks / ws if ws else None, "costs": costs.__dict__,
           "ideal_hit_rate": ideal_hit_rate(turns), "load_avg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
           "routers": {}}
    for kind in a.routers.split(","):
        t0 = time.perf_counter()
        r = simulate(kind, trace, system, gen, a.replicas, blocks, costs, a.seed,
                     lose_at=(a.lose_replica_at * trace[-1].arrival if a.lose_replica_at is not None else None))
        r["ideal_hit_rate"] = res["ideal_hit_rate"]
        r["sim_wall_s"] = time.perf_counter() - t0
        res["routers"][kind] = r
        print(f"{a.replicas} replicas, {kind}: " + json.dumps({k: v for k, v in r.items() if k != "loss"}),
              file=sys.stderr, flush=True)
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--conversations-per-replica", type=int, default=24)
    ap.add_argument("--conversations", type=int, default=None, help="total conversations (instead of per replica)")
    ap.add_argument("--rate", type=float, default=0.05, help="conversations arriving per replica per second")
    ap.add_argument("--think-s", type=float, default=10.0, help="mean think time between turns (s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="reply tokens at most")
    ap.add_argument("--pool-fraction", type=float, default=0.5, help="pool per replica / working set per replica")
    ap.add_argument("--pool-basis", choices=("cluster", "replica"), default="cluster",
                    help="the working set the fraction applies to: cluster = the KV of all live conversations "
                         "(cluster_bench --pressure's reading), replica = that / replicas")
    ap.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                    help="write the table and plots of these runs to --json's stem (.md, .json, -*.png)")
    ap.add_argument("--validate", action="store_true",
                    help="2 replicas against benchmarks/results/cluster_bench/cluster_bench-*.json (16 sessions x 8 turns)")
    ap.add_argument("--kv-blocks", type=int, default=None, help="pool per replica in blocks (instead of the fraction)")
    ap.add_argument("--lose-replica-at", type=float, default=None, metavar="F",
                    help="lose one replica at F x the last conversation's arrival time")
    ap.add_argument("--costs", type=Path, default=None, help="a cluster_sim_costs JSON (default: the newest)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for k in a.routers.split(","):
        if k not in ROUTERS:
            ap.error(f"--routers: unknown router {k!r} (choose from {', '.join(ROUTERS)})")
    if a.replicas < 1:
        ap.error("--replicas must be >= 1")
    return a


def validation_markdown(v: dict) -> str:
    lines = [f"Simulator against `{v['bench']}` ({v['sessions']} sessions x {v['turns']} turns, max_tokens "
             f"{v['max_tokens']}); bounds: hit rate within +/-{v['bounds']['hit_rate_abs']}, TTFT within a factor "
             f"{v['bounds']['ttft_ratio']:g}; costs from `{v['costs']['source']}`.", "",
             "| pool | set-up | hit rate sim / real | TTFT p50 turns 3+ sim / real (s) | TTFT p99 turns 3+ sim / real (s) "
             "| within bounds |", "|---|---|---|---|---|---|"]
    for pool, rows in v["pools"].items():
        for name, r in rows.items():
            s, m = r["sim"], r["real"]

            def f(x):
                return "n/a" if x is None else f"{x:.3f}"
            ok = ", ".join(f"{k.split('_turn')[0]} {'yes' if b else 'NO'}" for k, b in r["within_bounds"].items())
            lines.append(f"| {pool} ({r['blocks']} blocks) | {name} | {f(s['hit_rate'])} / {f(m['hit_rate'])} | "
                         f"{f(s['ttft_p50_turn3plus_s'])} / {f(m['ttft_p50_turn3plus_s'])} | "
                         f"{f(s['ttft_p99_turn3plus_s'])} / {f(m['ttft_p99_turn3plus_s'])} | {ok} |")
    return "\n".join(lines) + "\n"


TARGETS = {"hit_vs_ideal": 0.95, "ttft_p99_vs_default": 0.5, "load_max_over_mean": 1.3}


def targets_of(res: dict) -> dict:
    """The issue's targets for the exact router of one run: met or not, with the measured ratios."""
    ex, de = res["routers"].get("exact"), res["routers"].get("default")
    if not ex:
        return {}
    out = {"hit_vs_ideal": ex["hit_rate"] / res["ideal_hit_rate"], "load_max_over_mean": ex["load_max_over_mean"]}
    if de:
        out["ttft_p99_vs_default"] = ex["ttft_p99_s"] / de["ttft_p99_s"]
    out["met"] = {"hit_vs_ideal": out["hit_vs_ideal"] >= TARGETS["hit_vs_ideal"],
                  "load_max_over_mean": out["load_max_over_mean"] <= TARGETS["load_max_over_mean"]}
    if de:
        out["met"]["ttft_p99_vs_default"] = out["ttft_p99_vs_default"] <= TARGETS["ttft_p99_vs_default"]
    return out


def report(files: list[Path], out: Path) -> str:
    """A markdown table and two plots (hit rate, TTFT p99 against replicas, per router) of cluster_sim JSON
    files; writes ``out``.md, ``out``.json and ``out``-hit_rate.png / ``out``-ttft_p99.png."""
    runs = sorted((json.loads(Path(f).read_text()) for f in files), key=lambda r: r["replicas"])
    lines = ["| replicas | conversations / requests | pool per replica (blocks) | router | hit rate | ideal | "
             "TTFT p50 (s) | TTFT p99 (s) | max/mean load | sim wall (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    for r in runs:
        for k, v in r["routers"].items():
            lines.append(f"| {r['replicas']} | {r['conversations']:,} / {v['requests']:,} | {r['pool_blocks_per_replica']:,} "
                         f"| {k} | {v['hit_rate']:.3f} | {r['ideal_hit_rate']:.3f} | {v['ttft_p50_s']:.3f} | "
                         f"{v['ttft_p99_s']:.3f} | {v['load_max_over_mean']:.2f} | {v['sim_wall_s']:.0f} |")
        t = targets_of(r)
        summary.append({"replicas": r["replicas"], "load_avg": r["load_avg"], "targets": t})
    lines += ["", "Targets for the exact router (hit rate >= 0.95x ideal, TTFT p99 <= 0.5x default's, max/mean load "
              "<= 1.3):", ""]
    for sm in summary:
        t = sm["targets"]
        if t:
            lines.append(f"* {sm['replicas']} replicas: hit rate {t['hit_vs_ideal']:.3f}x ideal "
                         f"({'met' if t['met']['hit_vs_ideal'] else 'missed'}), TTFT p99 "
                         f"{t.get('ttft_p99_vs_default', float('nan')):.2f}x default's "
                         f"({'met' if t['met'].get('ttft_p99_vs_default') else 'missed'}), max/mean load "
                         f"{t['load_max_over_mean']:.2f} ({'met' if t['met']['load_max_over_mean'] else 'missed'}); "
                         f"load average at the start {sm['load_avg']}")
    md = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps({"runs": [Path(f).name for f in files], "summary": summary}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plots extra is not installed: the table stands alone
        return md
    for metric, label in (("hit_rate", "prefix hit rate"), ("ttft_p99_s", "TTFT p99 (s)")):
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        xs = [r["replicas"] for r in runs]
        for k in ROUTERS:
            ys = [r["routers"][k][metric] if k in r["routers"] else None for r in runs]
            ax.plot(xs, ys, marker="o", label=k)
        if metric == "hit_rate":
            ax.plot(xs, [r["ideal_hit_rate"] for r in runs], "k--", label="ideal (1 server, unbounded KV)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out.parent / f"{out.stem}-{metric.replace('_s', '')}.png", dpi=110)
        plt.close(fig)
    return md


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report:
        print(report(a.report, a.json))
        return 0
    if a.validate:
        res = validate(load_costs(a.costs), seed=a.seed)
        res["load_avg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(validation_markdown(res))
        if a.json:
            a.json.with_suffix(".md").write_text(validation_markdown(res))
    else:
        res = run(a)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
