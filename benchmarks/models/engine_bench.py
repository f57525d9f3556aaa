#!/usr/bin/env python
"""kvkeeper engine benchmark: roofline, weight formats, multi-turn TTFT, long context, batched and single-stream
decode, against peers (transformers, llama.cpp through llama-cpp-python on the same GGUF and thread count).

Sections (all measured in one run, on this machine, with the same SmolLM2-135M-Instruct GGUF; kvkeeper runs its
default weight format, ``--quantization`` picks another):

0. Weight formats (none = float32, gguf, int8, int4): bytes per weight, resident memory after load (a fresh
   process each), single-stream decode tok/s, perplexity at 4k tokens, greedy agreement with the float32 path.

1. Roofline of the machine: memory copy bandwidth, fp32 matmul FLOP/s, fp32 GEMV weight-streaming bandwidth,
   and the decode / prefill limits they imply for the model.  kvkeeper's numbers are reported as fractions.
2. Multi-turn TTFT: one conversation over MT-Bench first-turn questions.  kvkeeper reuses the conversation's KV
   across turns (Session); transformers re-prefills the same prompt token ids from scratch each turn;
   kvkeeper without reuse (isolated namespace) is the internal baseline; llama.cpp (llama-cpp-python) if installed.
3. Batched decode: N concurrent chat prompts, M new tokens each (EOS ignored).  kvkeeper vs transformers
   ``generate_batch`` (continuous batching) and padded ``generate``.
4. Single-stream decode: one prompt, K new tokens.  kvkeeper vs transformers ``generate`` (timed with a streamer)
   and llama.cpp (streamed).
5. Long context: a 7,000-token prompt (Pride and Prejudice), prefill and then 64 decoded tokens, vs llama.cpp.
2b. Short turns: a Topical-Chat conversation whose turns add 30-60 tokens; turn-10 TTFT vs llama.cpp's prefix reuse.

Every comparison is a measured ratio next to its target; nothing is hard-coded.

Usage::

    .venv/bin/python benchmarks/models/engine_bench.py            # full run (a quiet machine, a few minutes)
    .venv/bin/python benchmarks/models/engine_bench.py --quick    # tiny smoke run
    .venv/bin/python benchmarks/models/engine_bench.py --out DIR --threads 4
    .venv/bin/python benchmarks/models/engine_bench.py --quantization none   # the float32 engine instead of the default
    .venv/bin/python benchmarks/models/engine_bench.py --isa generic   # the kernels' portable path (ISA comparisons)

Writes ``DIR/engine_bench-<config>-<date>.json`` and ``.md`` (config: the model) and prints the markdown.

This file is the driver (its command line, the order of the sections, the output); each section is a module of
``benchmarks/models/engine/``: ``roofline``, ``formats``, ``multiturn`` (and the short turns), ``batched``, ``single``,
``long_context``; the peers in ``peers``, the markdown in ``report``.
"""


from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from engine.base import ROOT, BenchConfig, _err, log, machine_info
from engine.batched import bench_batched
from engine.formats import bench_formats
from engine.long_context import bench_long
from engine.multiturn import bench_multiturn, bench_multiturn_short
from engine.peers import load_llama_cpp, load_transformers
from engine.report import render_markdown
from engine.roofline import (_linear_rate, linear_shapes, measure_roofline, model_costs, roofline_decode_tok_s,
                             roofline_fractions)
