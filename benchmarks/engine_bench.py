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

    .venv/bin/python benchmarks/engine_bench.py            # full run (a quiet machine, a few minutes)
    .venv/bin/python benchmarks/engine_bench.py --quick    # tiny smoke run
    .venv/bin/python benchmarks/engine_bench.py --out DIR --threads 4
    .venv/bin/python benchmarks/engine_bench.py --quantization none   # the float32 engine instead of the default

Writes ``DIR/engine_bench.json`` and ``DIR/engine_bench.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
try:
    import kvkeeper  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(ROOT / "src"))

from kvkeeper import LLMEngine, SamplingParams, SessionManager  # noqa: E402
from kvkeeper.progress import reporting, track  # noqa: E402

GB = 1e9

# Targets (kvkeeper / peer), stated in the report next to the measured ratio.
TARGET_MULTITURN_LAST_TURN = 20.0   # transformers TTFT / kvkeeper TTFT at the last (10th) turn
TARGET_BATCHED_VS_GENERATE_BATCH = 2.0  # kvkeeper total tok/s / transformers generate_batch tok/s
TARGET_SINGLE_STREAM = 1.5          # kvkeeper decode tok/s / transformers generate decode tok/s
# against llama.cpp on the same GGUF (issue 11)
TARGET_DECODE_VS_LLAMA = 1.0        # kvkeeper decode tok/s / llama.cpp decode tok/s (short prompt; after 7k tokens)
TARGET_PREFILL_VS_LLAMA = 1.5       # llama.cpp prefill time / kvkeeper prefill time, 7k-token prompt
TARGET_TTFT_VS_LLAMA = 0.5          # kvkeeper TTFT / llama.cpp TTFT at turn 10 (at most)
TARGET_BATCHED_TOK_S = 300.0        # kvkeeper total tok/s, 16 streams x 64 tokens (at least)
TARGET_PPL_REL = 0.01               # |ppl(format) / ppl(none) - 1| at 4k tokens, default format
TARGET_AGREEMENT = 0.99             # per-position top-1 agreement with the float32 path, default format


@dataclass
class BenchConfig:
    quick: bool
    turns: int
    reply_tokens: int
    batch: int
    batch_new_tokens: int
    single_new_tokens: int
    copy_mib: int
    mm_n: int
    mm_reps: int
    copy_reps: int
    gemv_reps: int
    long_prompt_tokens: int = 7000
    long_new_tokens: int = 64
    short_turns: int = 10
    short_reply_tokens: int = 24
    ppl_context: int = 4096
    agree_prompts: int = 24
    agree_tokens: int = 64

    @classmethod
    def make(cls, quick: bool) -> "BenchConfig":
        if quick:
            return cls(True, turns=3, reply_tokens=32, batch=4, batch_new_tokens=16, single_new_tokens=16,
                       copy_mib=128, mm_n=1024, mm_reps=3, copy_reps=3, gemv_reps=2, long_prompt_tokens=600,
                       long_new_tokens=8, short_turns=3, ppl_context=512, agree_prompts=4, agree_tokens=16)
        return cls(False, turns=10, reply_tokens=160, batch=16, batch_new_tokens=64, single_new_tokens=128,
                   copy_mib=512, mm_n=2048, mm_reps=10, copy_reps=10, gemv_reps=10)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:2000]


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


# --------------------------------------------------------------------------------------------------
# machine
# --------------------------------------------------------------------------------------------------
def machine_info() -> dict:
    from common import cpu_model

    cpu = cpu_model()
    import transformers

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "os_cpu_count": os.cpu_count(),
        "sched_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": load,
        "torch_blas": next((part.split("=", 1)[1] for part in torch.__config__.show().replace(",", " ").split()
                            if part.startswith("BLAS_INFO=")), None),
    }


# --------------------------------------------------------------------------------------------------
# 1. roofline
# --------------------------------------------------------------------------------------------------
def _best_and_median(fn, reps: int) -> tuple[float, float]:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every matrix a decode step multiplies by, as kvkeeper lays them out (fused qkv, gate_up)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = [(q + 2 * kv, H), (H, q), (2 * I, H), (H, I)]
    return per_layer * cfg.num_layers + [(cfg.vocab_size, H)]


def measure_roofline(bc: BenchConfig, shapes: list[tuple[int, int]]) -> dict:
    res: dict = {}
    # memory copy: buffers written first, read + write bytes counted
    n = bc.copy_mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    best, med = _best_and_median(lambda: dst.copy_(src), bc.copy_reps)
    res["copy"] = {"buffer_mib": bc.copy_mib, "reps": bc.copy_reps, "best_s": best, "median_s": med,
                   "gb_per_s": 2 * n * 4 / best / GB, "gb_per_s_median": 2 * n * 4 / med / GB}
    del src, dst
    # memory read bandwidth: a sum over a buffer far larger than the caches (read only)
    buf = torch.ones(n, dtype=torch.float32)
    best, med = _best_and_median(lambda: buf.sum(), bc.copy_reps)
    res["read"] = {"buffer_mib": bc.copy_mib, "reps": bc.copy_reps, "best_s": best, "median_s": med,
                   "gb_per_s": n * 4 / best / GB, "gb_per_s_median": n * 4 / med / GB}
    del buf
    res["qmm"] = qmm_rate(bc)
    # fp32 matmul
    m = bc.mm_n
    a, b = torch.randn(m, m), torch.randn(m, m)
    c = torch.empty(m, m)
    best, med = _best_and_median(lambda: torch.mm(a, b, out=c), bc.mm_reps)
    res["matmul"] = {"n": m, "reps": bc.mm_reps, "best_s": best, "median_s": med,
                     "gflop_per_s": 2 * m**3 / best / 1e9, "gflop_per_s_median": 2 * m**3 / med / 1e9}
    del a, b, c
    # GEMV weight streaming: x(1, in) @ W.T over distinct matrices shaped like the model's (~its fp32 size)
    ws = [torch.empty(o, i, dtype=torch.float32).uniform_(-0.05, 0.05) for o, i in shapes]
    xs = {i: torch.randn(1, i) for _, i in shapes}
    total = sum(w.numel() * 4 for w in ws)

    def gemv_pass():
        for w in ws:
            F.linear(xs[w.shape[1]], w)

    with torch.inference_mode():
        best, med = _best_and_median(gemv_pass, bc.gemv_reps)
    res["gemv"] = {"matrices": len(ws), "bytes": total, "reps": bc.gemv_reps, "best_s": best, "median_s": med,
                   "gb_per_s": total / best / GB, "gb_per_s_median": total / med / GB}
    del ws, xs
    res["small_m_probe"] = small_m_probe()
    gc.collect()
    return res


def qmm_rate(bc: BenchConfig) -> dict | None:
    """Throughput of kvkeeper's block matmul (the gguf / int8 / int4 kernel): 512 x 576 @ (3072 x 576 int4)^T."""
    try:
        from kvkeeper.kernels import cpu as cpu_kernels
        from kvkeeper.layers import quantized
        from kvkeeper.weights import formats as qw
    except ImportError:
        return None
    mod = cpu_kernels.load()
    if mod is None:
        return {"error": cpu_kernels.unavailable_reason()}
    w = torch.randn(3072, 576) * 0.05
    pw = quantized.pack_numpy(*qw.quantize_rtn(w, "int4"), kind="int4")
    x = torch.randn(512, 576)
    best, med = _best_and_median(lambda: mod.qmm(x, pw.qs, pw.sc, 4, 3072), bc.mm_reps)
    ops = 2 * 512 * 576 * 3072
    return {"shape": "512x576 @ (3072x576 int4)^T", "reps": bc.mm_reps, "best_s": best, "median_s": med,
            "gop_per_s": ops / best / 1e9, "gop_per_s_median": ops / med / 1e9, "isa": mod.isa()}


def small_m_probe() -> dict:
    """A 4-row fp32 matmul (4x576 @ 576x3072), timed on the main thread and on a helper thread.

    On a busy machine (more runnable threads than cores) OpenMP-parallel GEMMs on the main thread stall on
    descheduled workers, while MKL runs the same call single-threaded from a non-main thread; a large
    main/helper ratio flags that condition (decode of M >= 2 rows is then far slower than the roofline)."""
    import threading

    w = torch.empty(3072, 576).uniform_(-0.05, 0.05)
    x = torch.randn(4, 576)

    def per_call_ms():
        F.linear(x, w)
        t0 = time.perf_counter()
        for _ in range(20):
            F.linear(x, w)
        return (time.perf_counter() - t0) / 20 * 1e3

    out = {"main_thread_ms": per_call_ms()}
    th = threading.Thread(target=lambda: out.__setitem__("helper_thread_ms", per_call_ms()))
    th.start()
    th.join()
    out["main_over_helper"] = out["main_thread_ms"] / out["helper_thread_ms"]
    return out


