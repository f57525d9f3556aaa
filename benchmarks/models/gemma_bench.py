"""Gemma 3 270M at long context: the hybrid KV cache against an all-full one, and llama.cpp on the same file.

One sequence of ``--context`` tokens (Pride and Prejudice, tokenized by the model's tokenizer) is prefilled,
then ``--steps`` greedy tokens are decoded.  Reported per engine: KV bytes the sequence holds once prefilled
(kvkeeper: its blocks in the full-attention layers plus the window blocks it still holds in the sliding ones,
from the pool's bookkeeping; the KV tensors the pool allocated are reported too), prefill seconds and decode
tok/s (tokens after the first over the time between the first and the last).  kvkeeper runs the file's default
weight format (its Q4_K/Q5_0/Q6_K/Q8_0 blocks in place; until issue 24 the float32 weights dequantized at load, as
in the 2026-12-01 results) with a bf16 KV cache and the PyTorch attention path; llama.cpp
(llama-cpp-python, benchmark-only) runs the Q4_K_M blocks in place with its f16 KV cache (sliding layers sized
to the window, its default).

Each part is a separate process so that each exclusive hold of the CPU lock stays short:

    PYTHONPATH=src flock -x /work/.cpu.lock python benchmarks/models/gemma_bench.py --part hybrid
    PYTHONPATH=src flock -x /work/.cpu.lock python benchmarks/models/gemma_bench.py --part full
    PYTHONPATH=src flock -x /work/.cpu.lock python benchmarks/models/gemma_bench.py --part llamacpp

Each part merges its result into the latest ``results/gemma_bench/gemma_bench-gemma3-270m-<date>.json`` and writes today's
``.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import cpu_model, latest_result, result_name, write_report  # noqa: E402

CONFIG = "gemma3-270m"  # the config part of the result's name

from kvkeeper import LLMEngine, SamplingParams

BOOK = Path(__file__).resolve().parents[2] / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"


def context_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(BOOK.read_text(encoding="utf-8"))
    if len(ids) < n:
        raise SystemExit(f"the book gives {len(ids)} tokens, fewer than --context {n}")
    return ids[:n]


def held_kv_bytes(eng: LLMEngine, seq) -> int:
    """Bytes of KV the sequence's blocks hold: full layers per block, sliding layers per window block held."""
    r, cfg, bs = eng.runner, eng.model_config, eng.block_size
    per_layer_block = r.kv_format.bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim) * bs
    if not r.window_blocks:
        return len(seq.block_table) * cfg.num_layers * per_layer_block
    n_slide = sum(cfg.is_sliding_layer(i) for i in range(cfg.num_layers))
    windows = sum(eng.pool.window_id(b) is not None for b in seq.block_table)
    return len(seq.block_table) * (cfg.num_layers - n_slide) * per_layer_block + windows * n_slide * per_layer_block


@torch.inference_mode()
def run_kvkeeper(hybrid: bool, context: int, steps: int) -> dict:
    bs = 16
    eng = LLMEngine(model="gemma-3-270m", hybrid_kv_cache=hybrid, kv_dtype="bf16", block_size=bs,
                    num_kv_blocks=-(-(context + steps) // bs) + 8, max_num_seqs=1, max_num_batched_tokens=512,
                    num_threads=torch.get_num_threads())
    ids = context_ids(eng.tokenizer, context)
    seq = eng.add_request(ids, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    while not seq.output_token_ids:
        eng.step()
    t1 = time.perf_counter()
    held = held_kv_bytes(eng, seq)
    while not seq.finished:
        eng.step()
    t2 = time.perf_counter()
    return {"engine": "kvkeeper " + ("hybrid" if hybrid else "all-full"), "context": context, "steps": steps,
            "kv_bytes_held": held, "kv_bytes_per_token": held / context, "kv_pool_bytes_allocated":
            eng.runner.kv_cache_bytes, "window_blocks": eng.pool.window_blocks or 0, "blocks": eng.pool.num_blocks,
            "prefill_s": t1 - t0, "decode_tok_per_s": steps / (t2 - t1),
            "weights": eng.runner.weight_description, "kv_dtype": eng.runner.kv_format.name,
            "attention_backend": "torch (sliding layers), " + eng.runner.attention_backend + " (full layers)",
            "tokens": seq.output_token_ids}


def run_llama_cpp(context: int, steps: int) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    path = resolve_model_path("gemma-3-270m")
    ids = context_ids(load_tokenizer(path), context)
    n = torch.get_num_threads()
    llm = Llama(model_path=str(path), n_ctx=context + steps + 16, n_threads=n, n_threads_batch=n, verbose=False)
    ts = []
    t0 = time.perf_counter()
    toks = []
    for chunk in llm.create_completion(prompt=ids, max_tokens=steps + 1, temperature=0.0, stream=True):
        ts.append(time.perf_counter())
        toks.append(chunk["choices"][0]["text"])
    state = llama_cpp.llama_state_get_size(llm.ctx)
    return {"engine": "llama.cpp", "context": context, "steps": steps, "prefill_s": ts[0] - t0,
            "decode_tok_per_s": (len(ts) - 1) / (ts[-1] - ts[0]), "state_bytes": int(state),
            "note": f"llama-cpp-python {llama_cpp.__version__}, {n} threads, Q4_K_M in place, f16 KV; state_bytes = "
                    "llama_state_get_size after the run (its KV cells in use plus the logits buffer)",
            "text": "".join(toks)}


def report(res: dict) -> str:
    rows = [res[k] for k in ("hybrid", "full", "llamacpp") if k in res]
    md = [f"# gemma_bench: Gemma 3 270M, {rows[0]['context'] if rows else '?'}-token context\n",
          f"Machine: {res.get('cpu', '?')}, {res.get('threads', '?')} threads; see benchmarks/models/gemma_bench.py.\n",
          "| engine | KV bytes held at context | KV bytes / token | prefill s | decode tok/s |", "|---|---|---|---|---|"]
    for r in rows:
        held = r.get("kv_bytes_held", r.get("state_bytes"))
        md.append(f"| {r['engine']} | {held:,} | {held / r['context']:,.0f} | {r['prefill_s']:.1f} | "
                  f"{r['decode_tok_per_s']:.2f} |")
    if "hybrid" in res and "full" in res:
        h, f = res["hybrid"], res["full"]
        md.append(f"\nHybrid / all-full KV bytes: {h['kv_bytes_held'] / f['kv_bytes_held']:.3f}; pool tensors "
                  f"allocated {h['kv_pool_bytes_allocated']:,} vs {f['kv_pool_bytes_allocated']:,} bytes; same greedy "
                  f"tokens: {h['tokens'] == f['tokens']}.")
    if "llamacpp" in res:
        md.append(f"\nllama.cpp: {res['llamacpp']['note']}.")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["hybrid", "full", "llamacpp"], required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "gemma_bench"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    path = latest_result("gemma_bench", CONFIG, out=out)  # the parts run one at a time: merge into the last run's
    res = json.loads(path.read_text()) if path else {}
    if a.part == "llamacpp":
        res[a.part] = run_llama_cpp(a.context, a.steps)
    else:
        res[a.part] = run_kvkeeper(a.part == "hybrid", a.context, a.steps)
    res.update(cpu=cpu_model(), threads=a.threads, load_1min_at_end=os.getloadavg()[0])
    write_report(out, result_name("gemma_bench", CONFIG), res, report(res))


if __name__ == "__main__":
    main()