from engine.single import bench_single
from kvkeeper import LLMEngine
from kvkeeper.progress import reporting, track


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (3 turns, small batch, short outputs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_bench"), help="output folder")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--model", default=None, help="model id or GGUF path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--quantization", default=None,
                    help="kvkeeper's weight format for sections 2-6 (default: the engine's default for the file)")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["roofline", "formats", "multiturn", "short", "batched", "single", "long", "transformers",
                             "llama_cpp"],
                    help="skip a section or a peer (repeatable)")
    ap.add_argument("--isa", default="auto", choices=["auto", "generic", "avx2", "avx512_vnni"],
                    help="the C++ kernels' instruction set (default: the best this CPU has; the others compare it)")
    ap.add_argument("--config", default=None, help="the run's config in the result's name (default: the model)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvkeeper.kernels import cpu as cpu_kernels

    mod = cpu_kernels.load()
    if mod is not None:
        mod.set_isa(args.isa)
        mod.kq_set_isa("avx512" if args.isa == "avx512_vnni" else args.isa)  # the GGUF K-quant kernels too
    bc = BenchConfig.make(args.quick)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    questions = [json.loads(line) for line in (ROOT / "data" / "mt_bench" / "question.jsonl").read_text().splitlines()
                 if line.strip()]
    R: dict = {"quick": bc.quick, "config": bc.__dict__, "machine": machine_info(), "errors": {},
               "kernels_isa": mod.isa() if mod is not None else None,
               "kquant_isa": mod.kq_isa() if mod is not None else None}
    t_start = time.perf_counter()

    log("loading kvkeeper engine")
    t0 = time.perf_counter()
    engine = LLMEngine(args.model, quantization=args.quantization)
    R["model"] = {"path": str(engine.model_path), "kvkeeper_load_s": time.perf_counter() - t0,
                  "weight_format": engine.runner.weight_format, "weights": engine.runner.weight_description,
                  "attention_backend": engine.runner.attention_backend,
                  "fused_decode": engine.runner.fused_decode is not None}
    mc = model_costs(engine)
    R["model_costs"] = mc

    if "roofline" not in args.skip:
        log("roofline measurements")
        try:
            roof = measure_roofline(bc, linear_shapes(engine.model_config))
            R["roofline"] = roof
            flop_s = _linear_rate(mc, roof)
            R["roofline_limits"] = {
                "decode_tok_s_ctx0": roofline_decode_tok_s(mc, roof, 1, 0),
                "prefill_tok_s_2xparams": flop_s / (2 * mc["params_total"]),
                "prefill_tok_s_matmul": flop_s / (2 * mc["params_per_prefill_token"]),
            }
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            R["errors"]["roofline"] = _err(e)

    if "formats" not in args.skip:
        log("weight formats: memory, speed, quality")
        try:
            R["formats"] = bench_formats(args.model, questions, bc, engine.runner.weight_format)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            R["errors"]["formats"] = _err(e)
        gc.collect()

    hf = None
    if "transformers" not in args.skip:
        log("loading transformers reference model")
        try:
            hf, R["model"]["transformers_load_s"] = load_transformers(engine)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            R["errors"]["transformers_load"] = _err(e)
    llm, llm_status = (None, "skipped (--skip llama_cpp)") if "llama_cpp" in args.skip else load_llama_cpp(engine)
    R["llama_cpp"] = llm_status

    # generate_batch may switch the transformers model's attention implementation: batched runs last
    sections = [("multiturn", "multiturn", lambda: bench_multiturn(engine, hf, llm, llm_status, questions, bc)),
                ("short", "multiturn_short", lambda: bench_multiturn_short(engine, hf, llm, llm_status, bc)),
                ("single", "single_stream", lambda: bench_single(engine, hf, questions[16], bc, llm)),
                ("long", "long_context", lambda: bench_long(engine, llm, llm_status, bc)),
                ("batched", "batched", lambda: bench_batched(engine, hf, questions, bc))]
    for _skip, key, fn in track([s for s in sections if s[0] not in args.skip], "engine_bench sections"):
        log(f"section {key}")
        try:
            R[key] = fn()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            R["errors"][key] = _err(e)
    if R.get("roofline"):
        R["roofline_fractions"] = roofline_fractions(mc, R["roofline"], R)
    try:
        R["machine"]["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    R["total_runtime_s"] = time.perf_counter() - t_start
    if not R["errors"]:
        del R["errors"]

    md = render_markdown(R)
    from common import result_path

    config = args.config or (Path(args.model).stem if args.model else "smollm2-135m")
    json_path, md_path = (result_path("engine_bench", config, suffix, out_dir) for suffix in (".json", ".md"))
    json_path.write_text(json.dumps(R, indent=2, default=str) + "\n")
    md_path.write_text(md)
    print(md)
    log(f"wrote {json_path} and {md_path} in {R['total_runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    with reporting():  # progress of the sections (and of a first model load) on stderr
        sys.exit(main())