def _packed_weights(model) -> list:
    seen = {}
    for mod in model.modules():
        pw = getattr(mod, "packed", None)
        if pw is not None and hasattr(pw, "qs"):
            seen[id(pw)] = pw
    return list(seen.values())


def model_costs(engine: LLMEngine) -> dict:
    cfg = engine.model_config
    model = engine.runner.model
    elt = engine.runner.dtype.itemsize if hasattr(engine.runner.dtype, "itemsize") else 4
    packed = _packed_weights(model)
    params_total = sum(p.numel() for p in model.parameters()) + sum(pw.n * pw.k for pw in packed)
    bytes_total = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(pw.nbytes for pw in packed)
    embed = cfg.vocab_size * cfg.hidden_size
    emb = model.model.embed_tokens
    embed_bytes = emb.packed.nbytes if hasattr(emb, "packed") else embed * elt
    # decode reads every weight once per step; the embedding table only one row, unless it doubles as lm_head
    decode_params = params_total - (0 if cfg.tie_word_embeddings else embed)
    decode_bytes = bytes_total - (0 if cfg.tie_word_embeddings else embed_bytes)
    # prefill multiplies every prompt token by all matrices except the embedding / lm_head
    # (logits are computed for the last token only)
    params_matmul = params_total - embed - (0 if cfg.tie_word_embeddings else embed)
    return {
        "params_total": params_total,
        "params_per_prefill_token": params_matmul,
        "lm_head_params": embed,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype_bytes": elt,
        "weight_format": engine.runner.weight_format,
        "decode_params": decode_params,
        "weight_bytes_per_decode_step": decode_bytes,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "num_layers": cfg.num_layers,
        "q_width": cfg.num_heads * cfg.head_dim,
    }


def prefill_flops(mc: dict, n_new: int, n_ctx: int) -> float:
    """FLOPs of prefilling n_new tokens after n_ctx cached ones: matmuls, causal attention, one lm_head row."""
    lin = 2.0 * mc["params_per_prefill_token"] * n_new + 2.0 * mc["lm_head_params"]
    pairs = n_new * n_ctx + n_new * (n_new + 1) / 2  # (query, key) pairs
    attn = 4.0 * mc["q_width"] * pairs * mc["num_layers"]  # QK^T and PV
    return lin + attn


def _linear_rate(mc: dict, roof: dict) -> float:
    """Ops/s of the projections: the block kernel's for packed formats, fp32 matmul's otherwise."""
    q = roof.get("qmm") or {}
    if mc.get("weight_format", "none") != "none" and q.get("gop_per_s"):
        return q["gop_per_s"] * 1e9
    return roof["matmul"]["gflop_per_s"] * 1e9


def _stream_bw(roof: dict) -> float:
    """Bytes/s for streaming weights and KV: the memory read bandwidth (or fp32 GEMV's when higher)."""
    return max(roof.get("read", {}).get("gb_per_s", 0.0), roof["gemv"]["gb_per_s"]) * GB


def roofline_prefill_s(mc: dict, roof: dict, n_new: int, n_ctx: int) -> float:
    """Lower bound on the time to prefill: max(compute (projections at the linear kernel's rate, attention at fp32
    matmul FLOP/s), one pass over the weights and KV at the read bandwidth)."""
    flop_s = roof["matmul"]["gflop_per_s"] * 1e9
    lin = 2.0 * mc["params_per_prefill_token"] * n_new + 2.0 * mc["lm_head_params"]
    attn = prefill_flops(mc, n_new, n_ctx) - lin
    kv_bytes = mc["kv_bytes_per_token"] * (n_ctx + n_new)
    return max(lin / _linear_rate(mc, roof) + attn / flop_s,
               (mc["weight_bytes_per_decode_step"] + kv_bytes) / _stream_bw(roof))


def roofline_decode_tok_s(mc: dict, roof: dict, streams: int, ctx: int) -> float:
    """Upper bound on decode tokens/s for `streams` sequences of about `ctx` tokens each."""
    flop_s = _linear_rate(mc, roof)
    bw = _stream_bw(roof)
    bytes_step = mc["weight_bytes_per_decode_step"] + streams * ctx * mc["kv_bytes_per_token"]
    flops_step = streams * (2.0 * mc["params_total"] + 4.0 * mc["q_width"] * ctx * mc["num_layers"])
    return streams / max(bytes_step / bw, flops_step / flop_s)


# --------------------------------------------------------------------------------------------------
# peers
# --------------------------------------------------------------------------------------------------
def load_transformers(engine: LLMEngine):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    p = engine.model_path
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    return model, time.perf_counter() - t0


LLAMA_N_CTX = 8192


def load_llama_cpp(engine: LLMEngine):
    """(Llama or None, status string).  Never installs anything (``make bench-llamacpp`` does)."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError as e:
        return None, f"not installed (llama-cpp-python not importable: {e}; run make bench-llamacpp)"
    try:
        n = torch.get_num_threads()
        llm = Llama(model_path=str(engine.model_path), n_ctx=LLAMA_N_CTX, verbose=False, n_threads=n,
                    n_threads_batch=n)
        return llm, (f"llama-cpp-python {llama_cpp.__version__}, n_ctx {LLAMA_N_CTX}, {n} threads, n_batch "
                     f"{llm.n_batch}, same GGUF file, greedy")
    except Exception as e:  # noqa: BLE001
        return None, f"load failed: {_err(e)}"


def llama_cpp_stream(llm, ids: list[int], n: int) -> dict:
    """One streamed greedy completion from a fresh context (no prefix reuse): first-token time (the prefill)
    and decode tok/s = (n-1) / (t_last - t_first), as kvkeeper's."""
    llm.reset()
    ts = []
    t0 = time.perf_counter()
    for _ in llm.create_completion(prompt=list(ids), max_tokens=n, temperature=0.0, stream=True):
        ts.append(time.perf_counter())
    dec = (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else None
    return {"ttft_s": ts[0] - t0 if ts else None, "decode_tok_per_s": dec, "tokens": len(ts),
            "wall_s": time.perf_counter() - t0}


def hf_generate(model, ids: list[int], max_new: int, min_new: int | None = None, streamer=None):
    x = torch.tensor([ids])
    kw = {"min_new_tokens": min_new} if min_new else {}
    with torch.inference_mode():
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=2, streamer=streamer, **kw)


class TimingStreamer:
    """transformers streamer that timestamps each new token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value):
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(now)
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())

    def end(self):
        pass


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------------------------------
# 2. multi-turn TTFT
# --------------------------------------------------------------------------------------------------
def sessions_of(engine: LLMEngine) -> SessionManager:
    """The engine's session manager (made on first use)."""
    return next((h for h in engine.holders if isinstance(h, SessionManager)), None) or SessionManager(engine)


