#!/usr/bin/env python
"""KV quantization and compression: quality, memory and speed, with NVIDIA kvpress measured in the same run.

Sections (SmolLM2-135M-Instruct fp32 weights, this CPU):

1. Perplexity by KV dtype (fp32, bf16, fp16, int8, fp8) at context lengths 1k to 8k: the first N tokens
   of Pride and Prejudice after its first 2,000 (``kvkeeper eval perplexity``'s protocol).
2. Policies (streaming_llm, h2o, snapkv, knorm) at each ratio: continuation perplexity (a 2,048-token
   context compressed, the next 256 tokens scored) and passkey retrieval accuracy over lengths and
   depths; the uncompressed baseline beside them; kvpress's presses of the same names on the same token
   ids when ``--kvpress-python`` names a Python that has kvpress (see kvpress_peer.py).
3. Memory and speed at an 8k context for each dtype and policy, each in its own process: KV bytes held
   by the request after prefill (and compression), peak RSS, prefill seconds, decode tok/s (64 tokens).

Writes ``OUT/kv_bench-<config>-<date>.json``, ``.md`` and PNG plots ``OUT/kv_bench-<config>-<date>-*.png``.

    .venv/bin/python benchmarks/kv/kv_bench.py [--quick] [--kvpress-python /path/to/venv/bin/python] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"
SKIP = 2000
DTYPES = ["fp32", "bf16", "fp16", "int8", "fp8"]
POLICIES = ["streaming_llm", "h2o", "snapkv", "knorm"]


def _engine(kv_dtype="fp32", budget=1 << 30):
    from kvkeeper import LLMEngine

    return LLMEngine(kv_dtype=kv_dtype, kv_cache_bytes=budget)


def section_dtypes(contexts: list[int]) -> list[dict]:
    from kvkeeper.eval.perplexity import perplexity, read_text_tokens

    rows = []
    for d in DTYPES:
        eng = _engine(d)
        for n in contexts:
            r = perplexity(eng, read_text_tokens(eng, BOOK, n, SKIP))
            r.pop("policy", None)
            rows.append({**r, "kv_dtype": d, "kv_format": r["kv_dtype"], "context": n})
            print(json.dumps(rows[-1]), flush=True)
        del eng
    return rows


def section_policies(ratios: list[float], ctx: int, score: int, lengths, depths, trials: int) -> tuple[list, dict]:
    from kvkeeper.eval.passkey import build_prompt, passkey_grid
    from kvkeeper.eval.perplexity import perplexity, read_text_tokens
    from kvkeeper.kvcache.compression import KVCompression

    eng = _engine()
    ids = read_text_tokens(eng, BOOK, ctx + score, SKIP)
    rows = []
    for policy, ratio in [("none", 0.0)] + [(p, r) for r in ratios for p in POLICIES]:
        comp = KVCompression(policy, ratio) if policy != "none" else None
        pp = perplexity(eng, ids, compression=comp, score_tokens=score)
        pk = passkey_grid(eng, lengths, depths, trials=trials, compression=comp)
        rows.append({"engine": "kvkeeper", "policy": policy, "ratio": ratio, "ppl": pp["ppl"], "kv_tokens": pp["kv_tokens"],
                     "passkey_accuracy": pk["accuracy"], "passkey_trials": pk["trials"], "passkey_cells": pk["cells"],
                     "seconds": pp["seconds"] + pk["seconds"]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "passkey_cells"}), flush=True)
    # the same inputs for the peer
    import random

    rng = random.Random(0)
    jobs = []
    for L in lengths:
        for d in depths:
            for _ in range(trials):
                key = rng.randint(10000, 99999)
                jobs.append({"ids": build_prompt(eng.tokenizer, L, d, key), "key": key, "length": L, "depth": d})
    return rows, {"ppl": {"ids": ids, "score_tokens": score}, "passkey": jobs}


def section_kvpress(py: str, inputs: dict, ratios: list[float], out_dir: Path) -> tuple[list, str | None]:
    from serving.serve_bench import hf_folder

    job = {"model": str(hf_folder()), "presses": [["none", 0.0]] + [[p, r] for r in ratios for p in POLICIES],
           "threads": os.cpu_count() or 2, "max_tokens": 8, **inputs}
    with tempfile.TemporaryDirectory() as td:
        jp, op = Path(td) / "job.json", Path(td) / "out.json"
        jp.write_text(json.dumps(job))
        peer = ROOT / "benchmarks" / "kv" / "kvpress_peer.py"
        p = subprocess.run([py, str(peer), str(jp), str(op)], capture_output=True, text=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        log = result_path("kv_bench", suffix="-kvpress.log", out=out_dir)
        log.write_text(p.stdout + p.stderr)
        if p.returncode != 0:
            return [], f"kvpress run failed (exit {p.returncode}); see {log.name}"
        rows = json.loads(op.read_text())
    for r in rows:
        r["engine"] = "kvpress"
    return rows, None


def memspeed_child(kv_dtype: str, policy: str, ratio: float, ctx: int, new: int) -> dict:
    """One configuration in a fresh process: KV bytes, peak RSS, prefill s, decode tok/s."""
    from kvkeeper import SamplingParams
    from kvkeeper.eval.perplexity import read_text_tokens
    from kvkeeper.kvcache.compression import KVCompression

    budget = 2 * ctx * 46080 + (64 << 20)
    eng = _engine(kv_dtype, budget=budget)
    ids = read_text_tokens(eng, BOOK, ctx - new, SKIP)  # prompt plus new tokens fill the context
    comp = KVCompression(policy, ratio) if policy != "none" else None
    import gc

    gc.collect()
    rss0 = _status_bytes("VmRSS")
    try:  # reset the peak-RSS mark so that it covers this request only (Linux)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    seq = eng.add_request(ids, SamplingParams(max_tokens=new, ignore_eos=True), compression=comp)
    t0 = time.perf_counter()
    while seq.num_output_tokens < 1 or (comp is not None and not seq.compressed):
        eng.step()
    t1 = time.perf_counter()
    kv_tokens = seq.num_computed - seq.kv_offset
    kv_blocks = len(seq.block_table)
    eng.run_until_done([seq])
    t2 = time.perf_counter()
    return {"kv_dtype": eng.runner.kv_format.name, "policy": policy, "ratio": ratio, "context": ctx,
            "kv_tokens": kv_tokens, "kv_bytes": kv_blocks * eng.block_size * eng.kv.bytes_per_token,
            "kv_bytes_per_token": eng.kv.bytes_per_token, "prefill_s": t1 - t0,
            "decode_tok_per_s": (new - 1) / (t2 - t1), "peak_rss_bytes": _status_bytes("VmHWM"),
            "rss_before_request_bytes": rss0}


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def section_memspeed(ctx: int, new: int) -> list[dict]:
    rows = []
    configs = [(d, "none", 0.0) for d in DTYPES] + [("fp32", p, 0.5) for p in POLICIES] + [("int8", "snapkv", 0.5)]
    for d, p, r in configs:
        out = subprocess.run([sys.executable, __file__, "--_child", d, p, str(r), str(ctx), str(new)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            rows.append({"kv_dtype": d, "policy": p, "ratio": r, "error": out.stderr[-500:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def plots(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in DTYPES:
        pts = [(r["context"], r["ppl"]) for r in res["dtypes"] if r["kv_dtype"] == d]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=d)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity by KV dtype")
    ax.legend()
    fig.tight_layout()
    png = result_path("kv_bench", suffix="-ppl_dtypes.png", out=out)
    fig.savefig(png, dpi=110)
    files.append(png.name)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for eng_name, style in (("kvkeeper", "-o"), ("kvpress", "--s")):
        for p in POLICIES:
            rows = sorted([r for r in res["policies"] if r["engine"] == eng_name and r["policy"] == p],
                          key=lambda r: r["ratio"])
            if not rows:
                continue
            base = next((r for r in res["policies"] if r["engine"] == eng_name and r["policy"] == "none"), None)
            xs = [0.0] + [r["ratio"] for r in rows] if base else [r["ratio"] for r in rows]
            pp = ([base["ppl"]] if base else []) + [r["ppl"] for r in rows]
            axes[0].plot(xs, pp, style, label=f"{eng_name} {p}")
            if all("passkey_accuracy" in r for r in rows):
                acc = ([base["passkey_accuracy"]] if base else []) + [r["passkey_accuracy"] for r in rows]
                axes[1].plot(xs, acc, style, label=f"{eng_name} {p}")
    axes[0].set_xlabel("compression ratio")
    axes[0].set_ylabel("continuation perplexity")
    axes[1].set_xlabel("compression ratio")
    axes[1].set_ylabel("passkey accuracy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png = result_path("kv_bench", suffix="-policies.png", out=out)
    fig.savefig(png, dpi=110)
    files.append(png.name)
    plt.close(fig)
    return files


def markdown(res: dict) -> str:
    L = [f"# KV quantization and compression ({res['date']})", "", res["machine"], ""]
    if res["dtypes"]:
        ctxs = sorted({r["context"] for r in res["dtypes"]})
        L += ["## Perplexity by KV dtype (Pride and Prejudice, after the first 2,000 tokens)", "",
              "| KV dtype | bytes/token | " + " | ".join(f"ppl @{c}" for c in ctxs) + " | vs fp32 @" + str(ctxs[-1]) + " |",
              "|---|---|" + "---|" * len(ctxs) + "---|"]
        ref = {r["context"]: r["ppl"] for r in res["dtypes"] if r["kv_dtype"] == "fp32"}
        for d in DTYPES:
            rr = {r["context"]: r for r in res["dtypes"] if r["kv_dtype"] == d}
            if rr:
                last = rr[ctxs[-1]]["ppl"] / ref[ctxs[-1]] - 1
                L.append(f"| {d} | {next(iter(rr.values()))['kv_bytes_per_token']:,} | "
                         + " | ".join(f"{rr[c]['ppl']:.3f}" for c in ctxs) + f" | {100 * last:+.2f}% |")
        L.append("")
    if res["policies"]:
        L += [f"## Policies: continuation perplexity ({res['policy_context']}-token context, {res['policy_score']} "
              f"scored) and passkey accuracy ({res['passkey_trials']} trials: lengths {res['passkey_lengths']}, "
              f"depths {res['passkey_depths']})", "",
              "| policy | ratio | kvkeeper ppl | kvpress ppl | kvkeeper passkey | kvpress passkey |", "|---|---|---|---|---|---|"]
        keys = [(r["policy"], r["ratio"]) for r in res["policies"] if r["engine"] == "kvkeeper"]
        for p, ratio in keys:
            k = next(r for r in res["policies"] if r["engine"] == "kvkeeper" and (r["policy"], r["ratio"]) == (p, ratio))
            q = next((r for r in res["policies"] if r["engine"] == "kvpress" and (r["policy"], r["ratio"]) == (p, ratio)), {})
            f = lambda r, key, fmt: fmt.format(r[key]) if key in r else "n/a"  # noqa: E731
            L.append(f"| {p} | {ratio} | {f(k, 'ppl', '{:.3f}')} | {f(q, 'ppl', '{:.3f}')} | "
                     f"{f(k, 'passkey_accuracy', '{:.0%}')} | {f(q, 'passkey_accuracy', '{:.0%}')} |")
        L.append("")
    if res["memspeed"]:
        L += [f"## Memory and speed at a {res['memspeed_context']}-token context", "",
              "KV MB: the request's blocks after prefill (and compression). RSS: resident memory of the process "
              "before the request (model and KV pool allocated) and its peak during the request.", "",
              "| KV dtype | policy | KV tokens | KV MB | RSS before MB | peak RSS MB | prefill s | decode tok/s |",
              "|---|---|---|---|---|---|---|---|"]
        for r in res["memspeed"]:
            if "error" in r:
                L.append(f"| {r['kv_dtype']} | {r['policy']} | error | | | | | |")
                continue
            pol = r["policy"] if r["policy"] == "none" else f"{r['policy']} {r['ratio']}"
            L.append(f"| {r['kv_dtype']} | {pol} | {r['kv_tokens']} | {r['kv_bytes'] / 1e6:.1f} | "
                     f"{r['rss_before_request_bytes'] / 1e6:.0f} | {r['peak_rss_bytes'] / 1e6:.0f} | {r['prefill_s']:.1f} | {r['decode_tok_per_s']:.1f} |")
        L.append("")
    L += [f"* {n}" for n in res["notes"]]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="small grid (smoke run)")
    ap.add_argument("--kvpress-python", metavar="PY", help="a Python with kvpress installed (peer)")
    ap.add_argument("--sections", nargs="+", default=["dtypes", "policies", "memspeed"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_bench"))
    args = ap.parse_args(argv)
    if args._child:
        d, p, r, c, n = args._child
        print(json.dumps(memspeed_child(d, p, float(r), int(c), int(n))))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    q = args.quick
    contexts = [256, 512] if q else [1024, 2048, 4096, 8192]
    ratios = [0.5] if q else [0.5, 0.75]
    lengths, depths, trials = ([512], [0.0, 1.0], 1) if q else ([1024, 2048, 4096], [0.0, 0.5, 1.0], 2)
    pctx, pscore = (256, 64) if q else (2048, 256)
    mctx = 1024 if q else 8192
    from common import cpu_model, latest_result, result_name, write_report

    cpu = cpu_model()
    prev = latest_result("kv_bench", out=out)  # the sections not rerun come from the last run
    res = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "machine": f"{cpu}, {os.cpu_count()} CPUs",
           "dtypes": [], "policies": [], "memspeed": [], "notes": [], "policy_context": pctx, "policy_score": pscore,
           "passkey_lengths": lengths, "passkey_depths": depths, "passkey_trials": len(lengths) * len(depths) * trials,
           "memspeed_context": mctx}
    if prev and set(args.sections) != {"dtypes", "policies", "memspeed"}:  # keep sections not rerun
        old = json.loads(prev.read_text())
        if "dtypes" not in args.sections:
            res["dtypes"] = old.get("dtypes", [])
        if "policies" not in args.sections:
            for k in ("policies", "notes", "policy_context", "policy_score", "passkey_lengths", "passkey_depths",
                      "passkey_trials"):
                res[k] = old.get(k, res[k])
        res["date"] = f"{old.get('date')} (rerun of {', '.join(args.sections)}: {res['date']})"
    if "dtypes" in args.sections:
        res["dtypes"] = section_dtypes(contexts)
    if "policies" in args.sections:
        rows, inputs = section_policies(ratios, pctx, pscore, lengths, depths, trials)
        res["policies"] = rows
        if args.kvpress_python:
            peer, err = section_kvpress(args.kvpress_python, inputs, ratios, out)
            res["policies"] += peer
            if err:
                res["notes"].append(err)
        else:
            res["notes"].append("kvpress: not measured (pass --kvpress-python)")
    if "memspeed" in args.sections:
        res["memspeed"] = section_memspeed(mctx, 16 if q else 64)
    res["plots"] = plots(res, out)
    write_report(out, result_name("kv_bench"), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
