#!/usr/bin/env python
"""kvkeeper on a CUDA GPU: kernel correctness, decode-attention bandwidth, end-to-end decode, TTFT with reuse.

One run of a few minutes on one GPU, nothing downloaded (the 8B model is ``--load-format dummy``: random
weights of a shipped Llama-3.1-8B config, bf16):

1. ``kernels``: the Triton kernels (kvkeeper.attention.triton_backend) against the PyTorch reference
   (kvkeeper.attention.reference) on the GPU, Llama-8B head shapes (D 128), GQA 1/4/8, bf16/fp16/int8/fp8
   caches, decode (lengths 1 .. 32k, split-K) and prefill/extend; plus the block-table index broken on
   purpose, which must fail.
2. ``bandwidth``: device-to-device copy bandwidth (``torch`` copy of 1 GiB: bytes read + written per second)
   and decode attention over one layer of an 8B-shaped cache at several (batch, length): bytes of K/V
   (and scales) read per second, as a fraction of the copy bandwidth; the PyTorch reference path beside it.
3. ``decode``: kvkeeper's end-to-end steady-state decode throughput at batch 1, 16, 64, 256 (128-token
   random prompts, 128 new tokens, greedy, EOS ignored), with CUDA graphs and eager.  Throughput = tokens
   emitted while every request of the batch is decoding / that window.
4. ``ttft``: time to first token of a later turn after 8k and 32k tokens of history (64 new tokens), with
   prefix reuse (the history's blocks come from the prefix cache) and without (an isolated namespace:
   the whole history is prefilled again).
5. ``transformers``: the peer, last (so that kvkeeper's figures are written first): transformers'
   ``generate_batch`` (continuous batching) on a model of the same config (its own random weights), same
   prompts, same GPU, same throughput measure (from its per-token timestamps).

Usage::

    python benchmarks/models/gpu.py --out DIR                       # everything (a CUDA torch, triton, transformers)
    python benchmarks/models/gpu.py --sections kernels bandwidth    # a part
    python benchmarks/models/gpu.py --smoke-cpu --out /tmp/x        # tiny CPU run of the script's logic (interpreter)

Writes ``DIR/gpu-<config>-<date>.json`` and ``.md`` after every section (a run cut short keeps what
it measured).  Without a CUDA device it refuses (exit status 2) unless ``--smoke-cpu``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("kernels", "bandwidth", "decode", "ttft", "transformers")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"), help="output folder")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--config", default="llama-3.1-8b", help="dummy model config (shipped name or config.json)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--histories", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--kv-cache-gb", type=float, default=40.0, help="kvkeeper KV pool (GB)")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="tiny config on the CPU with Triton's interpreter: checks this script, measures nothing")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke_cpu:
    os.environ["TRITON_INTERPRET"] = "1"  # before kvkeeper.attention.triton_backend is imported

import torch  # noqa: E402

try:
    import kvkeeper  # noqa: F401
except ImportError:  # a checkout without an installed package
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import result_name, write_report  # noqa: E402

from kvkeeper import LLMEngine, SamplingParams  # noqa: E402
from kvkeeper.kvcache.formats.base import PagedKV, parse_kv_format  # noqa: E402
from kvkeeper.attention import reference as ref  # noqa: E402

GB = 1e9
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 300,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed_graph(fn, dev, iters: int = 20) -> float:
    """Like :func:`timed`, but replays fn captured in a CUDA graph (no launch overhead in the figure);
    falls back to :func:`timed` off CUDA or when capture fails."""
    if dev.type != "cuda":
        return timed(fn, dev, iters)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    except Exception as e:  # noqa: BLE001
        log(f"graph capture for timing failed ({e}); timing eagerly")
        return timed(fn, dev, iters)
    return timed(g.replay, dev, iters)


def timed(fn, dev, iters: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call of fn() (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


# ---- 1. kernels ------------------------------------------------------------------------------------


def make_step(seqs, H, KVH, D, bs, kv, dtype, dev, seed=0, extra_cols=0):
    """Random paged cache plus one step's q/k/v and metadata, twice (``kernel_check.random_step``)."""
    from kvkeeper.worker import kernel_check

    return kernel_check.random_step(seqs, H, KVH, D, bs, kv, dtype, dev, seed, extra_cols)