def bench_multiturn(engine: LLMEngine, hf, llm, llm_status: str, questions: list[dict], bc: BenchConfig,
                    user_turns: list[str] | None = None, reply_tokens: int | None = None,
                    source: str | None = None) -> dict:
    """Turn-by-turn TTFT of one conversation (default: MT-Bench first turns, replies of bc.reply_tokens)."""
    if user_turns is None:
        user_turns = [q["turns"][0] for q in questions[: bc.turns]]
        source = ("data/mt_bench/question.jsonl, first-turn questions "
                  f"{[q['question_id'] for q in questions[: bc.turns]]}")
    reply_tokens = reply_tokens or bc.reply_tokens
    # warm-up of the engine's kernels (isolated namespace: nothing cached for the session)
    engine.generate([engine.encode_chat([{"role": "user", "content": "Hello there!"}])],
                    SamplingParams(max_tokens=8), namespace=engine.isolated_namespace("warm"))
    sess = sessions_of(engine).open(params=SamplingParams(max_tokens=reply_tokens))
    rows = []
    log(f"multi-turn: kvkeeper session, {len(user_turns)} turns")
    for q in user_turns:
        r = sess.send(q)
        rows.append({"turn": r.turn, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                     "new_tokens": r.prompt_tokens - r.cached_tokens, "kvkeeper_ttft_s": r.ttft_s,
                     "reply_tokens": r.completion_tokens, "finish_reason": r.finish_reason,
                     "kvkeeper_first_token": r.token_ids[0] if r.token_ids else None,
                     "_prompt_ids": list(r.prompt_token_ids), "_reply_ids": list(r.token_ids)})
    sess.close()

    log("multi-turn: kvkeeper without reuse")
    for row in rows:
        ids = row["_prompt_ids"]
        engine.generate([ids], SamplingParams(max_tokens=1), namespace=engine.isolated_namespace("noreuse-warm"))
        o = engine.generate([ids], SamplingParams(max_tokens=1), namespace=engine.isolated_namespace("noreuse"))[0]
        row["noreuse_ttft_s"] = o.ttft_s
        row["noreuse_cached_tokens"] = o.cached_tokens
        row["noreuse_first_token"] = o.token_ids[0] if o.token_ids else None

    log("multi-turn: transformers re-prefill")
    for row in rows:
        ids = row["_prompt_ids"]
        if hf is None:
            row["transformers_ttft_s"] = None
            continue
        hf_generate(hf, ids, 1)  # warm-up on the same prompt
        t0 = time.perf_counter()
        out = hf_generate(hf, ids, 1)
        row["transformers_ttft_s"] = time.perf_counter() - t0
        row["transformers_first_token"] = int(out[0, len(ids)])

    llama_rows_status = llm_status
    if llm is not None:
        log("multi-turn: llama.cpp with its own prefix reuse")
        try:
            llm.reset()
            for row in rows:
                ids = row["_prompt_ids"]
                t0 = time.perf_counter()
                llm.create_completion(prompt=ids, max_tokens=1, temperature=0.0)
                row["llama_cpp_ttft_s"] = time.perf_counter() - t0
                # bring its cache to prompt + reply, as a chat server holding the slot would (untimed)
                llm.create_completion(prompt=ids + row["_reply_ids"], max_tokens=1, temperature=0.0)
        except Exception as e:  # noqa: BLE001
            llama_rows_status = f"failed: {_err(e)}"
            traceback.print_exc()

    for row in rows:
        row["ratio_transformers_over_kvkeeper"] = _ratio(row.get("transformers_ttft_s"), row["kvkeeper_ttft_s"])
        row["ratio_noreuse_over_kvkeeper"] = _ratio(row.get("noreuse_ttft_s"), row["kvkeeper_ttft_s"])
        row["ratio_llama_cpp_over_kvkeeper"] = _ratio(row.get("llama_cpp_ttft_s"), row["kvkeeper_ttft_s"])
        ft = [row.get(k) for k in ("kvkeeper_first_token", "noreuse_first_token", "transformers_first_token")]
        row["first_token_agrees"] = len({t for t in ft if t is not None}) <= 1
        row.pop("_prompt_ids"), row.pop("_reply_ids")
    last = rows[-1]
    ratio = last["ratio_transformers_over_kvkeeper"]
    vs_llama = _ratio(last["kvkeeper_ttft_s"], last.get("llama_cpp_ttft_s"))
    note = "target defined for turn 10 of the full run" if bc.quick else ""
    return {
        "user_turns_from": source,
        "reply_max_tokens": reply_tokens,
        "llama_cpp": llama_rows_status,
        "turns": rows,
        "new_tokens_per_turn_after_1": [r["new_tokens"] for r in rows[1:]],
        "target": {"metric": f"transformers TTFT / kvkeeper TTFT at turn {last['turn']}",
                   "target": TARGET_MULTITURN_LAST_TURN, "measured": ratio,
                   "met": None if ratio is None else ratio >= TARGET_MULTITURN_LAST_TURN, "note": note},
        "target_llama_cpp": {"metric": f"kvkeeper TTFT / llama.cpp TTFT (its prefix reuse) at turn {last['turn']}",
                             "target": TARGET_TTFT_VS_LLAMA, "op": "<=", "measured": vs_llama,
                             "met": None if vs_llama is None else vs_llama <= TARGET_TTFT_VS_LLAMA, "note": note},
        "first_token_agrees_all_turns": all(r["first_token_agrees"] for r in rows),
    }


def topical_chat_turns(n: int) -> tuple[list[str], str]:
    """The first n messages of agent_1 in the first Topical-Chat conversation (short chat turns)."""
    path = ROOT / "data" / "topical_chat" / "test_freq_conversations_first20.jsonl"
    conv = json.loads(path.read_text().splitlines()[0])
    msgs = [t["text"] for t in conv["turns"] if t["speaker"] == "agent_1"][:n]
    return msgs, f"{path.relative_to(ROOT)}, conversation {conv['id']}, agent_1's first {len(msgs)} messages"


def bench_multiturn_short(engine: LLMEngine, hf, llm, llm_status: str, bc: BenchConfig) -> dict:
    """Short turns: each adds the previous short reply plus a one-line message (about 30-60 tokens)."""
    msgs, source = topical_chat_turns(bc.short_turns)
    log(f"short turns: {len(msgs)} Topical-Chat messages, replies of at most {bc.short_reply_tokens} tokens")
    return bench_multiturn(engine, hf, llm, llm_status, [], bc, user_turns=msgs, reply_tokens=bc.short_reply_tokens,
                           source=source)


# --------------------------------------------------------------------------------------------------
# 3. batched decode
# --------------------------------------------------------------------------------------------------
def kvkeeper_batched(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict:
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True),
                    namespace=engine.isolated_namespace("warm"))
    ns = engine.isolated_namespace("batched")
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    # same as engine.generate (add_request + step until done), stepping by hand to see when prefill ends
    seqs = [engine.add_request(p, sp, namespace=ns) for p in prompts]
    t_all_first, tok_at = None, 0
    while any(not s.finished for s in seqs):
        engine.step()
        if t_all_first is None and all(s.t_first_token is not None for s in seqs):
            t_all_first = time.perf_counter()
            tok_at = sum(s.num_output_tokens for s in seqs)
    t1 = time.perf_counter()
    total = sum(s.num_output_tokens for s in seqs)
    dec_t = t1 - t_all_first if t_all_first else None
    return {
        "wall_s": t1 - t0, "tokens": total, "tok_per_s": total / (t1 - t0),
        "prefill_phase_s": (t_all_first - t0) if t_all_first else None,
        "decode_only_tok_per_s": (total - tok_at) / dec_t if dec_t else None,
        "steps": engine.num_steps - steps0,
        "all_exact_length": all(s.num_output_tokens == new_tokens for s in seqs),
        "_outputs": [list(s.output_token_ids) for s in seqs],
    }


def hf_padded_generate(hf, prompts: list[list[int]], new_tokens: int) -> dict:
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])

    def run(n):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=2)

    run(2)  # warm-up
    t0 = time.perf_counter()
    run(1)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = run(new_tokens)
    wall = time.perf_counter() - t0
    gen = out[:, L:]
    total = gen.numel()
    dec = wall - t_prefill
    return {"wall_s": wall, "tokens": total, "tok_per_s": total / wall, "prefill_s (max_new_tokens=1)": t_prefill,
            "decode_only_tok_per_s": len(prompts) * (new_tokens - 1) / dec if dec > 0 else None,
            "padded_len": L, "all_exact_length": gen.shape[1] == new_tokens,
            "_outputs": gen.tolist()}


def hf_generate_batch(hf, prompts: list[list[int]], new_tokens: int, kv_budget_bytes: int, kv_bytes_per_token: int,
                      max_batch_tokens: int) -> dict:
    """transformers continuous batching.  Its KV cache is sized like kvkeeper's (same byte budget, same per-step
    token budget): left to its defaults on CPU it takes 60% of the machine's RAM (psutil) for the cache."""
    from transformers import GenerationConfig

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

    res: dict = {"signature": f"generate_batch{inspect.signature(hf.generate_batch)}"}
    # eos_token_id=-1 disables EOS in continuous batching, so every request makes exactly new_tokens tokens
    gc_ = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=2)
    gc_warm = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=2)
    page = ContinuousBatchingConfig().page_size  # tokens per block (all layers)
    num_blocks = max(len(prompts), kv_budget_bytes // (page * kv_bytes_per_token))
    label = (f"ContinuousBatchingConfig(num_blocks={num_blocks}, max_batch_tokens={max_batch_tokens}), "
             f"page_size={page}: {num_blocks * page * kv_bytes_per_token / 2**30:.2f} GiB KV, as kvkeeper's budget")

    def cbc():
        return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)

    try:
        hf.generate_batch(prompts[:2], generation_config=gc_warm, continuous_batching_config=cbc())
        t0 = time.perf_counter()
        out = hf.generate_batch(prompts, generation_config=gc_, continuous_batching_config=cbc(),
                                record_timestamps=True)
        wall = time.perf_counter() - t0
        outs = list(out.values())
        if len(outs) != len(prompts) or any(o.error for o in outs):
            errs = [o.error for o in outs if o.error]
            raise RuntimeError(f"{len(outs)}/{len(prompts)} results; errors: {errs[:2]}")
        total = sum(len(o.generated_tokens) for o in outs)
        res.update({"config": label, "wall_s": wall, "tokens": total, "tok_per_s": total / wall,
                    "all_exact_length": all(len(o.generated_tokens) == new_tokens for o in outs),
                    "_outputs": [list(o.generated_tokens) for o in outs]})
        stamps = [o.timestamps for o in outs if o.timestamps]
        if len(stamps) == len(outs):
            t_all_first = max(s[0] for s in stamps)
            t_end = max(s[-1] for s in stamps)
            after = sum(1 for s in stamps for t in s if t > t_all_first)
            res["decode_only_tok_per_s"] = after / (t_end - t_all_first) if t_end > t_all_first else None
            res["prefill_phase_s"] = t_all_first - min(o.created_time for o in outs)
            res["after_last_token_s"] = t0 + wall - t_end  # manager shutdown etc., inside the wall time
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res.update({"config": label, "failed": True, "errors": [_err(e)]})
    return res


