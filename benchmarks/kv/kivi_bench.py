#!/usr/bin/env python
"""KIVI int4 / int2 KV beside bf16 and int8 (issue 27): quality, size and decode speed, one run.

Per KV dtype (bf16, int8, int4, int2), the embedded SmolLM2-135M-Instruct (its GGUF Q4_1 weights, the
default engine):

1. perplexity at 4,096 tokens: Pride and Prejudice after its first 2,000 tokens, prefilled in 512-token
   chunks through the engine's own paged cache (``kvkeeper.eval.perplexity``);
2. passkey retrieval (``kvkeeper.eval.passkey``) at about 2,000 tokens (depths 0.1 / 0.5 / 0.9, ``--trials``
   keys each) and 7,000 tokens (one prompt per ``--long-depths`` depth, default 0.5 and 0.1);
3. KV bytes per token (closed blocks, all layers, K plus V, scales included) and sessions of 2,000 tokens per
   GiB of pool (KIVI: the 16-bit window's fixed pool counted apart);
4. decode tok/s after a 7,000-token prompt (the first 7k passkey prompt's reply: 64 tokens, greedy, EOS
   ignored), every dtype, and llama.cpp
   (llama-cpp-python, ``--llama-python``) on the same GGUF with q4_0 K/V (flash attention, as llama.cpp needs
   for a quantized V) and with f16 K/V, the same token ids, the same thread count.

Writes ``OUT/kivi_bench-smollm2-135m-<date>.json`` and ``.md``.

    .venv/bin/python benchmarks/kv/kivi_bench.py [--quick] [--kivi-block-size N] [--llama-python /path/to/python] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import RESULTS, cpu_model, result_name, run_date  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"
DTYPES = ["bf16", "int8", "int4", "int2"]

LLAMA_WORKER = r'''
import json, sys, time
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.argv[1])
ids = json.load(open(a["ids"]))
llm = Llama(model_path=a["model"], n_ctx=8192, n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, type_k=a["type"], type_v=a["type"], flash_attn=True, verbose=False, logits_all=False)
t = time.perf_counter(); llm.eval(ids); prefill = time.perf_counter() - t
# logits_all=False keeps no score rows (llm.scores has n_batch rows, never filled): read the last token's logits
last = lambda: int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
tok = last(); t = time.perf_counter()
for _ in range(a["n"]):
    llm.eval([tok]); tok = last()
dec = time.perf_counter() - t
print(json.dumps({"prefill_s": prefill, "decode_tok_s": a["n"] / dec}))
'''


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def engine(kv_dtype: str, block_size: int | None = None):
    from kvkeeper import LLMEngine

    return LLMEngine(kv_dtype=kv_dtype, kv_cache_bytes=1 << 30, **({"block_size": block_size} if block_size else {}))


def decode_after(eng, ids: list[int], n: int) -> dict:
    from kvkeeper import SamplingParams

    t = time.perf_counter()
    out = eng.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                       namespace=eng.isolated_namespace("decode"))[0]
    return {"prompt_tokens": len(ids), "decoded": len(out.token_ids), "ttft_s": out.ttft_s,
            "decode_tok_s": out.decode_tok_per_s, "total_s": time.perf_counter() - t}, out.text


def llama_decode(python: str, model: str, ids: list[int], n: int, kv_type: int, threads: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    try:
        p = subprocess.run([python, "-c", LLAMA_WORKER, json.dumps({"ids": f.name, "model": model, "n": n,
                                                                    "type": kv_type, "threads": threads})],
                           capture_output=True, text=True, timeout=1800)
        if p.returncode:
            return {"error": p.stderr[-500:]}
        return json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(f.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1k perplexity, passkey at 2k only, 16 decode tokens")
    ap.add_argument("--trials", type=int, default=1, help="passkey keys per (length, depth)")
    ap.add_argument("--llama-python", default=sys.executable,
                    help="a Python with llama-cpp-python (default: this one; '' to skip llama.cpp)")
    ap.add_argument("--out", type=Path, default=RESULTS / "kivi_bench")
    ap.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES, help="KV dtypes to run, in this order")
    ap.add_argument("--resume", type=Path, help="a previous run's JSON (or .partial.json): its dtypes and decode "
                    "rows are kept (a loaded machine: run the dtypes in several processes)")
    ap.add_argument("--long-depths", type=float, nargs="+", default=[0.5, 0.1],
                    help="needle depths of the 7,000-token passkey prompts (each also times decode after it)")
    ap.add_argument("--kivi-block-size", type=int, default=None,
                    help="block size of the int4 / int2 engines (a KIVI key group is one block; default: the "
                         "engine's, 16); bf16 and int8 keep the default")
    ap.add_argument("--llama-kv", nargs="+", default=["q4_0"], choices=["q4_0", "f16"],
                    help="llama.cpp K/V types to time")
    args = ap.parse_args(argv)
    import torch

    from kvkeeper.eval.passkey import answer_key, build_prompt, passkey_grid
    from kvkeeper.eval.perplexity import perplexity, read_text_tokens
    from kvkeeper.kvcache.formats.base import parse_kv_format
    from kvkeeper.weights.sources import resolve_model_path

    ctx = 1024 if args.quick else 4096
    lengths = [2000] if args.quick else [2000, 7000]  # passkey: 2k by passkey_grid, 7k one prompt per depth
    n_dec = 16 if args.quick else 64
    res = {"date": run_date(), "cpu": cpu_model(), "threads": torch.get_num_threads(), "load_start": load(),
           "command": "benchmarks/kv/kivi_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "dtypes": {}, "decode": {}}
    long_ids = None
    if args.resume:
        prev = json.loads(args.resume.read_text())
        res["dtypes"].update(prev["dtypes"])
        res["decode"].update(prev["decode"])
        res["resumed_from"] = {"file": args.resume.name, "date": prev["date"], "load_start": prev["load_start"]}
    for d in args.dtypes:
        fmt = parse_kv_format(d)
        eng = engine(d, args.kivi_block_size if fmt.kivi else None)
        row = {"kv_format": eng.runner.kv_format.name, "block_size": eng.block_size,
               "bytes_per_token": eng.runner.kv_store.bytes_per_token}
        row["bytes_per_token_vs_bf16"] = row["bytes_per_token"] / parse_kv_format("bf16").bytes_per_token(30, 3, 64)
        window = sum(c.res_k.nbytes + c.res_v.nbytes for c in eng.runner.kv_store) if fmt.kivi else 0
        row["window_pool_bytes"] = window
        per_session = -(-2000 // eng.block_size) * eng.block_size * row["bytes_per_token"]
        row["sessions_2k_per_gib"] = int(((1 << 30) - window) // per_session)
        ids = read_text_tokens(eng, BOOK, ctx, 2000)
        r = perplexity(eng, ids)
        row.update({"ppl": r["ppl"], "ppl_tokens": ctx, "ppl_seconds": r["seconds"]})
        print(d, "ppl", r["ppl"], f"load {load()}", flush=True)
        g = passkey_grid(eng, [2000], [0.1, 0.5, 0.9], trials=args.trials)
        row["passkey"] = {"2000": g["accuracy"]}
        row["passkey_seconds"] = g["seconds"]
        if not args.quick:  # 7,000 tokens: one prompt per depth, its reply also times the decode after it
            solved, runs = 0, []
            for depth in args.long_depths:
                key = 10000 + int(depth * 80000) + 7
                ids = build_prompt(eng.tokenizer, 7000, depth, key)
                r, text = decode_after(eng, ids, n_dec)
                solved += int(answer_key(text) == key)
                runs.append(r)
                if long_ids is None:
                    long_ids = ids
            row["passkey"]["7000"] = solved / len(args.long_depths)
            row["decode_after_7000"] = runs
            res["decode"][d] = {**runs[0], "load": load()}
        print(d, "passkey", row["passkey"], f"load {load()}", flush=True)
        res["dtypes"][d] = row
        del eng
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{result_name('kivi_bench')}.partial.json").write_text(json.dumps(res, indent=1))
    if args.llama_python and long_ids:
        model = str(resolve_model_path())
        for name, t in ((f"llama.cpp {x}", {"q4_0": 2, "f16": 1}[x]) for x in args.llama_kv):
            res["decode"][name] = {**llama_decode(args.llama_python, model, long_ids, n_dec, t,
                                                  torch.get_num_threads()), "load": load()}
            print(name, res["decode"][name], flush=True)
            (args.out / f"{result_name('kivi_bench')}.partial.json").write_text(json.dumps(res, indent=1))
    res["load_end"] = load()
    b = res["dtypes"].get("bf16")
    i4 = res["dtypes"].get("int4")
    dec = res["decode"]
    q40 = dec.get("llama.cpp q4_0", {}).get("decode_tok_s")
    L = str(lengths[-1])
    (args.out / f"{result_name('kivi_bench')}.partial.json").unlink(missing_ok=True)
    have = {"bf16", "int4"} <= set(res["dtypes"]) and "int4" in res["decode"] and "bf16" in res["decode"]
    res["targets"] = {} if args.quick or not have else {
        "int4 ppl within 2% of bf16": abs(i4["ppl"] / b["ppl"] - 1) <= 0.02,
        f"int4 passkey unchanged at {L}": i4["passkey"][L] >= b["passkey"][L],
        "int4 bytes/token <= 0.3x bf16": i4["bytes_per_token_vs_bf16"] <= 0.3,
        "int4 decode after long prompt faster than bf16": dec["int4"]["decode_tok_s"] > dec["bf16"]["decode_tok_s"],
        "int4 decode >= 1.3x llama.cpp q4_0": bool(q40) and dec["int4"]["decode_tok_s"] >= 1.3 * q40,
    }
    name = result_name("kivi_bench")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))
    md = [f"## kivi_bench: KV dtypes bf16 / int8 / int4 / int2 ({res['date']}, {res['cpu']}, {res['threads']} threads, "
          f"load {res['load_start']} -> {res['load_end']})", "", f"`{res['command']}`", "",
          f"| KV dtype | block | bytes/token | x bf16 | sessions of 2k per GiB | ppl @{ctx} | ppl / bf16 | "
          + " | ".join(f"passkey @{x}" for x in lengths) + " |",
          "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(lengths)]
    for d, r in res["dtypes"].items():
        md.append(f"| {d} | {r.get('block_size', 16)} | {r['bytes_per_token']:,} | {r['bytes_per_token_vs_bf16']:.3f} | {r['sessions_2k_per_gib']} | "
                  f"{r['ppl']:.3f} | {r['ppl'] / b['ppl'] if b else float('nan'):.4f} | "
                  + " | ".join(f"{r['passkey'].get(str(x), float('nan')):.2f}" for x in lengths) + " |")
    md += ["", f"Decode after a {len(long_ids or []):,}-token prompt ({n_dec} tokens, greedy, EOS ignored):", "",
           "| engine / KV | decode tok/s | load |", "|---|---:|---|"]
    for k, r in dec.items():
        md.append(f"| {k} | {r.get('decode_tok_s') or float('nan'):.1f} | {r['load']} |")
    md += ["", "Targets (issue 27):", ""] + [f"- {k}: {'met' if v else 'missed'}" for k, v in res["targets"].items()]
    (args.out / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
