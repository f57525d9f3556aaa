#!/usr/bin/env python
"""The cost model of ``benchmarks/cluster_sim.py``, fit from a short real engine run on this machine.

One ``LLMEngine`` (the embedded SmolLM2-135M-Instruct, its GGUF weights, ``--threads`` torch threads: 1 by default,
as each replica of ``cluster_bench`` runs) measures, with greedy decoding and ``ignore_eos``:

* prefill: the time to first token of one prompt of ``n`` new tokens on top of ``c`` tokens already cached
  (a prefix-cache hit), for n in 32..512 and c in {0, 512}: fit ``t = p0 + p1 * n + p2 * n * c`` by least squares
  (seconds; p1 per prefill token, p2 the attention over the cached context per new token and cached token);
* decode: the seconds per decode step at batch sizes 1..16 (each request's ``1 / decode_tok_per_s`` while all of
  the batch decode together, context about 200 tokens: 24 timed ``step()`` calls after the last prefill): fit ``t = d0 + d1 * batch``.

Both fits are non-negative least squares.  ``--refit FILE`` fits the points of an earlier run again.

Writes ``OUT/cluster_sim_costs-<config>-<date>.json`` (the fit, the raw points and their residuals) and ``.md``.

    .venv/bin/python benchmarks/cluster_sim_costs.py [--threads 1] [--repeats 3]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODEL, RESULTS, cpu_model, result_name, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
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


def fit(points: dict) -> dict:
    """Non-negative least-squares fits of the points (see the module docstring; scipy's ``nnls``, Lawson and
    Hanson 1974: a cost coefficient below zero, which a noisy machine can give, means nothing)."""
    from scipy.optimize import nnls

    pf = points["prefill"]
    a = np.array([[1.0, p["new"], p["new"] * p["cached"]] for p in pf])
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
             f"{res['machine']}; {res['threads']} torch thread(s); load average at the start {res['load_avg']}.", "",
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
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--config", default=MODEL)
    ap.add_argument("--refit", type=Path, default=None, help="fit the points of this earlier JSON (no engine run)")
    a = ap.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if a.refit:
        old = json.loads(a.refit.read_text())
        points, load, a.threads = old["points"], old["load_avg"], old["threads"]
    else:
        points = measure(a.threads, a.repeats)
    res = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{cpu_model()}, {os.cpu_count()} CPUs", "threads": a.threads, "load_avg": load,
           "points": points, "fit": fit(points),
           "load_avg_end": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    a.out.mkdir(parents=True, exist_ok=True)
    write_report(a.out, result_name("cluster_sim_costs", a.config), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
