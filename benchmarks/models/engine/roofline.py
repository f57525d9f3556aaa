"""Section 1, the machine's roofline: copy and read bandwidth, fp32 matmul and GEMV rates, the C++ block matmul,
the model's costs per token and the decode / prefill limits they imply; the fractions of them kvkeeper reaches."""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.nn.functional as F

from kvkeeper import LLMEngine

from .base import BenchConfig, GB


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
        "kv_bytes_per_token": engine.kv.bytes_per_token,
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
