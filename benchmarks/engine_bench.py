#!/usr/bin/env python
"""kvkeeper engine benchmark: roofline, multi-turn TTFT, batched and single-stream decode, against peers.

Sections (all measured in one run, on this machine, with the same SmolLM2-135M-Instruct GGUF in fp32):

1. Roofline of the machine: memory copy bandwidth, fp32 matmul FLOP/s, fp32 GEMV weight-streaming bandwidth,
   and the decode / prefill limits they imply for the model.  kvkeeper's numbers are reported as fractions.
2. Multi-turn TTFT: one conversation over MT-Bench first-turn questions.  kvkeeper reuses the conversation's KV
   across turns (Session); transformers re-prefills the same prompt token ids from scratch each turn;
   kvkeeper without reuse (isolated namespace) is the internal baseline; llama.cpp (llama-cpp-python) if installed.
3. Batched decode: N concurrent chat prompts, M new tokens each (EOS ignored).  kvkeeper vs transformers
   ``generate_batch`` (continuous batching) and padded ``generate``.
4. Single-stream decode: one prompt, K new tokens.  kvkeeper vs transformers ``generate`` (timed with a streamer).

Every comparison is a measured ratio next to its target; nothing is hard-coded.

Usage::

    .venv/bin/python benchmarks/engine_bench.py            # full run (a quiet machine, a few minutes)
    .venv/bin/python benchmarks/engine_bench.py --quick    # tiny smoke run
    .venv/bin/python benchmarks/engine_bench.py --out DIR --threads 4

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

GB = 1e9

# Targets (kvkeeper / peer), stated in the report next to the measured ratio.
TARGET_MULTITURN_LAST_TURN = 20.0   # transformers TTFT / kvkeeper TTFT at the last (10th) turn
TARGET_BATCHED_VS_GENERATE_BATCH = 2.0  # kvkeeper total tok/s / transformers generate_batch tok/s
TARGET_SINGLE_STREAM = 1.5          # kvkeeper decode tok/s / transformers generate decode tok/s


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

    @classmethod
    def make(cls, quick: bool) -> "BenchConfig":
        if quick:
            return cls(True, turns=3, reply_tokens=32, batch=4, batch_new_tokens=16, single_new_tokens=16,
                       copy_mib=128, mm_n=1024, mm_reps=3, copy_reps=3, gemv_reps=2)
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


def model_costs(engine: LLMEngine) -> dict:
    cfg = engine.model_config
    model = engine.runner.model
    elt = engine.runner.dtype.itemsize if hasattr(engine.runner.dtype, "itemsize") else 4
    params_total = sum(p.numel() for p in model.parameters())
    embed = cfg.vocab_size * cfg.hidden_size
    # decode reads every weight once per step; the embedding table only one row, unless it doubles as lm_head
    decode_params = params_total - (0 if cfg.tie_word_embeddings else embed)
    # prefill multiplies every prompt token by all matrices except the embedding / lm_head
    # (logits are computed for the last token only)
    params_matmul = params_total - embed - (0 if cfg.tie_word_embeddings else embed)
    return {
        "params_total": params_total,
        "params_per_prefill_token": params_matmul,
        "lm_head_params": embed,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype_bytes": elt,
        "weight_bytes_per_decode_step": decode_params * elt,
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


def roofline_prefill_s(mc: dict, roof: dict, n_new: int, n_ctx: int) -> float:
    """Lower bound on the time to prefill: max(compute at matmul FLOP/s, one pass over the weights at GEMV BW)."""
    flop_s = roof["matmul"]["gflop_per_s"] * 1e9
    bw = roof["gemv"]["gb_per_s"] * GB
    kv_bytes = mc["kv_bytes_per_token"] * (n_ctx + n_new)
    return max(prefill_flops(mc, n_new, n_ctx) / flop_s, (mc["weight_bytes_per_decode_step"] + kv_bytes) / bw)


def roofline_decode_tok_s(mc: dict, roof: dict, streams: int, ctx: int) -> float:
    """Upper bound on decode tokens/s for `streams` sequences of about `ctx` tokens each."""
    flop_s = roof["matmul"]["gflop_per_s"] * 1e9
    bw = roof["gemv"]["gb_per_s"] * GB
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


def load_llama_cpp(engine: LLMEngine):
    """(Llama or None, status string).  Never installs anything."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, "not installed (llama-cpp-python not importable)"
    try:
        llm = Llama(model_path=str(engine.model_path), n_ctx=4096, verbose=False, n_threads=torch.get_num_threads())
        return llm, "ok"
    except Exception as e:  # noqa: BLE001
        return None, f"load failed: {_err(e)}"


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
def bench_multiturn(engine: LLMEngine, hf, llm, llm_status: str, questions: list[dict], bc: BenchConfig) -> dict:
    user_turns = [q["turns"][0] for q in questions[: bc.turns]]
    # warm-up of the engine's kernels (isolated namespace: nothing cached for the session)
    engine.generate([engine.encode_chat([{"role": "user", "content": "Hello there!"}])],
                    SamplingParams(max_tokens=8), namespace=engine.isolated_namespace("warm"))
    sess = SessionManager(engine).open(params=SamplingParams(max_tokens=bc.reply_tokens))
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
    return {
        "user_turns_from": "data/mt_bench/question.jsonl, first-turn questions "
                           f"{[q['question_id'] for q in questions[: bc.turns]]}",
        "reply_max_tokens": bc.reply_tokens,
        "llama_cpp": llama_rows_status,
        "turns": rows,
        "target": {"metric": f"transformers TTFT / kvkeeper TTFT at turn {last['turn']}",
                   "target": TARGET_MULTITURN_LAST_TURN, "measured": ratio,
                   "met": None if ratio is None else ratio >= TARGET_MULTITURN_LAST_TURN,
                   "note": "target defined for turn 10 of the full run" if bc.quick else ""},
        "first_token_agrees_all_turns": all(r["first_token_agrees"] for r in rows),
    }


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
def bench_single(engine: LLMEngine, hf, question: dict, bc: BenchConfig) -> dict:
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
    r = _ratio(o.decode_tok_per_s, (res.get("transformers_generate") or {}).get("decode_tok_per_s"))
    res["ratio_kvkeeper_over_transformers"] = r
    res["target"] = {"metric": "kvkeeper decode tok/s / transformers generate decode tok/s",
                     "target": TARGET_SINGLE_STREAM, "measured": r,
                     "met": None if r is None else r >= TARGET_SINGLE_STREAM}
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
    L.append(f"| model | {R['model']['path']} (fp32, dequantised GGUF; same file for every engine) |")
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
    for sec, key in (("2. multi-turn TTFT", "multiturn"), ("3. batched decode", "batched"),
                     ("4. single-stream decode", "single_stream")):
        t = (R.get(key) or {}).get("target")
        if t:
            note = f" ({t['note']})" if t.get("note") else ""
            L.append(f"| {sec} | {t['metric']}{note} | >= {t['target']:g}x | {_f(t['measured'], 2, 'x')} | {_met(t)} |")
        else:
            err = (R.get("errors") or {}).get(key)
            L.append(f"| {sec} | {'(failed: ' + err[:200] + ')' if err else '(skipped)'} | | | n/a |")
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
        L.append(f"| fp32 GEMV weight streaming | {g['gb_per_s']:.1f} GB/s | {g['gb_per_s_median']:.1f} GB/s | "
                 f"x(1,in) @ W.T over {g['matrices']} distinct matrices shaped like the model, "
                 f"{g['bytes'] / 1e6:.0f} MB, {g['reps']} reps |")
        pr = roof.get("small_m_probe")
        if pr:
            L.append(f"| small-M GEMM probe (4x576 @ 576x3072) | main thread {pr['main_thread_ms']:.2f} ms | "
                     f"helper thread {pr['helper_thread_ms']:.2f} ms | main/helper {pr['main_over_helper']:.1f}x "
                     "(>> 1: OpenMP threads stalled by a busy machine) |")
        L.append("")
        L.append("| model cost (SmolLM2-135M, fp32) | value |\n|---|---|")
        L.append(f"| parameters | {mc['params_total'] / 1e6:.1f} M (tied embeddings: {mc['tie_word_embeddings']}) |")
        L.append(f"| weight bytes read per decode step | {mc['weight_bytes_per_decode_step'] / 1e6:.0f} MB "
                 f"(+ {mc['kv_bytes_per_token']} B KV per context token) |")
        L.append(f"| prefill FLOP per token (matmuls, 2 x {mc['params_per_prefill_token'] / 1e6:.1f} M) | "
                 f"{2 * mc['params_per_prefill_token'] / 1e6:.0f} MFLOP (+ attention, + one lm_head row per prompt) |")
        d = R["roofline_limits"]
        L.append(f"| decode limit, 1 stream, empty context (weight bytes / GEMV BW) | {d['decode_tok_s_ctx0']:.1f} tok/s |")
        L.append(f"| prefill limit (2 x all params per token / matmul FLOP/s) | {d['prefill_tok_s_2xparams']:.0f} tok/s |")
        L.append(f"| prefill limit (2 x matmul params per token / matmul FLOP/s) | {d['prefill_tok_s_matmul']:.0f} tok/s |")
        L.append("")
        if R.get("roofline_fractions"):
            L.append("| kvkeeper vs roofline | kvkeeper | limit | fraction of limit |\n|---|---|---|---|")
            for r in R["roofline_fractions"]:
                L.append(f"| {r['what']} | {r['kvkeeper']:.1f} {r['unit']} | {r['limit']:.1f} {r['unit']} | "
                         f"{100 * r['fraction']:.0f}% |")
            L.append("\nLimits: decode = max(bytes/GEMV-BW, FLOPs/matmul-rate) per step with the KV of the "
                     "context included; prefill = max(FLOPs incl. causal attention / matmul rate, one weight pass / "
                     "GEMV BW).")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('roofline')}")
    L.append("")

    # multi-turn
    mt = R.get("multiturn")
    L.append("## 2. Multi-turn TTFT\n")
    if mt:
        L.append(f"User turns: {mt['user_turns_from']}; greedy replies, max_tokens={mt['reply_max_tokens']}. "
                 "kvkeeper: one Session with KV reuse. No-reuse: the same prompt ids in an isolated namespace. "
                 "transformers: the same prompt ids re-prefilled from scratch, `generate(max_new_tokens=1)`, "
                 "timed once after one warm-up on the same ids. llama.cpp: " + mt["llama_cpp"] + ".\n")
        has_llama = any(r.get("llama_cpp_ttft_s") is not None for r in mt["turns"])
        hdr = ("| turn | history tokens | cached | new | kvkeeper TTFT ms | no-reuse TTFT ms | transformers TTFT ms "
               "| transformers / kvkeeper | no-reuse / kvkeeper |")
        sep = "|---|---|---|---|---|---|---|---|---|"
        if has_llama:
            hdr += " llama.cpp TTFT ms | llama.cpp / kvkeeper |"
            sep += "---|---|"
        hdr += " first token agrees |"
        sep += "---|"
        L += [hdr, sep]
        for r in mt["turns"]:
            line = (f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['new_tokens']} | "
                    f"{_ms(r['kvkeeper_ttft_s'])} | {_ms(r.get('noreuse_ttft_s'))} | {_ms(r.get('transformers_ttft_s'))} | "
                    f"{_f(r['ratio_transformers_over_kvkeeper'], 1, 'x')} | {_f(r['ratio_noreuse_over_kvkeeper'], 1, 'x')} |")
            if has_llama:
                line += f" {_ms(r.get('llama_cpp_ttft_s'))} | {_f(r.get('ratio_llama_cpp_over_kvkeeper'), 1, 'x')} |"
            line += f" {_f(r['first_token_agrees'])} |"
            L.append(line)
        t = mt["target"]
        L.append(f"\nTarget: {t['metric']} >= {t['target']:g}x; measured {_f(t['measured'], 1, 'x')}: {_met(t)}"
                 + (f" ({t['note']})" if t.get("note") else "") + ".")
        L.append("kvkeeper TTFT runs from queueing the request to its first sampled token; the chat-template "
                 "rendering and tokenisation before it are not counted (the peers get pre-tokenised ids too).")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('multiturn')}")
    L.append("")

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
        t = s["target"]
        L.append(f"\nTarget: {t['metric']} >= {t['target']:g}x; measured {_f(t['measured'], 2, 'x')}: {_met(t)}.")
        if "greedy_tokens_equal" in s:
            L.append(f"\nGreedy tokens kvkeeper == transformers: {_f(s['greedy_tokens_equal'])} "
                     f"({s['greedy_compared_tokens']} tokens compared; {s['greedy_note']}).")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('single_stream')}")
    L.append("")

    # correctness
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
    ap.add_argument("--skip", action="append", default=[],
                    choices=["roofline", "multiturn", "batched", "single", "transformers"],
                    help="skip a section (repeatable)")
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
    engine = LLMEngine(args.model)
    R["model"] = {"path": str(engine.model_path), "kvkeeper_load_s": time.perf_counter() - t0}
    mc = model_costs(engine)
    R["model_costs"] = mc

    if "roofline" not in args.skip:
        log("roofline measurements")
        try:
            roof = measure_roofline(bc, linear_shapes(engine.model_config))
            R["roofline"] = roof
            flop_s = roof["matmul"]["gflop_per_s"] * 1e9
            R["roofline_limits"] = {
                "decode_tok_s_ctx0": roofline_decode_tok_s(mc, roof, 1, 0),
                "prefill_tok_s_2xparams": flop_s / (2 * mc["params_total"]),
                "prefill_tok_s_matmul": flop_s / (2 * mc["params_per_prefill_token"]),
            }
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            R["errors"]["roofline"] = _err(e)

    hf = None
    if "transformers" not in args.skip:
        log("loading transformers reference model")
        try:
            hf, R["model"]["transformers_load_s"] = load_transformers(engine)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            R["errors"]["transformers_load"] = _err(e)
    llm, llm_status = load_llama_cpp(engine)
    R["llama_cpp"] = llm_status

    # generate_batch may switch the transformers model's attention implementation: batched runs last
    sections = [("multiturn", "multiturn", lambda: bench_multiturn(engine, hf, llm, llm_status, questions, bc)),
                ("single", "single_stream", lambda: bench_single(engine, hf, questions[16], bc)),
                ("batched", "batched", lambda: bench_batched(engine, hf, questions, bc))]
    for skip_name, key, fn in sections:
        if skip_name in args.skip:
            continue
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
    sys.exit(main())