def section_kernels(dev, smoke: bool) -> dict:
    from kvkeeper.attention import triton_backend as tk

    D = 32 if smoke else 128
    scale = D**-0.5
    # tolerance on max |got - want| / max |want|: bf16 keeps 8 bits of mantissa, and the reference and the
    # kernel round probabilities and partial sums to the compute dtype at different points
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
    long_ = [(300, 1), (5, 1)] if smoke else [(32768, 1), (4097, 1), (1, 1), (17, 1)]
    ext = [(40, 9), (23, 23)] if smoke else [(4000, 300), (777, 777), (33, 1), (5000, 17)]
    cases = []
    for ratio in (1, 4, 8):
        for kv, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("int8", torch.bfloat16),
                       ("fp8_e4m3", torch.bfloat16), ("float32", torch.float32)):
            for kind, seqs in (("decode", long_), ("extend+mixed", ext)):
                cases.append((ratio, kv, dt, kind, seqs))
    rows = []
    for ratio, kv, dt, kind, seqs in cases:
        kvh = 1 if smoke else 8  # Llama-3-8B: 8 KV heads
        q, k, v, c_ref, c_tk, m_ref, m_tk = make_step(seqs, kvh * ratio, kvh, D, 16, kv, dt, dev)
        want = ref.paged_attention(q, k, v, c_ref, m_ref, scale)
        got = tk.triton_paged_attention(q, k, v, c_tk, m_tk, scale)
        sync(dev)
        err = (got.float() - want.float()).abs().max().item()
        rel = err / max(want.float().abs().max().item(), 1e-6)
        rows.append({"gqa": ratio, "kv": kv, "dtype": str(dt).removeprefix("torch."), "kind": kind,
                     "seqs": seqs, "max_abs_err": err, "rel_err": rel, "tol": tol[dt], "ok": rel < tol[dt]})
        log(f"kernels {kind} gqa={ratio} kv={kv}: max abs err {err:.2e}, relative {rel:.2e}")
    # broken on purpose: block-table index + 1 must be caught
    q, k, v, c_ref, c_tk, m_ref, m_tk = make_step([(300, 1), (70, 1)], 32 if not smoke else 4, 8 if not smoke else 1,
                                                  D, 16, "bfloat16", torch.bfloat16, dev, extra_cols=2)
    want = ref.paged_attention(q, k, v, c_ref, m_ref, scale)
    tk.store_kv(k, v, c_tk, m_tk.slot_mapping)
    bad = tk.decode_attention(q, c_tk, m_tk.decode_block_tables, m_tk.decode_context_lens, scale, max_len=300,
                              _bt_fault=1)
    bad_err = (bad.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
    return {"cases": rows, "all_ok": all(r["ok"] for r in rows), "broken_kernel_err": bad_err,
            "broken_kernel_caught": bad_err > tol[torch.bfloat16]}


# ---- 2. bandwidth ----------------------------------------------------------------------------------


def section_bandwidth(dev, smoke: bool) -> dict:
    from kvkeeper.attention import triton_backend as tk

    nbytes = (1 << 20) if smoke else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), dev, iters=3 if smoke else 20)
    copy_bw = 2 * nbytes / t  # read + write
    del src, dst
    log(f"copy bandwidth {copy_bw / GB:.0f} GB/s (read + write)")
    H, KVH, D, bs = (4, 1, 32, 16) if smoke else (32, 8, 128, 16)
    shapes = [(1, 256), (4, 64)] if smoke else [(1, 32768), (16, 8192), (64, 4096), (256, 1024), (256, 4096)]
    rows = []
    for kv in ("bfloat16", "int8"):
        fmt = parse_kv_format(kv)
        for B, L in shapes:
            nb = -(-L // bs)
            cache = PagedKV(B * nb + 1, bs, KVH, D, fmt, dev)
            if fmt.quantized:
                cache.k.random_(-100, 100)
                cache.v.random_(-100, 100)
                cache.k_scale.uniform_(0.001, 0.01)
                cache.v_scale.uniform_(0.001, 0.01)
            else:
                cache.k.normal_()
                cache.v.normal_()
            tables = torch.randperm(B * nb + 1, device=dev)[: B * nb].view(B, nb)
            lens = torch.full((B,), L, dtype=torch.int64, device=dev)
            q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16 if not smoke else torch.float32)
            splits = tk.choose_num_splits(B, KVH, L)
            t_k = timed_graph(lambda: tk.decode_attention(q, cache, tables, lens, D**-0.5, num_splits=splits), dev,
                        iters=2 if smoke else 30)
            meta = ref.AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=dev),
                                         decode_indices=torch.arange(B, device=dev), decode_block_tables=tables,
                                         decode_context_lens=lens)
            try:
                t_r = timed(lambda: ref._decode_attention(q, cache, meta, D**-0.5, bs), dev, iters=2 if smoke else 10)
            except torch.OutOfMemoryError:
                t_r = None
            elem = cache.k.element_size()
            moved = B * L * KVH * (2 * D * elem + (2 * 2 if fmt.quantized else 0))
            rows.append({"kv": kv, "batch": B, "len": L, "splits": splits, "bytes": moved, "kernel_s": t_k,
                         "kernel_GBps": moved / t_k / GB, "of_copy_bw": moved / t_k / copy_bw,
                         "reference_s": t_r, "speedup_vs_reference": None if t_r is None else t_r / t_k})
            log(f"decode attention {kv} B={B} L={L}: {moved / t_k / GB:.0f} GB/s ({moved / t_k / copy_bw:.0%} of copy)")
            del cache
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return {"copy_GBps": copy_bw / GB, "copy_bytes": nbytes, "decode": rows}