def bench_batched(engine: LLMEngine, hf, questions: list[dict], bc: BenchConfig) -> dict:
    prompts = [engine.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in questions[: bc.batch]]
    M = bc.batch_new_tokens
    log(f"batched: kvkeeper, {len(prompts)} requests x {M} tokens")
    kv = kvkeeper_batched(engine, prompts, M)
    res = {"requests": len(prompts), "new_tokens_each": M, "prompt_tokens": [len(p) for p in prompts],
           "prompts_from": f"MT-Bench first turns {[q['question_id'] for q in questions[: bc.batch]]}, chat template",
           "kvkeeper": kv, "transformers_generate_padded": None, "transformers_generate_batch": None}
    if hf is not None:
        log("batched: transformers padded generate")
        try:
            res["transformers_generate_padded"] = hf_padded_generate(hf, prompts, M)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["transformers_generate_padded"] = {"failed": True, "errors": [_err(e)]}
        log("batched: transformers generate_batch (continuous batching)")
        attn_before = getattr(hf.config, "_attn_implementation", None)
        res["transformers_generate_batch"] = hf_generate_batch(
            hf, prompts, M, engine.pool.num_blocks * engine.block_size * engine.kv_bytes_per_token,
            engine.kv_bytes_per_token, engine.scheduler.max_num_batched_tokens)
        if getattr(hf.config, "_attn_implementation", None) != attn_before:
            res["transformers_generate_batch"]["note"] = (
                f"attention implementation changed {attn_before} -> {hf.config._attn_implementation}")
    eos = engine.eos_token_ids
    kv_out = kv.pop("_outputs")
    for key in ("transformers_generate_padded", "transformers_generate_batch"):
        peer = res[key]
        if not peer or peer.get("failed"):
            continue
        outs = peer.pop("_outputs")
        # compare greedy tokens up to kvkeeper's first EOS (after EOS the two ways of ignoring it differ)
        same = sum(1 for a, b in zip(kv_out, outs) if _until_eos(a, eos) == b[: len(_until_eos(a, eos))])
        peer["rows_equal_to_kvkeeper_until_eos"] = f"{same}/{len(kv_out)}"
        peer["ratio_kvkeeper_over_peer_total"] = _ratio(kv["tok_per_s"], peer["tok_per_s"])
        peer["ratio_kvkeeper_over_peer_decode_only"] = _ratio(kv.get("decode_only_tok_per_s"),
                                                             peer.get("decode_only_tok_per_s"))
    res["target_tok_s"] = {"metric": f"kvkeeper total tok/s, {len(prompts)} streams x {M} tokens",
                           "target": TARGET_BATCHED_TOK_S, "measured": kv["tok_per_s"], "unit": " tok/s",
                           "met": kv["tok_per_s"] >= TARGET_BATCHED_TOK_S,
                           "note": "target defined for 16 x 64 (full run)" if bc.quick else ""}
    gb = res["transformers_generate_batch"] or {}
    r = gb.get("ratio_kvkeeper_over_peer_total")
    res["target"] = {"metric": "kvkeeper tok/s / transformers generate_batch tok/s (wall, all tokens)",
                     "target": TARGET_BATCHED_VS_GENERATE_BATCH, "measured": r,
                     "met": None if r is None else r >= TARGET_BATCHED_VS_GENERATE_BATCH,
                     "note": "" if r is not None else "generate_batch did not produce a result (see errors)"}
    return res


# --------------------------------------------------------------------------------------------------
# 4. single-stream decode
# --------------------------------------------------------------------------------------------------
def bench_single(engine: LLMEngine, hf, question: dict, bc: BenchConfig, llm=None) -> dict:
    ids = engine.encode_chat([{"role": "user", "content": question["turns"][0]}])
    N = bc.single_new_tokens
    log(f"single-stream: kvkeeper, {len(ids)} prompt tokens, {N} new")
    engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True), namespace=engine.isolated_namespace("w"))
    t0 = time.perf_counter()
    o = engine.generate([ids], SamplingParams(max_tokens=N, ignore_eos=True),
                        namespace=engine.isolated_namespace("single"))[0]
    wall = time.perf_counter() - t0
    res = {"prompt": f"MT-Bench question {question['question_id']} first turn, chat template",
           "prompt_tokens": len(ids), "new_tokens": N,
           "kvkeeper": {"ttft_s": o.ttft_s, "decode_tok_per_s": o.decode_tok_per_s, "wall_s": wall,
                        "tokens": o.completion_tokens}}
    if hf is not None:
        log("single-stream: transformers generate")
        hf_generate(hf, ids, 8, 8)  # warm-up
        st = TimingStreamer()
        t0 = time.perf_counter()
        out = hf_generate(hf, ids, N, N, streamer=st)
        wall = time.perf_counter() - t0
        toks = out[0, len(ids):].tolist()
        n = len(st.times)
        dec = (n - 1) / (st.times[-1] - st.times[0]) if n > 1 and st.times[-1] > st.times[0] else None
        res["transformers_generate"] = {"ttft_s": st.times[0] - t0 if st.times else None, "decode_tok_per_s": dec,
                                        "wall_s": wall, "tokens": len(toks),
                                        "timing": "streamer timestamps: (n-1)/(t_last - t_first), as kvkeeper"}
        kv_cmp = _until_eos(o.token_ids, engine.eos_token_ids)
        res["greedy_tokens_equal"] = kv_cmp == toks[: len(kv_cmp)]
        res["greedy_compared_tokens"] = len(kv_cmp)
        res["greedy_first_divergence"] = _first_divergence(kv_cmp, toks[: len(kv_cmp)])
        res["greedy_note"] = ("compared up to kvkeeper's first EOS: after it kvkeeper (ignore_eos) keeps the EOS "
                              "token while transformers (min_new_tokens) masks it")
    if llm is not None:
        log("single-stream: llama.cpp")
        try:
            llama_cpp_stream(llm, ids, 8)  # warm-up
            res["llama_cpp"] = llama_cpp_stream(llm, ids, N)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["llama_cpp"] = {"failed": _err(e)}
    rl = _ratio(o.decode_tok_per_s, (res.get("llama_cpp") or {}).get("decode_tok_per_s"))
    res["ratio_kvkeeper_over_llama_cpp"] = rl
    res["target_llama_cpp"] = {"metric": "kvkeeper decode tok/s / llama.cpp decode tok/s, short chat prompt",
                               "target": TARGET_DECODE_VS_LLAMA, "measured": rl,
                               "met": None if rl is None else rl >= TARGET_DECODE_VS_LLAMA}
    r = _ratio(o.decode_tok_per_s, (res.get("transformers_generate") or {}).get("decode_tok_per_s"))
    res["ratio_kvkeeper_over_transformers"] = r
    res["target"] = {"metric": "kvkeeper decode tok/s / transformers generate decode tok/s",
                     "target": TARGET_SINGLE_STREAM, "measured": r,
                     "met": None if r is None else r >= TARGET_SINGLE_STREAM}
    return res


# --------------------------------------------------------------------------------------------------
# 5. long context
# --------------------------------------------------------------------------------------------------
BOOK = ROOT / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"


def book_tokens(engine: LLMEngine, n: int, skip: int = 2000) -> list[int]:
    ids = engine.tokenizer.encode(BOOK.read_text(encoding="utf-8"), add_special_tokens=False)
    return ids[skip: skip + n]


