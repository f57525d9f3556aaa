#!/usr/bin/env python
"""What a quantized KV cache costs in perplexity at 1k, 2k, 4k and 8k tokens (issue 44, item 7).

For each text window and context length, the embedded SmolLM2-135M-Instruct (the default engine: its GGUF weights in
place) scores the window's first N tokens as one sequence, prefilled in 512-token chunks through the engine's own
paged cache (``kvkeeper.eval.perplexity``), once per KV dtype; the report gives each dtype's perplexity and its ratio
to bf16's on the same tokens.  Windows: Pride and Prejudice (``data/gutenberg_pride_and_prejudice``, public domain)
after its first 2,000 tokens (the title page and contents), and a second window 60,000 tokens further in, so that
a figure is not one passage's.  WikiText is not in the repository's data; the issue's 2k figure was on WikiText.

Writes ``OUT/kv_context_sweep-smollm2-135m-<date>.json`` and ``.md``.

    .venv/bin/python benchmarks/kv/kv_context_sweep.py [--contexts 1024 2048 4096 8192] [--dtypes bf16 int4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import RESULTS, cpu_model, result_name, run_date, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"
WINDOWS = {"pride-2000": 2000, "pride-62000": 62000}  # tokens skipped before the window


def engine(kv_dtype: str, block_size: int | None):
    from kvkeeper import LLMEngine

    return LLMEngine(kv_dtype=kv_dtype, kv_cache_bytes=1 << 30, **({"block_size": block_size} if block_size else {}))


def sweep(dtypes: list[str], contexts: list[int], block_size: int | None) -> list[dict]:
    """One row per (window, context, dtype): perplexity, its ratio to bf16 on the same tokens, seconds."""
    from kvkeeper.eval.perplexity import perplexity, read_text_tokens

    rows = []
    for dtype in dtypes:
        eng = engine(dtype, block_size)
        for window, skip in WINDOWS.items():
            ids = read_text_tokens(eng, BOOK, max(contexts), skip_tokens=skip)
            for n in contexts:
                t = time.perf_counter()
                r = perplexity(eng, ids[:n], chunk=512)
                rows.append({"window": window, "context": n, "kv_dtype": dtype, "ppl": r["ppl"],
                             "kv_bytes_per_token": r["kv_bytes_per_token"], "seconds": time.perf_counter() - t})
                print(f"{window} {n:>5} {dtype:>5}: ppl {r['ppl']:.4f} ({time.perf_counter() - t:.1f} s)", flush=True)
        del eng
    base = {(r["window"], r["context"]): r["ppl"] for r in rows if r["kv_dtype"] == "bf16"}
    for r in rows:
        b = base.get((r["window"], r["context"]))
        r["ratio_to_bf16"] = r["ppl"] / b if b else None
    return rows


def markdown(res: dict) -> str:
    lines = [f"# KV dtype perplexity by context ({res['date']})", "",
             f"{res['model']}, {res['cpu']}, {res['threads']} torch threads, load {res['load_before']} before and "
             f"{res['load_after']} after. Command: `{res['command']}`", "",
             "| window | context | KV dtype | perplexity | x bf16 | KV bytes/token |", "|---|---:|---|---:|---:|---:|"]
    for r in res["rows"]:
        ratio = f"{r['ratio_to_bf16']:.4f}" if r["ratio_to_bf16"] else "-"
        lines.append(f"| {r['window']} | {r['context']} | {r['kv_dtype']} | {r['ppl']:.3f} | {ratio} | "
                     f"{r['kv_bytes_per_token']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="tokens scored")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "int8", "int4"], help="KV dtypes (bf16 first: the base)")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the dtype's default)")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_context_sweep")
    args = ap.parse_args(argv)
    import torch

    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = sweep(args.dtypes, args.contexts, args.block_size)
    res = {"date": run_date(), "model": "SmolLM2-135M-Instruct (embedded GGUF, default engine)", "cpu": cpu_model(),
           "threads": torch.get_num_threads(), "load_before": load0,
           "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
           "command": "benchmarks/kv/kv_context_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": rows}
    write_report(args.out, result_name("kv_context_sweep"), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
