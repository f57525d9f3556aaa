#!/usr/bin/env python
"""The cost model of ``benchmarks/cluster/cluster_sim.py``, fit from a short real engine run on this machine.

One ``LLMEngine`` (the embedded SmolLM2-135M-Instruct, its GGUF weights, ``--threads`` torch threads: 1 by default,
as each replica of ``cluster_bench`` runs) measures, with greedy decoding and ``ignore_eos``:

* prefill: the time to first token of one prompt of ``n`` new tokens on top of ``c`` tokens already cached
  (a prefix-cache hit), for n in 32..512 and c in {0, 512}: fit ``t = p0 + p1 * n + p2 * n * c`` by least squares
  (seconds; p1 per prefill token, p2 the attention over the cached context per new token and cached token);
* decode: the seconds per decode step at batch sizes 1..16 (each request's ``1 / decode_tok_per_s`` while all of
  the batch decode together, context about 200 tokens: 24 timed ``step()`` calls after the last prefill): fit ``t = d0 + d1 * batch``.

Both fits are non-negative least squares.  ``--refit FILE`` fits the points of an earlier run again.

``--from-engine-bench FILE`` takes the points from an ``engine_bench`` JSON instead of running the engine (a run on a
quiet machine; a busy shared machine makes the short run's times meaningless): prefill from its multi-turn TTFTs
(new tokens over a cached history), its single-stream TTFT and its 7,000-token prefill (chunks of 512, each over
the tokens before it); decode from its single-stream step (batch 1) and its 16-stream decode-only rate (batch
16).  Those ran 2 threads; ``--scale`` (default 2) multiplies every time, for replicas of 1 thread each as in
``cluster_bench`` (prefill and batched decode are compute-bound, so about linear in threads: assumed, not
measured).

Writes ``OUT/cluster_sim_costs-<config>-<date>.json`` (the fit, the raw points and their residuals) and ``.md``.

    .venv/bin/python benchmarks/cluster/cluster_sim_costs.py [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import MODEL, RESULTS, cpu_model, result_name, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"


def measure(threads: int, repeats: int) -> dict:
    from kvkeeper import LLMEngine, SamplingParams

    eng = LLMEngine(num_threads=threads)
    ids = eng.tokenizer.encode(TEXT.read_text(encoding="utf-8")[20000:400000])
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng.generate([ids[:64]], one)  # warm-up
    prefill, off = [], 0
    for cached in (0, 512):
        for n in (32, 64, 128, 256, 512):
            ts = []
            for _ in range(repeats):
                off += 1500  # a fresh stretch of text each time: nothing cached but what is meant to be
                base = ids[off:off + cached]
                if cached:
                    eng.generate([base], one)  # now cached (its full blocks)
                out = eng.generate([base + ids[off + cached:off + cached + n]], one)[0]
                got = out.cached_tokens
                ts.append(out.ttft_s)
            prefill.append({"new": n + (cached - got), "cached": got, "ttft_s": statistics.median(ts)})
    decode = []
    for b in (1, 2, 4, 8, 16):
        steps = []
        for _ in range(repeats):
            off += 200 * b + 100
            seqs = [eng.add_request(ids[off + 200 * i:off + 200 * (i + 1)],
                                    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for i in range(b)]
            while any(s.num_computed < s.num_prompt_tokens for s in seqs):  # prefill (and early decodes)
                eng.step()
            for _ in range(24):  # now all b decode together: one token each per step
                t = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t)
            while eng.has_unfinished():
                eng.step()
        decode.append({"batch": b, "step_s": statistics.median(steps)})
    return {"prefill": prefill, "decode": decode}


def from_engine_bench(path: Path, scale: float) -> dict:
    """Points from an engine_bench JSON (see the module docstring), times x ``scale``."""
    d = json.loads(Path(path).read_text())
    prefill = [{"new": t["prompt_tokens"] - t["cached_tokens"], "cached": t["cached_tokens"],
                "ttft_s": t["kvkeeper_ttft_s"] * scale} for t in d["multiturn"]["turns"]]
    ss = d["single_stream"]
    prefill.append({"new": ss["prompt_tokens"], "cached": 0, "ttft_s": ss["kvkeeper"]["ttft_s"] * scale})
    lc = d["long_context"]
    chunks = [(min(512, lc["prompt_tokens"] - c), c) for c in range(0, lc["prompt_tokens"], 512)]
    prefill.append({"new": lc["prompt_tokens"], "cached": 0, "ttft_s": lc["kvkeeper"]["prefill_s"] * scale,
                    "steps": len(chunks), "new_x_context": sum(n * c for n, c in chunks)})
    b16 = d["batched"]
    decode = [{"batch": 1, "step_s": scale / ss["kvkeeper"]["decode_tok_per_s"]},
              {"batch": b16["requests"], "step_s": scale * b16["requests"] / b16["kvkeeper"]["decode_only_tok_per_s"]}]
    return {"prefill": prefill, "decode": decode, "source": f"{Path(path).name} x {scale:g}",
            "source_machine": d["machine"]}


def fit(points: dict) -> dict:
    """Non-negative least-squares fits of the points (see the module docstring; scipy's ``nnls``, Lawson and
    Hanson 1974: a cost coefficient below zero, which a noisy machine can give, means nothing)."""
    from scipy.optimize import nnls

    pf = points["prefill"]
    a = np.array([[p.get("steps", 1), p["new"], p.get("new_x_context", p["new"] * p["cached"])] for p in pf])
    y = np.array([p["ttft_s"] for p in pf])
    (p0, p1, p2), _ = nnls(a, y)
    dc = points["decode"]
    b = np.array([[1.0, d["batch"]] for d in dc])
    z = np.array([d["step_s"] for d in dc])
    (d0, d1), _ = nnls(b, z)
    for p, t in zip(pf, a @ [p0, p1, p2]):
        p["fit_s"] = float(t)
    for d, t in zip(dc, b @ [d0, d1]):
        d["fit_s"] = float(t)
    return {"prefill_s": float(p0), "prefill_per_token_s": float(p1), "prefill_per_token_context_s": float(p2),
            "decode_step_s": float(d0), "decode_per_seq_s": float(d1)}


def markdown(res: dict) -> str:
    f = res["fit"]
    lines = [f"# Cluster simulator cost model ({res['date']})", "",
             f"{res['machine']}; {res['threads']} torch thread(s); load average at the start {res['load_avg']}, at the end "
             f"{res.get('load_avg_end', 'n/a')}.  Points: {res['points'].get('source', 'a short engine run')}.", "",
             f"prefill(n new, c cached) = {f['prefill_s'] * 1e3:.2f} ms + n x {f['prefill_per_token_s'] * 1e3:.3f} ms"
             f" + n x c x {f['prefill_per_token_context_s'] * 1e9:.2f} ns; "
             f"decode step(batch b) = {f['decode_step_s'] * 1e3:.2f} ms + b x {f['decode_per_seq_s'] * 1e3:.3f} ms", "",
             "| prefill: new tokens | cached | measured TTFT (ms) | fit (ms) |", "|---|---|---|---|"]
    lines += [f"| {p['new']} | {p['cached']} | {p['ttft_s'] * 1e3:.1f} | {p['fit_s'] * 1e3:.1f} |"
              for p in res["points"]["prefill"]]
    lines += ["", "| decode: batch | measured step (ms) | fit (ms) |", "|---|---|---|"]
    lines += [f"| {d['batch']} | {d['step_s'] * 1e3:.2f} | {d['fit_s'] * 1e3:.2f} |" for d in res["points"]["decode"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import datetime as _dt

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "cluster_sim_costs")
    ap.add_argument("--config", default=MODEL)
    ap.add_argument("--from-engine-bench", type=Path, default=None, help="take the points from this engine_bench JSON")
    ap.add_argument("--scale", type=float, default=2.0, help="with --from-engine-bench: times x this (default 2)")
    ap.add_argument("--name", default=None, help="write OUT/NAME.json and .md (default cluster_sim_costs-CONFIG-DATE)")
    ap.add_argument("--refit", type=Path, default=None, help="fit the points of this earlier JSON (no engine run)")
    a = ap.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if a.from_engine_bench:
        points = from_engine_bench(a.from_engine_bench, a.scale)
        load = f"{points['source_machine'].get('loadavg_start')} (the engine_bench run's)"
        a.threads = f"{points['source_machine'].get('torch_threads')} (costs x {a.scale:g})"
    elif a.refit:
        old = json.loads(a.refit.read_text())
        points, load, a.threads = old["points"], old["load_avg"], old["threads"]
    else:
        points = measure(a.threads, a.repeats)
    res = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{cpu_model()}, {os.cpu_count()} CPUs", "threads": a.threads, "load_avg": load,
           "points": points, "fit": fit(points),
           "load_avg_end": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    if "source_machine" in points:
        m = points["source_machine"]
        res["load_avg_end"] = f"{m.get('loadavg_end')} (the engine_bench run's)"
        res["machine"] = f"{m.get('cpu_model')}, {m.get('os_cpu_count')} CPUs (the engine_bench run's, {m.get('date')})"
    a.out.mkdir(parents=True, exist_ok=True)
    write_report(a.out, a.name or result_name("cluster_sim_costs", a.config), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