def bench_long(engine: LLMEngine, llm, llm_status: str, bc: BenchConfig) -> dict:
    """Prefill of a long raw-text prompt (time to first token), then decode after it; kvkeeper vs llama.cpp."""
    n, m = bc.long_prompt_tokens, bc.long_new_tokens
    ids = book_tokens(engine, n)
    log(f"long context: kvkeeper, {len(ids)}-token prompt, {m} new tokens")
    engine.generate([ids[:300]], SamplingParams(max_tokens=4), namespace=engine.isolated_namespace("w"))
    t0 = time.perf_counter()
    o = engine.generate([ids], SamplingParams(max_tokens=m + 1, ignore_eos=True),
                        namespace=engine.isolated_namespace("long"))[0]
    res = {"prompt": f"{BOOK.relative_to(ROOT)}, tokens 2000..{2000 + len(ids)} (raw text)",
           "prompt_tokens": len(ids), "new_tokens": m + 1,
           "kvkeeper": {"prefill_s": o.ttft_s, "decode_tok_per_s": o.decode_tok_per_s,
                        "wall_s": time.perf_counter() - t0, "tokens": o.completion_tokens,
                        "kv_dtype": engine.runner.kv_format.name},
           "llama_cpp_status": llm_status}
    if llm is not None:
        log("long context: llama.cpp")
        try:
            r = llama_cpp_stream(llm, ids, m + 1)
            res["llama_cpp"] = {"prefill_s": r["ttft_s"], "decode_tok_per_s": r["decode_tok_per_s"],
                                "wall_s": r["wall_s"], "tokens": r["tokens"]}
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["llama_cpp"] = {"failed": _err(e)}
    # the other KV precision, for comparison (no target): float32 when the default is 16-bit (quantized weights keep
    # bf16 KV, as llama.cpp keeps f16), else bfloat16
    other = "fp32" if engine.runner.kv_format.name in ("bfloat16", "float16") else "bf16"
    log(f"long context: kvkeeper with a {other} KV cache")
    try:
        eng2 = LLMEngine(str(engine.model_path), quantization=engine.runner.weight_format, kv_dtype=other,
                         kv_cache_bytes=512 << 20)
        eng2.generate([ids[:300]], SamplingParams(max_tokens=4), namespace=eng2.isolated_namespace("w"))
        o2 = eng2.generate([ids], SamplingParams(max_tokens=m + 1, ignore_eos=True),
                           namespace=eng2.isolated_namespace("long"))[0]
        res["kvkeeper_other_kv"] = {"prefill_s": o2.ttft_s, "decode_tok_per_s": o2.decode_tok_per_s,
                                    "tokens": o2.completion_tokens, "kv_dtype": eng2.runner.kv_format.name}
        del eng2
        gc.collect()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["kvkeeper_other_kv"] = {"failed": _err(e), "kv_dtype": other}
    lc = res.get("llama_cpp") or {}
    note = "targets defined for 7,000 tokens (full run)" if bc.quick else ""
    pf = _ratio(lc.get("prefill_s"), o.ttft_s)
    dc = _ratio(o.decode_tok_per_s, lc.get("decode_tok_per_s"))
    res["target_prefill"] = {"metric": f"llama.cpp prefill time / kvkeeper prefill time, {len(ids)}-token prompt",
                             "target": TARGET_PREFILL_VS_LLAMA, "measured": pf,
                             "met": None if pf is None else pf >= TARGET_PREFILL_VS_LLAMA, "note": note}
    res["target_decode"] = {"metric": f"kvkeeper decode tok/s / llama.cpp decode tok/s after {len(ids)} tokens",
                            "target": TARGET_DECODE_VS_LLAMA, "measured": dc,
                            "met": None if dc is None else dc >= TARGET_DECODE_VS_LLAMA, "note": note}
    return res


# --------------------------------------------------------------------------------------------------
# 0. weight formats: memory, speed, quality
# --------------------------------------------------------------------------------------------------
FORMATS = ("none", "gguf", "int8", "int4")
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "Photosynthesis is the process by which"]


def measure_rss(model: str | None, fmt: str) -> dict:
    """Resident memory of a fresh process after loading an engine in ``fmt`` (small KV pool: 64 blocks)."""
    import subprocess

    import kvkeeper as _k

    code = ("import json, sys, torch\n"
            "from kvkeeper import LLMEngine\n"
            "def kb(key):\n"
            "    for line in open('/proc/self/status'):\n"
            "        if line.startswith(key): return int(line.split()[1])\n"
            "before = kb('VmRSS:')\n"
            "e = LLMEngine(sys.argv[1] or None, quantization=sys.argv[2], num_kv_blocks=64)\n"
            "import gc; gc.collect()\n"
            "after = kb('VmRSS:')\n"
            "from kvkeeper import SamplingParams\n"
            "e.generate(['Hello'], SamplingParams(max_tokens=2))\n"
            "print(json.dumps({'rss_after_load_mib': after / 1024, 'rss_after_first_tokens_mib': kb('VmRSS:') / 1024,\n"
            "                  'peak_rss_mib': kb('VmHWM:') / 1024,\n"
            "                  'rss_before_load_mib': before / 1024, 'format': e.runner.weight_format,\n"
            "                  'kv_pool_mib': e.pool.num_blocks * e.block_size * e.kv_bytes_per_token / 2**20}))\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(_k.__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code, model or "", fmt], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        return {"failed": out.stderr.strip()[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def parity_prompts(engine: LLMEngine, questions: list[dict], n: int) -> list[list[int]]:
    """The parity test's prompts (tests/test_engine_real.py): both turns of the first MT-Bench questions (turn 2
    after the engine's own greedy 24-token turn-1 reply) plus four raw text prompts; the first n of them."""
    firsts = [engine.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in questions[:10]]
    replies = engine.generate(firsts, SamplingParams(max_tokens=24), namespace=engine.isolated_namespace("pp"))
    prompts = []
    for q, ids, rep in zip(questions[:10], firsts, replies):
        prompts.append(ids)
        prompts.append(engine.encode_chat([{"role": "user", "content": q["turns"][0]},
                                           {"role": "assistant", "content": rep.text},
                                           {"role": "user", "content": q["turns"][1]}]))
    prompts += [engine.tokenizer.encode(p) for p in RAW_PROMPTS]
    return prompts[:n] if n < len(prompts) else prompts


@torch.inference_mode()
def argmax_all_positions(engine: LLMEngine, ids: list[int]) -> list[int]:
    """Greedy (top-1) token after every prefix of ids, teacher-forced: one prefill of ids, logits at each position."""
    from kvkeeper.engine.sequence import Sequence

    seq = Sequence("agree", list(ids), SamplingParams(max_tokens=1), engine.isolated_namespace("agree"))
    if not engine.kv.allocate(seq, len(ids)):
        raise RuntimeError("KV pool too small for the agreement check")
    try:
        r = engine.runner
        input_ids, positions, meta, _, _ = r.build_batch([(seq, len(ids))])
        hidden = r.model(input_ids, positions, r.kv_store, meta)
        return r.model.compute_logits(hidden).argmax(-1).tolist()
    finally:
        engine.kv.free(seq)


def single_decode_tok_s(engine: LLMEngine, ids: list[int], n: int) -> float | None:
    for _ in range(2):  # warm-up (the first steps after a load run slower)
        engine.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True), namespace=engine.isolated_namespace("w"))
    runs = [engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True),
                            namespace=engine.isolated_namespace("fmt"))[0].decode_tok_per_s for _ in range(2)]
    return max(r for r in runs if r is not None) if any(r is not None for r in runs) else None


def bench_formats(model: str | None, questions: list[dict], bc: BenchConfig, default_format: str) -> dict:
    """Every weight format against ``none`` (float32): memory, bytes per weight, decode speed, perplexity at
    bc.ppl_context tokens, and greedy agreement over the parity prompts (bc.agree_tokens tokens each)."""
    from kvkeeper.eval.perplexity import perplexity

    rows, ref = [], None
    single_ids = None
    for fmt in FORMATS:
        log(f"formats: {fmt}: resident memory (fresh process)")
        row = {"format": fmt, "memory": measure_rss(model, fmt)}
        try:
            eng = LLMEngine(model, quantization=fmt, kv_cache_bytes=512 << 20)
        except Exception as e:  # noqa: BLE001
            row["failed"] = _err(e)
            rows.append(row)
            continue
        row["runs"] = eng.runner.weight_format
        row["description"] = eng.runner.weight_description
        mc = model_costs(eng)
        row["weight_bytes_per_decode_step"] = mc["weight_bytes_per_decode_step"]
        row["bytes_per_weight"] = mc["weight_bytes_per_decode_step"] / max(mc["decode_params"], 1)
        if single_ids is None:
            single_ids = eng.encode_chat([{"role": "user", "content": questions[16]["turns"][0]}])
        log(f"formats: {fmt}: decode speed, perplexity, agreement")
        row["decode_tok_per_s"] = single_decode_tok_s(eng, single_ids, 128 if not bc.quick else 16)
        ids = book_tokens(eng, bc.ppl_context)
        p = perplexity(eng, ids)
        row["ppl"], row["ppl_tokens"], row["ppl_seconds"] = p["ppl"], p["tokens"], p["seconds"]
        prompts = parity_prompts(eng if ref is None else ref["engine"], questions, bc.agree_prompts)
        outs = eng.generate(prompts, SamplingParams(max_tokens=bc.agree_tokens),
                            namespace=eng.isolated_namespace("agree"))
        conts = [o.token_ids for o in outs]
        if ref is None:
            ref = {"engine": eng, "conts": conts, "ppl": p["ppl"], "prompts": prompts}
        else:
            same = sum(1 for a, b in zip(conts, ref["conts"]) if a == b)
            agree = total = 0
            for pr, cont in zip(ref["prompts"], ref["conts"]):
                if not cont:
                    continue
                top1 = argmax_all_positions(eng, pr + cont[:-1])[len(pr) - 1:]
                agree += sum(1 for a, b in zip(top1, cont) if a == b)
                total += len(cont)
            row["identical_continuations"] = f"{same}/{len(conts)}"
            row["identical_fraction"] = same / len(conts)
            row["top1_agreement"] = agree / total if total else None
            row["top1_positions"] = total
            row["ppl_vs_none"] = p["ppl"] / ref["ppl"] - 1
            del eng
        rows.append(row)
        gc.collect()
    ref.pop("engine", None)
    by = {r["format"]: r for r in rows}
    d = by.get(default_format) or {}
    res = {"formats": rows, "default": default_format,
           "ppl_text": f"{BOOK.relative_to(ROOT)}, {bc.ppl_context} tokens after the first 2000, chunks of 512",
           "agreement": f"{len(ref['prompts']) if ref else 0} parity prompts (tests/test_engine_real.py), "
                        f"{bc.agree_tokens} greedy tokens; top-1 agreement teacher-forced on the float32 continuation"}
    if default_format != "none" and d.get("ppl_vs_none") is not None:
        res["target_ppl"] = {"metric": f"perplexity of the default format ({default_format}) / float32 - 1",
                             "target": TARGET_PPL_REL, "op": "<=abs", "measured": d["ppl_vs_none"],
                             "met": abs(d["ppl_vs_none"]) <= TARGET_PPL_REL}
        res["target_agreement"] = {"metric": f"per-position top-1 agreement of {default_format} with float32",
                                   "target": TARGET_AGREEMENT, "measured": d.get("top1_agreement"),
                                   "met": None if d.get("top1_agreement") is None
                                   else d["top1_agreement"] >= TARGET_AGREEMENT}
    return res