# ---- 3. end-to-end decode --------------------------------------------------------------------------


def window_throughput(stamps: list[list[float]]) -> dict:
    """Steady-state tok/s from per-request token timestamps: tokens emitted in (t_a, t_b], where t_a is
    the last request's first token and t_b the first request's last token, divided by t_b - t_a."""
    stamps = [s for s in stamps if len(s) >= 2]
    if not stamps:
        return {"tok_per_s": None, "window_s": 0.0, "tokens": 0}
    t_a = max(s[0] for s in stamps)
    t_b = min(s[-1] for s in stamps)
    n = sum(1 for s in stamps for x in s if t_a < x <= t_b)
    return {"tok_per_s": n / (t_b - t_a) if t_b > t_a and n else None, "window_s": t_b - t_a, "tokens": n}


def kvkeeper_decode(eng, prompts, new_tokens: int) -> dict:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    seqs = [eng.add_request(p, sp) for p in prompts]
    stamps = [[] for _ in seqs]
    seen = [len(s.token_ids) for s in seqs]
    t0 = time.perf_counter()
    while any(not s.finished for s in seqs):
        eng.step()
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            if len(s.token_ids) > seen[i]:
                stamps[i].append(now)
                seen[i] = len(s.token_ids)
    res = window_throughput(stamps)
    res["total_s"] = time.perf_counter() - t0
    res["generated"] = sum(len(s.output_token_ids) for s in seqs)
    return res


def transformers_decode(model, prompts, new_tokens: int, smoke: bool) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    try:
        import flash_attn  # noqa: F401
        flash = True
    except ImportError:
        flash = False  # never let transformers fetch a flash kernel from the hub
    gc_ = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=model.config.vocab_size - 1,
                           pad_token_id=0)
    cb = ContinuousBatchingConfig(auto_switch_to_flash=flash)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gc_, continuous_batching_config=cb,
                               record_timestamps=True, progress_bar=False)
    total = time.perf_counter() - t0
    stamps = [list(o.timestamps or []) for o in out.values()]
    res = window_throughput(stamps)
    res.update(total_s=total, generated=sum(len(o.generated_tokens) for o in out.values()),
               attn_implementation=model.config._attn_implementation, flash_attn_installed=flash,
               errors=[o.error for o in out.values() if o.error])
    return res


def make_engine(cfg_name, dev, dtype, kv_bytes, max_num_seqs, max_model_len, chunk):
    return LLMEngine(cfg_name, load_format="dummy", device=str(dev), dtype=dtype, kv_cache_bytes=kv_bytes,
                     max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=chunk,
                     block_size=16, attention_backend="triton", validate_every=0)


