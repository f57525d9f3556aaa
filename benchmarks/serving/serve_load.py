"""Bounded load check of a running ``kvkeeper serve``: concurrent streaming clients, some hanging up.

    python benchmarks/serving/serve_load.py --base-url http://127.0.0.1:8000 [--clients 32] [--hangup-fraction 0.2]
        [--max-tokens 24] [--time-limit 120] [--json OUT]

Every client streams one chat completion (``stream_options.include_usage``) with its
own MT-Bench question; every fourth client asks for ``n=2``.  A fraction of the
clients (a fifth by default, some with ``n=2``) close their connection after a few
chunks.  The run stops at ``--time-limit`` seconds whatever happens.

Afterwards it checks, from ``/metrics`` and ``/health``, that the server returned
to its idle state: no request running or waiting, KV blocks in use back to the
baseline read before the run, latency histograms grown by the finished sequences,
no 5xx answer, every finishing client got a ``[DONE]`` and usage that matches what
it received.  Exit status 0 when every check passes, 1 otherwise; a JSON summary
goes to stdout (and to ``--json OUT``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ROOT / "data" / "mt_bench" / "question.jsonl"


def metrics(base: str) -> dict[str, float]:
    """Unlabelled ``kvkeeper:*`` samples of ``/metrics``."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(kvkeeper:[a-z0-9_:]+)(\{[^}]*\})? ([-+0-9.eE]+)$", line)
        if m and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def prompts(k: int) -> list[str]:
    qs = [json.loads(x)["turns"][0] for x in QUESTIONS.read_text().splitlines() if x.strip()]
    return [qs[i % len(qs)] + ("" if i < len(qs) else f" (variant {i})") for i in range(k)]


async def client(http: httpx.AsyncClient, base: str, i: int, prompt: str, n: int, max_tokens: int,
                 hang_after: int | None, model: str | None) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.7,
            "seed": i, "n": n, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    rec = {"client": i, "n": n, "hang_up": hang_after is not None, "status": None, "chunks": 0, "done": False,
           "usage": None, "text": [""] * n, "finish": [None] * n, "error": None, "ttft_s": None}
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode(errors="replace")[:300]
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    rec["done"] = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"].get("message")
                    continue
                rec["chunks"] += 1
                for c in chunk.get("choices", []):
                    piece = (c.get("delta") or {}).get("content") or ""
                    if piece and rec["ttft_s"] is None:
                        rec["ttft_s"] = time.perf_counter() - t0
                    rec["text"][c["index"]] += piece
                    if c.get("finish_reason"):
                        rec["finish"][c["index"]] = c["finish_reason"]
                if chunk.get("usage"):
                    rec["usage"] = chunk["usage"]
                if hang_after is not None and rec["chunks"] >= hang_after:
                    break  # leaving the block closes the connection: the client hangs up
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def run(args) -> dict:
    base = args.base_url.rstrip("/")
    rng = random.Random(args.seed)
    before = metrics(base)
    n_hang = round(args.clients * args.hangup_fraction)
    hang_ids = set(rng.sample(range(args.clients), n_hang))
    ns = {i: 2 if i % 4 == 0 else 1 for i in range(args.clients)}
    if hang_ids and not any(ns[i] == 2 for i in hang_ids):  # some hang-ups have n=2
        ns[min(hang_ids)] = 2
    ps = prompts(args.clients)
    limits = httpx.Limits(max_connections=args.clients + 4)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.time_limit), limits=limits) as http:
        tasks = [asyncio.create_task(client(http, base, i, ps[i], ns[i], args.max_tokens,
                                            rng.randint(1, 4) if i in hang_ids else None, args.model))
                 for i in range(args.clients)]
        done, pending = await asyncio.wait(tasks, timeout=args.time_limit)
        for t in pending:
            t.cancel()
    elapsed = time.perf_counter() - t0
    recs = [t.result() for t in done if not t.cancelled() and t.exception() is None]
    # the server must go back to idle: nothing running or waiting, blocks back to the baseline
    deadline = time.monotonic() + 30
    while True:
        after = metrics(base)
        idle = (after["kvkeeper:num_requests_running"] == 0 and after["kvkeeper:num_requests_waiting"] == 0
                and after["kvkeeper:kv_cache_usage_perc"] == before["kvkeeper:kv_cache_usage_perc"])
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    health = httpx.get(base + "/health", timeout=10).status_code
    finishers = [r for r in recs if not r["hang_up"]]
    hangers = [r for r in recs if r["hang_up"]]
    seqs_finished = sum(r["n"] for r in finishers)
    problems = []
    if pending:
        problems.append(f"{len(pending)} clients still running at the {args.time_limit} s limit")
    for r in recs:
        if r["status"] is None or r["status"] >= 500:
            problems.append(f"client {r['client']}: status {r['status']} {r['error']}")
    for r in finishers:
        if r["status"] != 200:
            continue
        if not r["done"] or r["error"]:
            problems.append(f"client {r['client']}: stream ended without [DONE] or with an error: {r['error']}")
        elif r["usage"] is None or None in r["finish"]:
            problems.append(f"client {r['client']}: no usage chunk or a choice without finish_reason")
        elif r["usage"]["completion_tokens"] < sum(1 for t in r["text"] if t):
            problems.append(f"client {r['client']}: usage {r['usage']} does not cover the text received")
    if not idle:
        problems.append("server not idle 30 s after the run: running={} waiting={} kv_usage={} (baseline {})".format(
            after["kvkeeper:num_requests_running"], after["kvkeeper:num_requests_waiting"],
            after["kvkeeper:kv_cache_usage_perc"], before["kvkeeper:kv_cache_usage_perc"]))
    if health != 200:
        problems.append(f"/health answered {health}")
    e2e = after["kvkeeper:e2e_request_latency_seconds_count"] - before["kvkeeper:e2e_request_latency_seconds_count"]
    ttft = after["kvkeeper:time_to_first_token_seconds_count"] - before["kvkeeper:time_to_first_token_seconds_count"]
    if e2e < seqs_finished:
        problems.append(f"e2e latency histogram grew by {e2e}, fewer than the {seqs_finished} finished sequences")
    if ttft < seqs_finished:
        problems.append(f"TTFT histogram grew by {ttft}, fewer than the {seqs_finished} finished sequences")
    if after["kvkeeper:prefix_cache_queries_total"] <= before["kvkeeper:prefix_cache_queries_total"]:
        problems.append("prefix_cache_queries did not grow")
    ttfts = sorted(r["ttft_s"] for r in finishers if r["ttft_s"] is not None)
    return {
        "clients": args.clients, "hung_up": len(hangers), "hung_up_with_n2": sum(1 for r in hangers if r["n"] == 2),
        "finished_clients": sum(1 for r in finishers if r["done"]), "elapsed_s": round(elapsed, 2),
        "completion_tokens": sum(r["usage"]["completion_tokens"] for r in finishers if r["usage"]),
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "status_codes": sorted({r["status"] for r in recs if r["status"] is not None}),
        "kv_usage_before": before["kvkeeper:kv_cache_usage_perc"], "kv_usage_after": after["kvkeeper:kv_cache_usage_perc"],
        "running_after": after["kvkeeper:num_requests_running"], "waiting_after": after["kvkeeper:num_requests_waiting"],
        "e2e_observed": e2e, "health": health, "problems": problems, "ok": not problems,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model id to send (default: omit it)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--hangup-fraction", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds; the run never lasts longer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT", help="also write the summary here")
    args = ap.parse_args(argv)
    summary = asyncio.run(run(args))
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