# --------------------------------------------------------------------------------------------------
# roofline fractions
# --------------------------------------------------------------------------------------------------
def roofline_fractions(mc: dict, roof: dict, results: dict) -> list[dict]:
    rows = []
    single = results.get("single_stream") or {}
    if single.get("kvkeeper", {}).get("decode_tok_per_s"):
        ctx = single["prompt_tokens"] + single["new_tokens"] // 2
        lim = roofline_decode_tok_s(mc, roof, 1, ctx)
        got = single["kvkeeper"]["decode_tok_per_s"]
        rows.append({"what": f"single-stream decode (ctx ~{ctx})", "unit": "tok/s", "kvkeeper": got,
                     "limit": lim, "fraction": got / lim})
    bat = results.get("batched") or {}
    kvb = bat.get("kvkeeper") or {}
    if kvb.get("decode_only_tok_per_s"):
        ctx = int(statistics.mean(bat["prompt_tokens"])) + bat["new_tokens_each"] // 2
        lim = roofline_decode_tok_s(mc, roof, bat["requests"], ctx)
        got = kvb["decode_only_tok_per_s"]
        rows.append({"what": f"batched decode, {bat['requests']} streams (ctx ~{ctx})", "unit": "tok/s",
                     "kvkeeper": got, "limit": lim, "fraction": got / lim})
    mt = results.get("multiturn") or {}
    if mt.get("turns"):
        last = mt["turns"][-1]
        T = last["prompt_tokens"]
        if last.get("noreuse_ttft_s"):
            lim_s = roofline_prefill_s(mc, roof, T, 0)
            rows.append({"what": f"prefill of {T} tokens from scratch (no reuse, turn {last['turn']})",
                         "unit": "tok/s", "kvkeeper": T / last["noreuse_ttft_s"], "limit": T / lim_s,
                         "fraction": lim_s / last["noreuse_ttft_s"]})
        if last.get("kvkeeper_ttft_s"):
            n_new = max(last["new_tokens"], 1)
            lim_s = roofline_prefill_s(mc, roof, n_new, last["cached_tokens"])
            rows.append({"what": f"turn {last['turn']} TTFT with reuse ({n_new} new after {last['cached_tokens']})",
                         "unit": "ms", "kvkeeper": last["kvkeeper_ttft_s"] * 1e3, "limit": lim_s * 1e3,
                         "fraction": lim_s / last["kvkeeper_ttft_s"]})
    return rows


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def _f(x, nd=1, unit=""):
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return f"{x}{unit}"
    return f"{x:.{nd}f}{unit}"


def _ms(s):
    return "n/a" if s is None else f"{s * 1e3:.1f}"


def _met(t: dict) -> str:
    if t.get("met") is None:
        return "n/a"
    return "**met**" if t["met"] else "**not met**"


def _target_row(sec: str, t: dict) -> str:
    note = f" ({t['note']})" if t.get("note") else ""
    op = t.get("op", ">=")
    unit = t.get("unit", "x")
    if op == "<=abs":
        tgt, got = f"within +-{100 * t['target']:g}%", _f(None if t["measured"] is None else 100 * t["measured"], 2, "%")
    else:
        tgt, got = f"{op} {t['target']:g}{unit}", _f(t["measured"], 2, unit)
    return f"| {sec} | {t['metric']}{note} | {tgt} | {got} | {_met(t)} |"


def _render_multiturn(L: list, R: dict, key: str, title: str) -> None:
    mt = R.get(key)
    L.append(title + "\n")
    if mt:
        L.append(f"User turns: {mt['user_turns_from']}; greedy replies, max_tokens={mt['reply_max_tokens']}. "
                 "kvkeeper: one Session with KV reuse. No-reuse: the same prompt ids in an isolated namespace. "
                 "transformers: the same prompt ids re-prefilled from scratch, `generate(max_new_tokens=1)`, "
                 "timed once after one warm-up on the same ids. llama.cpp: the same ids through "
                 "`create_completion(max_tokens=1)` on one context that keeps the conversation (its prefix reuse), "
                 "extended by each reply untimed (" + mt["llama_cpp"] + ").\n")
        has_llama = any(r.get("llama_cpp_ttft_s") is not None for r in mt["turns"])
        hdr = ("| turn | history tokens | cached | new | kvkeeper TTFT ms | no-reuse TTFT ms | transformers TTFT ms "
               "| transformers / kvkeeper | no-reuse / kvkeeper |")
        sep = "|---|---|---|---|---|---|---|---|---|"
        if has_llama:
            hdr += " llama.cpp TTFT ms | kvkeeper / llama.cpp |"
            sep += "---|---|"
        hdr += " first token agrees |"
        sep += "---|"
        L += [hdr, sep]
        for r in mt["turns"]:
            line = (f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['new_tokens']} | "
                    f"{_ms(r['kvkeeper_ttft_s'])} | {_ms(r.get('noreuse_ttft_s'))} | {_ms(r.get('transformers_ttft_s'))} | "
                    f"{_f(r['ratio_transformers_over_kvkeeper'], 1, 'x')} | {_f(r['ratio_noreuse_over_kvkeeper'], 1, 'x')} |")
            if has_llama:
                line += (f" {_ms(r.get('llama_cpp_ttft_s'))} | "
                         f"{_f(_ratio(r['kvkeeper_ttft_s'], r.get('llama_cpp_ttft_s')), 2, 'x')} |")
            line += f" {_f(r['first_token_agrees'])} |"
            L.append(line)
        L.append("")
        for tk in ("target", "target_llama_cpp"):
            t = mt.get(tk)
            if t and (tk != "target" or key == "multiturn"):
                L.append(f"Target: {_target_row(title.split(' ', 2)[-1], t)}")
        L.append("\nkvkeeper TTFT runs from queueing the request to its first sampled token; the chat-template "
                 "rendering and tokenisation before it are not counted (the peers get pre-tokenised ids too). "
                 "'first token agrees' compares kvkeeper (reuse), kvkeeper (no reuse) and transformers (float32): "
                 "with a quantized weight format a differing first token against float32 is a rounding effect.")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get(key)}")
    L.append("")