def decode_prompts(B: int, vocab: int, length: int) -> list[list[int]]:
    """The batch-B prompts (seeded by B: kvkeeper and transformers get the same token ids)."""
    g = torch.Generator().manual_seed(1000 + B)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(B)]


def section_decode(dev, args, cfg_name) -> dict:
    t0 = time.perf_counter()
    eng = make_engine(cfg_name, dev, args.dtype, int(args.kv_cache_gb * GB), max(args.batches),
                      args.prompt_len + args.new_tokens + 16, 1024 if args.smoke_cpu else 8192)
    load_s = time.perf_counter() - t0
    graphs = eng.runner.graphs
    log(f"kvkeeper engine ready in {load_s:.1f} s; graphs: {sorted(graphs.graphs) if graphs else None}")
    vocab = eng.model_config.vocab_size
    rows = []
    for B in args.batches:
        prompts = decode_prompts(B, vocab, args.prompt_len)
        row = {"batch": B}
        for mode, g in (("kvkeeper_graphs", graphs), ("kvkeeper_eager", None)):
            if mode == "kvkeeper_graphs" and graphs is None:
                row[mode] = None
                continue
            eng.runner.graphs = g
            try:
                kvkeeper_decode(eng, prompts, 4)  # warm-up: any kernel variant compiles outside the measurement
                row[mode] = kvkeeper_decode(eng, prompts, args.new_tokens)
            finally:
                eng.runner.graphs = graphs
        log(f"kvkeeper batch {B}: graphs {row['kvkeeper_graphs'] and row['kvkeeper_graphs']['tok_per_s']}, "
            f"eager {row['kvkeeper_eager']['tok_per_s']} tok/s")
        rows.append(row)
    res = {"load_s": load_s, "attention_backend": eng.runner.attention_backend,
           "kernel_check_error": eng.runner.kernel_check_error, "graph_sizes": sorted(graphs.graphs) if graphs else [],
           "graph_failures": dict(graphs.failed) if graphs else {}, "rows": rows}
    del eng, graphs
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def section_transformers(dev, args, cfg_name) -> dict:
    """transformers generate_batch on a model of the same config (its own random weights), same prompts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvkeeper.weights.dummy import resolve_config

    t0 = time.perf_counter()
    raw = {k: v for k, v in json.loads(resolve_config(cfg_name).read_text()).items() if not k.startswith("_")}
    hf_cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    model.eval()
    res = {"load_s": time.perf_counter() - t0, "rows": []}
    for B in args.batches:
        prompts = decode_prompts(B, hf_cfg.vocab_size, args.prompt_len)
        try:
            r = transformers_decode(model, prompts, args.new_tokens, args.smoke_cpu)
        except Exception as e:  # noqa: BLE001  (record and go on)
            r = {"error": f"{type(e).__name__}: {e}"}
        r["batch"] = B
        res["rows"].append(r)
        log(f"transformers batch {B}: {r.get('tok_per_s')} tok/s")
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ---- 4. TTFT with and without reuse ------------------------------------------------------------------


def section_ttft(dev, args, cfg_name) -> dict:
    g = torch.Generator().manual_seed(1)
    hist = [128, 300] if args.smoke_cpu else args.histories
    eng = make_engine(cfg_name, dev, args.dtype, int(args.kv_cache_gb * GB), 8, max(hist) + 256,
                      256 if args.smoke_cpu else 8192)
    vocab = eng.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    warm = torch.randint(0, vocab, (min(600, max(hist) // 2),), generator=g).tolist()
    eng.generate([warm], one)  # warm-up (kernel compiles)
    rows = []
    for n in hist:
        history = torch.randint(0, vocab, (n,), generator=g).tolist()
        first = eng.generate([history], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        turn = history + first.token_ids + torch.randint(0, vocab, (64,), generator=g).tolist()
        reuse = eng.generate([turn], one)[0]
        cold = eng.generate([turn], one, namespace=eng.isolated_namespace("ttft"))[0]
        rows.append({"history": n, "prompt_tokens": len(turn), "first_turn_ttft_s": first.ttft_s,
                     "reuse_ttft_s": reuse.ttft_s, "reuse_cached_tokens": reuse.cached_tokens,
                     "no_reuse_ttft_s": cold.ttft_s, "no_reuse_cached_tokens": cold.cached_tokens,
                     "speedup": cold.ttft_s / reuse.ttft_s if reuse.ttft_s else None})
        log(f"TTFT after {n} tokens: reuse {reuse.ttft_s:.3f} s ({reuse.cached_tokens} cached), "
            f"no reuse {cold.ttft_s:.3f} s")
    del eng
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "chunk_tokens": 8192}


# ---- report ------------------------------------------------------------------------------------------


def fmt(x, nd=1, pct=False):
    if x is None:
        return "n/a"
    return f"{x:.0%}" if pct else f"{x:,.{nd}f}"


def markdown(res: dict) -> str:
    e = res["env"]
    md = [f"# kvkeeper GPU benchmark ({res['date']})", "",
          f"{e['gpu']} ({e['gpu_memory_gb']:.0f} GB), torch {e['torch']} (CUDA {e['cuda']}), triton {e['triton']}, "
          f"transformers {e['transformers']}; model: `{res['config']}` dummy weights, {res['dtype']}.", ""]
    if res.get("smoke_cpu"):
        md += ["**Smoke run on the CPU (Triton interpreter, tiny config): the numbers below mean nothing.**", ""]
    k = res.get("kernels")
    if k and "error" not in k:
        md += ["## Kernel correctness (Triton vs PyTorch reference, on the device)", "",
               "| kind | GQA | KV dtype | compute dtype | max abs err | relative | tolerance (relative) | ok |",
               "|---|---|---|---|---|---|---|---|"]
        for r in k["cases"]:
            md.append(f"| {r['kind']} | {r['gqa']} | {r['kv']} | {r['dtype']} | {r['max_abs_err']:.2e} | {r['rel_err']:.2e} | "
                      f"{r['tol']:.0e} | "
                      f"{'yes' if r['ok'] else '**NO**'} |")
        md += ["", "Relative error: max |kernel - reference| / max |reference|.", "",
               f"Block-table index off by one (broken on purpose): relative error {k['broken_kernel_err']:.2e}, "
                   f"{'caught' if k['broken_kernel_caught'] else '**NOT caught**'}.", ""]
    b = res.get("bandwidth")
    if b and "error" not in b:
        md += ["## Decode attention bandwidth (one layer, 32 query / 8 KV heads, D 128, blocks of 16)", "",
               f"Device-to-device copy: **{b['copy_GBps']:,.0f} GB/s** (bytes read + written per second, 1 GiB).", "",
               "| KV dtype | batch | KV length | splits | K/V bytes read | kernel µs | GB/s | of copy bw | PyTorch ref µs | speed-up |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for r in b["decode"]:
            md.append(f"| {r['kv']} | {r['batch']} | {r['len']:,} | {r['splits']} | {r['bytes'] / 1e6:,.0f} MB | "
                      f"{r['kernel_s'] * 1e6:,.0f} | {r['kernel_GBps']:,.0f} | {fmt(r['of_copy_bw'], pct=True)} | "
                      f"{fmt(r['reference_s'] and r['reference_s'] * 1e6, 0)} | {fmt(r['speedup_vs_reference'])} |")
        md.append("")
    d = res.get("decode")
    if d and "error" not in d:
        md += ["## End-to-end decode throughput (tok/s, steady state)", "",
               f"Prompts of {res['prompt_len']} random tokens, {res['new_tokens']} new tokens each, greedy, EOS ignored. "
               f"kvkeeper attention backend `{d.get('attention_backend')}` (start-up kernel check: relative error "
               f"{format(d['kernel_check_error'], '.1e') if d.get('kernel_check_error') is not None else 'n/a'}); "
               f"CUDA graphs captured for {d['graph_sizes']}.", "",
               "| batch | kvkeeper (CUDA graphs) | kvkeeper (eager) | transformers generate_batch | kvkeeper / transformers |",
               "|---|---|---|---|---|"]
        tf_rows = {r["batch"]: r for r in (res.get("transformers") or {}).get("rows", [])}
        for r in d["rows"]:
            kg = (r.get("kvkeeper_graphs") or {}).get("tok_per_s")
            ke = (r.get("kvkeeper_eager") or {}).get("tok_per_s")
            tf = (tf_rows.get(r["batch"]) or {}).get("tok_per_s")
            best = kg or ke
            md.append(f"| {r['batch']} | {fmt(kg)} | {fmt(ke)} | {fmt(tf)} | "
                      f"{fmt(best / tf, 2) if best and tf else 'n/a'} |")
        tf_any = next(iter(tf_rows.values()), None)
        if tf_any:
            md += ["", f"transformers attention: `{tf_any.get('attn_implementation', tf_any.get('error'))}`."]
        md.append("")
    t = res.get("ttft")
    if t and "error" not in t:
        md += ["## TTFT of a later turn (history + 8 generated + 64 new tokens)", "",
               "| history tokens | with reuse (s) | cached tokens | without reuse (s) | speed-up |", "|---|---|---|---|---|"]
        for r in t["rows"]:
            md.append(f"| {r['history']:,} | {fmt(r['reuse_ttft_s'], 3)} | {r['reuse_cached_tokens']:,} | "
                      f"{fmt(r['no_reuse_ttft_s'], 3)} | {fmt(r['speedup'])} |")
        md.append("")
    for s in SECTIONS:
        if isinstance(res.get(s), dict) and "error" in res[s]:
            md += [f"**{s} failed:** `{res[s]['error']}`", ""]
    return "\n".join(md) + "\n"


def main() -> int:
    args = ARGS
    if not args.smoke_cpu and not torch.cuda.is_available():
        print(f"benchmarks/models/gpu.py needs a CUDA device, and torch {torch.__version__} sees none "
              f"(torch.version.cuda = {torch.version.cuda}). Run it on a machine with an NVIDIA GPU and a CUDA "
              "build of torch, or use --smoke-cpu to check the script itself.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("benchmarks/models/gpu.py needs the triton package (pip install triton) for kvkeeper's CUDA kernels",
              file=sys.stderr)
        return 2
    import transformers

    dev = torch.device("cpu" if args.smoke_cpu else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_name = args.config
    if args.smoke_cpu:
        cfg_name = str(Path(tempfile.mkdtemp()) / "config.json")
        Path(cfg_name).write_text(json.dumps(TINY))
        args.batches = [1, 3]
        args.config = "tiny smoke-test config"
        args.prompt_len, args.new_tokens, args.dtype, args.kv_cache_gb = 8, 4, "float32", 0.01
    # the result is named by the config: a shipped name, or a config.json file by its folder
    name = result_name("gpu", Path(args.config).parent.name if args.config.endswith(".json") else args.config)
    props = torch.cuda.get_device_properties(0) if dev.type == "cuda" else None
    res = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "config": args.config,
           "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "smoke_cpu": args.smoke_cpu,
           "env": {"gpu": props.name if props else "CPU (interpreter)",
                   "gpu_memory_gb": props.total_memory / GB if props else 0.0,
                   "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                   "transformers": transformers.__version__, "python": platform.python_version()}}
    torch.manual_seed(0)
    for name in args.sections:
        log(f"section {name}")
        t0 = time.perf_counter()
        try:
            if name == "kernels":
                res[name] = section_kernels(dev, args.smoke_cpu)
            elif name == "bandwidth":
                res[name] = section_bandwidth(dev, args.smoke_cpu)
            elif name == "decode":
                res[name] = section_decode(dev, args, cfg_name)
            elif name == "ttft":
                res[name] = section_ttft(dev, args, cfg_name)
            elif name == "transformers":
                res[name] = section_transformers(dev, args, cfg_name)
        except Exception as e:  # noqa: BLE001  (keep the other sections)
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res.setdefault("section_s", {})[name] = time.perf_counter() - t0
        write_report(out, name, res, markdown(res))
    ok = all("error" not in res.get(s, {}) for s in args.sections)
    k = res.get("kernels")
    if k and "error" not in k and not (k["all_ok"] and k["broken_kernel_caught"]):
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
