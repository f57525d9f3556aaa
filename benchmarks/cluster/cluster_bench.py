#!/usr/bin/env python
"""Cluster benchmark: sessions against ``kvkeeper serve --replicas N`` on Ray Serve, three set-ups in one run.

Set-ups: 1 replica; 2 replicas with kvkeeper's request router (session affinity by consistent hashing,
kvkeeper.cluster.router); 2 replicas with Ray Serve's default router (power of two choices).  Each
starts its own server (a local Ray cluster) and runs the same workload: ``--sessions`` concurrent
clients, each one session (``X-Session-ID``) of ``--turns`` Topical-Chat user turns, history resent each
turn, streamed, greedy, ``--max-tokens`` per reply.  No data directory: sessions live in the replicas'
memory only, so a turn that lands on a replica without its session reuses only what that replica's
prefix cache and stale copy hold.

Per set-up: prefix-cache hit rate (prompt tokens reported cached / prompt tokens, all turns and turns 2+),
TTFT p50 / p99 of turns 3 and later (s, request sent to first content chunk), output throughput
(completion tokens / wall time of the workload) and the routing decisions the gateway counted.
Targets (issue 16): the router keeps >= 90% of the single replica's hit rate and >= 2x the default's.

    .venv/bin/python benchmarks/cluster/cluster_bench.py [--sessions 16] [--turns 8] [--max-tokens 16]
        [--pressure 0.65 [--kv-blocks N] [--pressure-only]] [--lock /work/.cpu.lock] [--out benchmarks/results/cluster_bench]

``--pressure F``: after the three set-ups with the default KV pool (1 GiB per replica, far more than the
sessions need), run them again with each replica's pool at F x the KV blocks all sessions hold after their
last turn (measured on the 1-replica set-up) and in effect no host offload tier (``--kv-blocks N
--host-offload-bytes 0``: an idle session's KV is unpinned, its full blocks left to the prefix cache): the case where a
replica cannot keep every session, so that routing decides what stays cached.  ``--kv-blocks N`` sets
that pool directly; ``--pressure-only`` skips the first run.

``--lock FILE``: hold an exclusive flock on FILE during each set-up (a shared machine).  Writes
``OUT/cluster_bench-<config>-<date>.json`` and ``.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import fcntl
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import MODEL, cpu_model, result_name, write_report  # noqa: E402
from serving.serve_bench import conversation, pct, stream_chat, user_turns  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16  # the engine's default --block-size, which the set-ups keep
SETUPS = [("1 replica", 1, "kvkeeper"), ("2 replicas, kvkeeper router", 2, "kvkeeper"),
          ("2 replicas, Ray default router", 2, "default")]


@contextlib.contextmanager
def exclusive(lock: str | None):
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def cluster(replicas: int, router: str, log: Path, port: int, extra: tuple[str, ...] = ()):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "kvkeeper.cli", "serve", "--replicas", str(replicas), "--router", router,
           "--host", "127.0.0.1", "--port", str(port), "--no-access-log", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while "serving " not in log.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not start: {log.read_text()[-2000:]}")
                time.sleep(1)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def session_turn(http: httpx.AsyncClient, base: str, sid: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return await stream_chat(http, base + "/v1/chat/completions", body, headers={"X-Session-ID": sid})


async def run_session(http, base: str, sid: str, turns: list[str], max_tokens: int) -> list[dict]:
    return await conversation(functools.partial(session_turn, http, base, sid, max_tokens=max_tokens), turns)


def _hit_rate(recs: list[dict]) -> float | None:
    prompt = sum(r["usage"]["prompt_tokens"] for r in recs)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in recs)
    return cached / prompt if prompt else None


def session_blocks(per: list[list[dict]]) -> int:
    """KV blocks the sessions hold after their last turn: sum of ceil((prompt + completion tokens) / block)."""
    total = 0
    for recs in per:
        ok = [r for r in recs if r["status"] == 200 and r["usage"]]
        if ok:
            u = ok[-1]["usage"]
            total += -(-(u["prompt_tokens"] + u["completion_tokens"]) // BLOCK_SIZE)
    return total


def _decisions(metrics: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'kvkeeper:cluster_routing_decisions_total\{reason="(\w+)"\} (\S+)', metrics)}


async def workload(base: str, sessions: int, turns: int, max_tokens: int, tag: str) -> dict:
    convs = user_turns(sessions, turns)
    async with httpx.AsyncClient(timeout=600) as http:
        await session_turn(http, base, f"warm-{tag}", [{"role": "user", "content": "Warm-up: say hi."}], 4)
        t0 = time.perf_counter()
        per = await asyncio.gather(*(run_session(http, base, f"{tag}-{i}", c, max_tokens)
                                     for i, c in enumerate(convs)))
        wall = time.perf_counter() - t0
        metrics = (await http.get(base + "/metrics")).text
    recs = [r for rs in per for r in rs]
    ok = [r for r in recs if r["status"] == 200 and r["usage"]]
    late = [r["ttft_s"] for r in ok if r["turn"] >= 2 and r["ttft_s"] is not None]
    return {"requests": len(recs), "errors": len(recs) - len(ok), "wall_s": wall,
            "hit_rate": _hit_rate(ok), "hit_rate_turn2plus": _hit_rate([r for r in ok if r["turn"] >= 1]),
            "ttft_p50_turn3plus_s": pct(late, 0.5), "ttft_p99_turn3plus_s": pct(late, 0.99),
            "completion_tokens": sum(r["usage"]["completion_tokens"] for r in ok),
            "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in ok),
            "uncached_prompt_tokens": sum(r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"]
                                          for r in ok),
            "throughput_tok_s": sum(r["usage"]["completion_tokens"] for r in ok) / wall,
            "session_kv_blocks": session_blocks(per),
            "routing_decisions": _decisions(metrics)}


def fmt(x, nd=3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def table(setups: dict, targets_: dict) -> list[str]:
    lines = ["| set-up | prefix hit rate | hit rate, turns 2+ | prompt tokens prefilled (not cached) "
             "| TTFT p50 turns 3+ (s) | TTFT p99 turns 3+ (s) | throughput (tok/s) | errors | routing decisions |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in setups.items():
        dec = ", ".join(f"{k} {int(v)}" for k, v in sorted(r["routing_decisions"].items()))
        lines.append(f"| {name} | {fmt(r['hit_rate'])} | {fmt(r['hit_rate_turn2plus'])} | "
                     f"{r['uncached_prompt_tokens']:,} of {r['prompt_tokens']:,} | "
                     f"{fmt(r['ttft_p50_turn3plus_s'])} | {fmt(r['ttft_p99_turn3plus_s'])} | "
                     f"{fmt(r['throughput_tok_s'], 1)} | {r['errors']} | {dec or '-'} |")
    t = targets_ or {}
    return lines + ["", f"Targets: router hit rate >= 90% of one replica's: {t.get('vs_single')}; "
                    f">= 2x Ray's default router's: {t.get('vs_default')}.", ""]


def markdown(res: dict) -> str:
    lines = [f"# Cluster benchmark ({res['date']})", "",
             f"{res['machine']}; {res['sessions']} concurrent sessions x {res['turns']} turns (Topical-Chat, "
             f"history resent, X-Session-ID), max_tokens {res['max_tokens']}, greedy, streamed; each replica "
             f"1 CPU and 1 torch thread; no data directory.  {res['note']}", ""]
    if res["setups"]:
        lines += ["## KV pool per replica: the default (1 GiB, host offload tier 1 GiB)", ""]
        lines += table(res["setups"], res.get("targets"))
    pr = res.get("pressure")
    if pr:
        if pr.get("need_blocks"):
            size = (f"{fmt(pr['fraction'], 2)} of the KV all sessions hold after their last turn "
                    f"({pr['need_blocks']} blocks, measured on the 1-replica set-up with the default pool: sum "
                    f"over sessions of ceil((prompt + completion tokens of the last turn) / {BLOCK_SIZE}))")
        else:
            size = "a pool given with --kv-blocks (the sessions' KV was not measured in this run)"
        lines += [f"## KV pool per replica under pressure: {pr['kv_blocks']} blocks of {BLOCK_SIZE} tokens, "
                  "no host offload tier", "",
                  f"`--kv-blocks {pr['kv_blocks']} --host-offload-bytes {pr.get('host_offload_bytes', 0)}` on every "
                  f"replica (no host tier: an idle session's KV is unpinned, its full blocks left to the prefix "
                  f"cache): {size}.  "
                  "Under affinity each of 2 replicas holds about half of it; under random routing a session's "
                  "copies on both replicas compete for the pool, and idle sessions' KV is dropped (only the "
                  "prefix cache keeps their blocks until evicted).  The 1-replica set-up has the same pool, "
                  "half the 2-replica total, so the router keeping '90% of one replica' is not the issue's "
                  "comparison here.", ""]
        lines += table(pr["setups"], pr.get("targets"))
    return "\n".join(lines)


def targets(setups: dict) -> dict:
    one = setups.get(SETUPS[0][0], {}).get("hit_rate")
    ours = setups.get(SETUPS[1][0], {}).get("hit_rate")
    default = setups.get(SETUPS[2][0], {}).get("hit_rate")
    out = {}
    if one and ours is not None:
        out["vs_single"] = f"{ours / one:.1%} of it ({'met' if ours >= 0.9 * one else 'missed'})"
    if default is not None and ours is not None:
        ratio = ours / default if default else float("inf")
        out["vs_default"] = f"{ratio:.2f}x ({'met' if ratio >= 2 else 'missed'})"
    return out


def run_setups(a, logs: Path, extra: tuple[str, ...], tag: str) -> dict:
    """The three set-ups, one server each, ``extra`` serve flags on every replica; results by set-up name."""
    out = {}
    for i, (name, n, router) in enumerate(SETUPS):
        with exclusive(a.lock), cluster(n, router, logs / f"{tag}{i}.log", a.port, extra) as base:
            r = asyncio.run(workload(base, a.sessions, a.turns, a.max_tokens, f"{tag}{i}"))
        out[name] = r
        print(f"{name} ({tag}): {json.dumps(r)}", file=sys.stderr, flush=True)
    return out


def pressure_run(a, logs: Path, need: int | None) -> dict:
    """The set-ups again with each replica's pool at ``a.pressure`` x ``need`` blocks (or ``a.kv_blocks``)."""
    if a.kv_blocks is None and not need:
        raise SystemExit("--pressure needs the default-pool run (to measure the sessions' KV) or --kv-blocks N")
    blocks = a.kv_blocks or math.ceil(a.pressure * need)
    # No host tier: an idle session's KV is unpinned (its full blocks stay in the prefix cache until evicted).
    extra = ("--kv-blocks", str(blocks), "--host-offload-bytes", "0")
    setups = run_setups(a, logs, extra, "p")
    return {"kv_blocks": blocks, "need_blocks": need, "fraction": blocks / need if need else None,
            "host_offload_bytes": 0, "setups": setups, "targets": targets(setups)}


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--pressure", type=float, default=0.0, metavar="F",
                    help="also run the set-ups with each replica's KV pool at F x the blocks all sessions hold "
                         "(measured on the 1-replica default-pool set-up) and no host offload tier; 0 = skip")
    ap.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                    help="the pressure run's pool per replica in blocks (instead of F x the measured need)")
    ap.add_argument("--pressure-only", action="store_true", help="skip the default-pool run (needs --kv-blocks)")
    ap.add_argument("--lock", default=None, help="flock this file exclusively during each set-up")
    ap.add_argument("--note", default="", help="a line about the machine's state, for the report")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cluster_bench")
    ap.add_argument("--config", default=MODEL, help="the run's config in its file name (default %(default)s)")
    ap.add_argument("--name", default=None, help="write OUT/NAME.json and OUT/NAME.md (default: cluster_bench-CONFIG-DATE)")
    a = ap.parse_args(argv)
    if a.pressure_only and a.kv_blocks is None:
        ap.error("--pressure-only needs --kv-blocks N (the need is measured on the default-pool run)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    res = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{cpu_model()}, {os.cpu_count()} CPUs", "sessions": a.sessions, "turns": a.turns,
           "max_tokens": a.max_tokens, "note": a.note, "setups": {}}
    logs = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    if not a.pressure_only:
        res["setups"] = run_setups(a, logs, (), "s")
        res["targets"] = targets(res["setups"])
    if a.pressure or a.kv_blocks or a.pressure_only:
        need = res["setups"].get(SETUPS[0][0], {}).get("session_kv_blocks")
        res["pressure"] = pressure_run(a, logs, need)
    a.out.mkdir(parents=True, exist_ok=True)
    write_report(a.out, a.name or result_name("cluster_bench", a.config), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