def render_markdown(R: dict) -> str:
    L = []
    m = R["machine"]
    L.append(f"# kvkeeper engine benchmark{' (QUICK smoke run: numbers not meaningful)' if R['quick'] else ''}\n")
    L.append("| item | value |\n|---|---|")
    for k in ("date", "cpu_model", "os_cpu_count", "sched_cpus", "torch_threads", "torch_version", "torch_blas",
              "transformers_version", "python", "loadavg_start", "loadavg_end"):
        v = m.get(k)
        if isinstance(v, (list, tuple)):
            v = ", ".join(f"{x:.2f}" for x in v)
        L.append(f"| {k} | {v} |")
    L.append(f"| model | {R['model']['path']} (same file for every engine) |")
    L.append(f"| kvkeeper weights (sections 2-6) | {R['model'].get('weights')}; attention backend "
             f"{R['model'].get('attention_backend')}; fused decode step {_f(R['model'].get('fused_decode'))} |")
    L.append(f"| llama.cpp | {R.get('llama_cpp')} |")
    L.append(f"| transformers load time | {_f(R['model'].get('transformers_load_s'), 1, ' s')} |")
    L.append("")
    busy = [x for x in (m.get("loadavg_start"), m.get("loadavg_end")) if x]
    ncpu = m.get("sched_cpus") or m.get("os_cpu_count") or 1
    if any(x[0] > 0.75 * ncpu for x in busy):
        L.append(f"> **Warning: the machine was busy** (1-min load average {', '.join(f'{x[0]:.1f}' for x in busy)} "
                 f"on {ncpu} CPUs). With more runnable threads than cores, multi-threaded (OpenMP) matmuls stall "
                 "on descheduled threads, so every number below is unreliable; rerun on a quiet machine.\n")

    # targets
    L.append("## Targets\n")
    L.append("| section | metric | target | measured | status |\n|---|---|---|---|---|")
    for sec, key, tkeys in (("0. weight formats", "formats", ("target_ppl", "target_agreement")),
                            ("2. multi-turn TTFT", "multiturn", ("target", "target_llama_cpp")),
                            ("2b. short turns TTFT", "multiturn_short", ("target_llama_cpp",)),
                            ("3. batched decode", "batched", ("target_tok_s", "target")),
                            ("4. single-stream decode", "single_stream", ("target_llama_cpp", "target")),
                            ("5. long context", "long_context", ("target_prefill", "target_decode"))):
        sec_r = R.get(key)
        if not sec_r:
            err = (R.get("errors") or {}).get(key)
            L.append(f"| {sec} | {'(failed: ' + err[:200] + ')' if err else '(skipped)'} | | | n/a |")
            continue
        for tk in tkeys:
            t = sec_r.get(tk)
            if t:
                L.append(_target_row(sec, t))
    L.append("")

    # formats
    fm = R.get("formats")
    L.append("## 0. Weight formats (`--quantization`)\n")
    if fm:
        L.append(f"Each format in its own engine. Perplexity: {fm['ppl_text']}. Agreement: {fm['agreement']}. "
                 "Resident memory: a fresh process after `LLMEngine(quantization=...)` with a 64-block KV pool, and "
                 "after its first two tokens (weights mapped from the cache are resident once used) (VmRSS; "
                 "includes the Python runtime, torch and the tokenizer). Decode: single stream, 128 tokens "
                 f"after a chat prompt, best of 2. Default format here: **{fm['default']}**.\n")
        L.append("| format | weights | bytes per weight (decode step) | RSS after load MiB | RSS after 2 tokens MiB "
                 "| peak RSS MiB | decode tok/s | perplexity | vs none | identical continuations | top-1 agreement |"
                 "\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in fm["formats"]:
            if r.get("failed"):
                L.append(f"| {r['format']} | failed: {r['failed'][:200]} | | | | | | | | | |")
                continue
            mem = r.get("memory") or {}
            vs = r.get("ppl_vs_none")
            L.append(f"| {r['format']} | {r.get('description')} | {_f(r.get('bytes_per_weight'), 3)} | "
                     f"{_f(mem.get('rss_after_load_mib'), 0)} | {_f(mem.get('rss_after_first_tokens_mib'), 0)} | "
                     f"{_f(mem.get('peak_rss_mib'), 0)} | "
                     f"{_f(r.get('decode_tok_per_s'))} | {_f(r.get('ppl'), 3)} | "
                     f"{'' if vs is None else f'{100 * vs:+.2f}%'} | {r.get('identical_continuations', '')} | "
                     f"{_f(None if r.get('top1_agreement') is None else 100 * r['top1_agreement'], 2, '%')} |")
        L.append("")
        for tk in ("target_ppl", "target_agreement"):
            if fm.get(tk):
                L.append(f"Target: {_target_row('formats', fm[tk])}")
    else:
        L.append(f"failed or skipped: {(R.get('errors') or {}).get('formats')}")
    L.append("")

    # roofline
    roof = R.get("roofline")
    L.append("## 1. Roofline of this machine (measured in this run)\n")
    if roof:
        mc = R["model_costs"]
        L.append("| measurement | best | median | how |\n|---|---|---|---|")
        c, mm, g = roof["copy"], roof["matmul"], roof["gemv"]
        L.append(f"| memory copy bandwidth | {c['gb_per_s']:.1f} GB/s | {c['gb_per_s_median']:.1f} GB/s | "
                 f"copy_ of {c['buffer_mib']} MiB fp32 (written first), read+write bytes, {c['reps']} reps |")
        L.append(f"| fp32 matmul | {mm['gflop_per_s']:.1f} GFLOP/s | {mm['gflop_per_s_median']:.1f} GFLOP/s | "
                 f"torch.mm {mm['n']}^3, {m['torch_threads']} threads, {mm['reps']} reps |")
        rd = roof.get("read")
        if rd:
            L.append(f"| memory read bandwidth | {rd['gb_per_s']:.1f} GB/s | {rd['gb_per_s_median']:.1f} GB/s | "
                     f"sum() over {rd['buffer_mib']} MiB fp32, {rd['reps']} reps |")
        q = roof.get("qmm") or {}
        if q.get("gop_per_s"):
            L.append(f"| kvkeeper block matmul (int8 x int4, {q['isa']}) | {q['gop_per_s']:.0f} GOP/s | "
                     f"{q['gop_per_s_median']:.0f} GOP/s | {q['shape']}, {q['reps']} reps |")
        L.append(f"| fp32 GEMV weight streaming | {g['gb_per_s']:.1f} GB/s | {g['gb_per_s_median']:.1f} GB/s | "
                 f"x(1,in) @ W.T over {g['matrices']} distinct matrices shaped like the model, "
                 f"{g['bytes'] / 1e6:.0f} MB, {g['reps']} reps |")
        pr = roof.get("small_m_probe")
        if pr:
            L.append(f"| small-M GEMM probe (4x576 @ 576x3072) | main thread {pr['main_thread_ms']:.2f} ms | "
                     f"helper thread {pr['helper_thread_ms']:.2f} ms | main/helper {pr['main_over_helper']:.1f}x "
                     "(>> 1: OpenMP threads stalled by a busy machine) |")
        L.append("")
        L.append(f"| model cost (SmolLM2-135M, weights {mc.get('weight_format')}) | value |\n|---|---|")
        L.append(f"| parameters | {mc['params_total'] / 1e6:.1f} M (tied embeddings: {mc['tie_word_embeddings']}) |")
        L.append(f"| weight bytes read per decode step | {mc['weight_bytes_per_decode_step'] / 1e6:.0f} MB "
                 f"(+ {mc['kv_bytes_per_token']} B KV per context token) |")
        L.append(f"| prefill FLOP per token (matmuls, 2 x {mc['params_per_prefill_token'] / 1e6:.1f} M) | "
                 f"{2 * mc['params_per_prefill_token'] / 1e6:.0f} MFLOP (+ attention, + one lm_head row per prompt) |")
        d = R["roofline_limits"]
        L.append(f"| decode limit, 1 stream, empty context (weight bytes / read BW) | {d['decode_tok_s_ctx0']:.1f} tok/s |")
        L.append(f"| prefill limit (2 x all params per token / projection rate) | {d['prefill_tok_s_2xparams']:.0f} tok/s |")
        L.append(f"| prefill limit (2 x matmul params per token / projection rate) | {d['prefill_tok_s_matmul']:.0f} tok/s |")
        L.append("")
        if R.get("roofline_fractions"):
            L.append("| kvkeeper vs roofline | kvkeeper | limit | fraction of limit |\n|---|---|---|---|")
            for r in R["roofline_fractions"]:
                L.append(f"| {r['what']} | {r['kvkeeper']:.1f} {r['unit']} | {r['limit']:.1f} {r['unit']} | "
                         f"{100 * r['fraction']:.0f}% |")
            L.append("\nLimits: decode = max(bytes / read BW, projection ops / projection rate) per step with the KV "
                     "of the context included; prefill = max(projection ops / projection rate + causal attention "
                     "FLOPs / fp32 matmul rate, one weight and KV pass / read BW). Projection rate: the block "
                     "matmul's for a quantized format, fp32 matmul's for none.")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('roofline')}")
    L.append("")

    for key, title in (("multiturn", "## 2. Multi-turn TTFT"), ("multiturn_short", "## 2b. Short turns: TTFT")):
        _render_multiturn(L, R, key, title)

    # batched
    b = R.get("batched")
    L.append("## 3. Batched decode\n")
    if b:
        L.append(f"{b['requests']} concurrent requests ({b['prompts_from']}; prompt tokens "
                 f"{min(b['prompt_tokens'])}-{max(b['prompt_tokens'])}), {b['new_tokens_each']} new tokens each, "
                 "EOS ignored (kvkeeper `ignore_eos=True`; generate `min_new_tokens`; generate_batch `eos_token_id=-1`).\n")
        L.append("| engine | wall s | total tok/s | decode-only tok/s | exact length | kvkeeper / peer (total) | "
                 "kvkeeper / peer (decode-only) | greedy rows equal kvkeeper |\n|---|---|---|---|---|---|---|---|")
        kv = b["kvkeeper"]
        L.append(f"| kvkeeper `generate` | {kv['wall_s']:.2f} | {kv['tok_per_s']:.1f} | "
                 f"{_f(kv.get('decode_only_tok_per_s'))} | {_f(kv['all_exact_length'])} | | | |")
        for key, name in (("transformers_generate_batch", "transformers `generate_batch`"),
                          ("transformers_generate_padded", "transformers `generate` (left-padded)")):
            p = b.get(key)
            if not p:
                L.append(f"| {name} | not run | | | | | | |")
            elif p.get("failed"):
                L.append(f"| {name} | failed (see below) | | | | | | |")
            else:
                L.append(f"| {name} | {p['wall_s']:.2f} | {p['tok_per_s']:.1f} | {_f(p.get('decode_only_tok_per_s'))} | "
                         f"{_f(p['all_exact_length'])} | {_f(p['ratio_kvkeeper_over_peer_total'], 2, 'x')} | "
                         f"{_f(p['ratio_kvkeeper_over_peer_decode_only'], 2, 'x')} | "
                         f"{p['rows_equal_to_kvkeeper_until_eos']} |")
        t = b["target"]
        L.append(f"\nTarget: {t['metric']} >= {t['target']:g}x; measured {_f(t['measured'], 2, 'x')}: {_met(t)}.")
        gb = b.get("transformers_generate_batch") or {}
        if gb.get("signature"):
            L.append(f"\n`{gb['signature']}`" + (f"; ran with {gb['config']}" if gb.get("config") else ""))
        for e in gb.get("errors", []):
            L.append(f"\ngenerate_batch error: `{e[:500]}`")
        if gb.get("prefill_phase_s") is not None:
            L.append(f"\ngenerate_batch timeline (inside its wall time): first token of every request after "
                     f"{gb['prefill_phase_s']:.2f} s; {gb.get('after_last_token_s', 0):.2f} s from the last token "
                     "to the return (manager shutdown).")
        if gb.get("note"):
            L.append(f"\nNote: {gb['note']}")
        pg = b.get("transformers_generate_padded") or {}
        for e in pg.get("errors", []):
            L.append(f"\npadded generate error: `{e[:500]}`")
        L.append("\nDecode-only: tokens produced after every request has its first token, over the time after "
                 "that point (kvkeeper, generate_batch timestamps); padded generate: "
                 "(N x (M-1)) / (t(M tokens) - t(1 token)).")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('batched')}")
    L.append("")

    # single
    s = R.get("single_stream")
    L.append("## 4. Single-stream decode\n")
    if s:
        L.append(f"{s['prompt']} ({s['prompt_tokens']} tokens), {s['new_tokens']} new tokens, EOS ignored. "
                 "Decode tok/s = (n-1)/(t_last - t_first) for both (transformers via a streamer).\n")
        L.append("| engine | TTFT ms | decode tok/s | wall s |\n|---|---|---|---|")
        k = s["kvkeeper"]
        L.append(f"| kvkeeper | {_ms(k['ttft_s'])} | {_f(k['decode_tok_per_s'])} | {k['wall_s']:.2f} |")
        h = s.get("transformers_generate")
        if h:
            L.append(f"| transformers `generate` | {_ms(h['ttft_s'])} | {_f(h['decode_tok_per_s'])} | {h['wall_s']:.2f} |")
        lc = s.get("llama_cpp")
        if lc and not lc.get("failed"):
            L.append(f"| llama.cpp (streamed) | {_ms(lc['ttft_s'])} | {_f(lc['decode_tok_per_s'])} | {lc['wall_s']:.2f} |")
        elif lc:
            L.append(f"| llama.cpp | failed: {lc['failed'][:200]} | | |")
        L.append("")
        for tk in ("target_llama_cpp", "target"):
            if s.get(tk):
                L.append(f"Target: {_target_row('single-stream', s[tk])}")
        if "greedy_tokens_equal" in s:
            L.append(f"\nGreedy tokens kvkeeper == transformers: {_f(s['greedy_tokens_equal'])} "
                     f"({s['greedy_compared_tokens']} tokens compared; {s['greedy_note']}).")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('single_stream')}")
    L.append("")

    # long context
    lg = R.get("long_context")
    L.append("## 5. Long context: prefill and decode after it\n")
    if lg:
        L.append(f"{lg['prompt']}: {lg['prompt_tokens']} prompt tokens, then {lg['new_tokens']} greedy tokens (EOS "
                 f"ignored). Prefill = time to the first token; decode tok/s = (n-1)/(t_last - t_first). kvkeeper KV "
                 f"cache {lg['kvkeeper']['kv_dtype']}; llama.cpp: {lg['llama_cpp_status']}.\n")
        L.append("| engine | prefill s | prefill tok/s | decode tok/s after the prompt |\n|---|---|---|---|")
        for name, r in ((f"kvkeeper (KV {lg['kvkeeper']['kv_dtype']}, the default)", lg["kvkeeper"]),
                        (f"kvkeeper, KV {(lg.get('kvkeeper_other_kv') or {}).get('kv_dtype')} (`--kv-dtype`)",
                         lg.get("kvkeeper_other_kv")),
                        ("llama.cpp (its default KV: f16)", lg.get("llama_cpp"))):
            if r and not r.get("failed"):
                L.append(f"| {name} | {_f(r['prefill_s'], 2)} | {_f(lg['prompt_tokens'] / r['prefill_s'], 0)} | "
                         f"{_f(r['decode_tok_per_s'])} |")
            elif r:
                L.append(f"| {name} | failed: {r['failed'][:200]} | | |")
        L.append("")
        for tk in ("target_prefill", "target_decode"):
            if lg.get(tk):
                L.append(f"Target: {_target_row('long context', lg[tk])}")
    else:
        L.append(f"failed or skipped: {(R.get('errors') or {}).get('long_context')}")
    L.append("")

    # correctness
    mt = R.get("multiturn")
    L.append("## Correctness cross-checks (same run)\n")
    L.append("| check | result |\n|---|---|")
    if mt:
        L.append(f"| multi-turn: first token of kvkeeper (reuse) = no-reuse = transformers, every turn | "
                 f"{_f(mt['first_token_agrees_all_turns'])} |")
        ok = all(r["turn"] == 1 or r["cached_tokens"] > 0 for r in mt["turns"])
        L.append(f"| multi-turn: turns >= 2 reuse cached tokens | {_f(ok)} |")
    if s and "greedy_tokens_equal" in s:
        L.append(f"| single-stream greedy tokens equal transformers | {_f(s['greedy_tokens_equal'])} |")
    if b:
        for key, name in (("transformers_generate_batch", "generate_batch"), ("transformers_generate_padded", "padded generate")):
            p = b.get(key) or {}
            if "rows_equal_to_kvkeeper_until_eos" in p:
                L.append(f"| batched: greedy rows equal to {name} (until kvkeeper's first EOS) | "
                         f"{p['rows_equal_to_kvkeeper_until_eos']} |")
    if R.get("errors"):
        L.append("\n## Errors\n")
        for k, v in R["errors"].items():
            L.append(f"- {k}: `{v[:500]}`")
    return "\n".join(L) + "\n"


# --------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (3 turns, small batch, short outputs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output folder")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--model", default=None, help="model id or GGUF path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--quantization", default=None,
                    help="kvkeeper's weight format for sections 2-6 (default: the engine's default for the file)")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["roofline", "formats", "multiturn", "short", "batched", "single", "long", "transformers",
                             "llama_cpp"],
                    help="skip a section or a peer (repeatable)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bc = BenchConfig.make(args.quick)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    questions = [json.loads(line) for line in (ROOT / "data" / "mt_bench" / "question.jsonl").read_text().splitlines()
                 if line.strip()]
    R: dict = {"quick": bc.quick, "config": bc.__dict__, "machine": machine_info(), "errors": {}}
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
    (out_dir / "engine_bench.json").write_text(json.dumps(R, indent=2, default=str) + "\n")
    (out_dir / "engine_bench.md").write_text(md)
    print(md)
    log(f"wrote {out_dir / 'engine_bench.json'} and {out_dir / 'engine_bench.md'} in {R['total_runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    with reporting():  # progress of the sections (and of a first model load) on stderr
        sys.exit(main())
