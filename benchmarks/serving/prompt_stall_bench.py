#!/usr/bin/env python
"""Inter-chunk gaps of a running stream while huge prompts arrive (issue 31, item 2).

One client streams a chat completion (``max_tokens`` tokens, ``ignore_eos``) from ``kvkeeper serve`` and records
when each content chunk arrives; the gaps between chunks are the stream's inter-chunk gaps.  Measured quiet (the
stream alone) and while other clients keep sending huge chat prompts, back to back:

* ``4mb``: 4,000,000-byte messages (under the 4 MiB body limit), refused with a context-length 400 (their byte length alone proves them too long);
* ``half_mb``: 500,000-byte messages, under that proof, so tokenized in full (in a worker thread) and then refused.

Per phase: the gaps' p50, p99 and max (s) and the p99's ratio to the quiet p99 (the target: below 3).  Before
issue 31 the prompts were tokenized on the engine thread and a 4 MB one froze every stream for seconds.

    .venv/bin/python benchmarks/serving/prompt_stall_bench.py [--max-tokens 96] [--streams 3] [--senders 2]
        [--out benchmarks/results/prompt_stall_bench] [--config NAME] [--baseline-src DIR]

``--baseline-src DIR``: also measure the server of another copy of kvkeeper's ``src`` folder (``PYTHONPATH=DIR``,
e.g. ``git archive main src | tar -x -C /tmp/main``) in the same run, before this one: a before / after table.

Writes ``OUT/prompt_stall_bench-<config>-<date>.json`` (config default smollm2-135m) and ``.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.utils.serverproc

from benchmarks.common import MODEL, RESULTS, cpu_model, result_name, write_report  # noqa: E402
from tests.utils.serverproc import server_process  # noqa: E402

PROMPTS = {"4mb": 4_000_000, "half_mb": 500_000}  # message bytes (the body limit is 4 MiB)


async def stream_gaps(http: httpx.AsyncClient, base: str, max_tokens: int) -> list[float]:
    """Seconds between the content chunks of one streamed chat completion."""
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    times = []
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"]
                if delta and delta[0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


async def send_huge(http: httpx.AsyncClient, base: str, size: int, stop: asyncio.Event, codes: list[int]) -> None:
    text = ("lighthouse " * (size // 11 + 1))[:size]
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    while not stop.is_set():
        codes.append((await http.post(base + "/v1/chat/completions", json=body)).status_code)


async def phase(base: str, size: int | None, streams: int, senders: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as http:
        stop, codes = asyncio.Event(), []
        load = [asyncio.create_task(send_huge(http, base, size, stop, codes)) for _ in range(senders if size else 0)]
        await asyncio.sleep(0.5 if size else 0)
        gaps = []
        for _ in range(streams):
            gaps += await stream_gaps(http, base, max_tokens)
        stop.set()
        await asyncio.gather(*load)
    gaps.sort()
    return {"gaps": len(gaps), "p50_s": statistics.median(gaps), "p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "max_s": gaps[-1], "huge_requests": len(codes), "huge_codes": sorted(set(codes))}


def markdown(res: dict) -> str:
    rows = ["| code | phase | gaps | p50 (s) | p99 (s) | max (s) | p99 / quiet p99 | huge requests (codes) |",
            "|---|---|---|---|---|---|---|---|"]
    for code, phases in res["runs"].items():
        for name, p in phases.items():
            rows.append(f"| {code} | {name} | {p['gaps']} | {p['p50_s']:.4f} | {p['p99_s']:.4f} | {p['max_s']:.4f} | "
                        f"{p['p99_ratio']:.2f} | {p['huge_requests']} ({', '.join(map(str, p['huge_codes'])) or '-'}) |")
    return (f"# Inter-chunk gaps while huge prompts arrive ({res['config']}, {res['date']})\n\n{res['cpu']}; embedded model, "
            f"{res['max_tokens']} tokens per stream, {res['streams']} streams per phase, {res['senders']} senders of "
            f"huge prompts; load average {res['load_avg']} at the start.  Target: p99 below 3x the quiet p99.\n\n"
            + "\n".join(rows) + "\n")


def measure(src: Path | None, args) -> dict:
    """The phases against one server (``src``: the PYTHONPATH of the kvkeeper it runs; None: this process's)."""
    env = None if src is None else {**os.environ, "PYTHONPATH": str(src)}
    with tempfile.TemporaryDirectory() as tmp, server_process(Path(tmp) / "server.log", env=env) as (base, _):
        asyncio.run(phase(base, None, 1, 0, 8))  # warm-up
        phases = {"quiet": asyncio.run(phase(base, None, args.streams, 0, args.max_tokens))}
        for name, size in PROMPTS.items():
            phases[name] = asyncio.run(phase(base, size, args.streams, args.senders, args.max_tokens))
    quiet = phases["quiet"]["p99_s"]
    for p in phases.values():
        p["p99_ratio"] = p["p99_s"] / quiet
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "prompt_stall_bench")
    ap.add_argument("--config", default=MODEL, help="the result's config name (e.g. the code measured)")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="another kvkeeper src folder to measure first, in the same run (before / after)")
    args = ap.parse_args()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    runs = {}
    if args.baseline_src is not None:
        runs[f"baseline ({args.baseline_src})"] = measure(args.baseline_src.resolve(), args)
    runs["this"] = measure(None, args)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(), "load_avg": load,
           "max_tokens": args.max_tokens, "streams": args.streams, "senders": args.senders, "runs": runs,
           "phases": runs["this"]}
    args.out.mkdir(parents=True, exist_ok=True)
    res["config"] = args.config
    write_report(args.out, result_name("prompt_stall_bench", args.config), res, markdown(res))


if __name__ == "__main__":
    main()
