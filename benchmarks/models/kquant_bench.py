"""Micro-benchmark of the GGUF in-place matmul kernels (csrc/cpu/kquant.cpp, kq_matmul).

For each weight type (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, F16; --types picks) and shape N x K (output rows x row length: 2048x2048 and
8192x2048 by default) it times GEMV (M = 1, decode) and GEMM (M = 512, prefill) and reports GFLOP/s
(2 M N K / time) and the effective weight read bandwidth (GGUF bytes of W / time), next to torch's float32
matmul x @ W^T on the dequantized weight, and the machine's streaming bandwidth measured here (a big copy,
and a read-only sum), so that the GEMV figure can be read as a fraction of what memory can give.

    python benchmarks/models/kquant_bench.py [--shapes 2048x2048,8192x2048] [--m 1,512] [--seconds 1.0] [--out DIR]
        [--types Q4_K,Q8_0] [--threads 1] [--isa auto|generic|avx2|avx512]

Writes ``kquant_bench-<shape>-<date>.json`` and ``.md`` per shape into benchmarks/results/kquant_bench/ (or --out).  Times are
medians over repeated calls (at least --seconds per case after a warm-up call); the machine is shared, so
the load average at the start is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_model, result_name, write_report  # noqa: E402
from kvkeeper.kernels import cpu as cpu_kernels  # noqa: E402

TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_0": 8, "Q5_0": 6, "F16": 1}
BLOCK = {12: (256, 144), 13: (256, 176), 14: (256, 210), 8: (32, 34), 6: (32, 22), 1: (1, 2)}


def random_weight(t: int, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """(N, row_bytes) uint8 of valid random GGUF blocks (random codes, f16 scales in [1e-3, 1e-2])."""
    bs, ts = BLOCK[t]
    nb = N * K // bs
    if t == 1:
        return rng.standard_normal(N * K).astype(np.float16).view(np.uint8).reshape(N, -1)
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    f16 = lambda: rng.uniform(1e-3, 1e-2, size=nb).astype(np.float16).view(np.uint8).reshape(nb, 2)  # noqa: E731
    if t in (12, 13):
        raw[:, 0:2], raw[:, 2:4] = f16(), f16()
    elif t == 14:
        raw[:, 208:210] = f16()
    else:
        raw[:, 0:2] = f16()
    return raw.reshape(N, -1)


CPU_TIMES: list[float] = []  # the median process CPU time (all threads) of the last timeit


def timeit(fn, seconds: float) -> float:
    """Median wall time of fn over at least `seconds` (after a warm-up call); its median process CPU time
    goes to CPU_TIMES[-1] (on a busy machine a 1-thread run's CPU time excludes the time it was descheduled)."""
    fn()
    times, cpu = [], []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    CPU_TIMES.append(float(np.median(cpu)))
    return float(np.median(times))


def stream_bandwidth(seconds: float) -> dict:
    a = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB, far beyond the caches
    b = torch.empty_like(a)
    nbytes = a.numel() * 4
    t_copy = timeit(lambda: b.copy_(a), seconds)
    t_sum = timeit(lambda: a.sum(), seconds)
    return {"copy_GBps": nbytes / t_copy / 1e9, "copy_read_plus_write_GBps": 2 * nbytes / t_copy / 1e9,
            "read_sum_GBps": nbytes / t_sum / 1e9, "bytes": nbytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x2048,8192x2048", help="N x K list (output rows x row length)")
    ap.add_argument("--m", default="1,512", help="activation rows to time")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--seconds", type=float, default=1.0, help="time per case")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kquant_bench"))
    ap.add_argument("--quiet", action="store_true", help="print only the markdown")
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: torch's default)")
    ap.add_argument("--cold-mb", type=int, default=256, help="bytes of weight copies a cold GEMV rotates over")
    ap.add_argument("--cold-max-m", type=int, default=1, help="time M up to this also with cold weights")
    ap.add_argument("--isa", default="auto", choices=["auto", "generic", "avx2", "avx512"],
                    help="the kernels' instruction set (kq_set_isa; auto: avx512, else avx2, else generic)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the one OpenMP runtime torch and the extension share

    kq = cpu_kernels.load()
    if kq is None:
        raise SystemExit(f"the C++ kernels are unavailable: {cpu_kernels.unavailable_reason()} (make setup)")
    kq.kq_set_isa(args.isa)  # raises when this CPU lacks it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
    load0 = os.getloadavg()
    bw = stream_bandwidth(args.seconds)
    ms = [int(v) for v in args.m.split(",")]
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.lower().split("x"))
        rows = []
        fp32_done: dict[int, dict] = {}
        for name in args.types.split(","):
            t = TYPES[name]
            w = torch.from_numpy(random_weight(t, N, K, rng))
            wf = kq.kq_dequantize_rows(w, t, N, K)
            for M in ms:
                # GEMV also "cold": rotating over copies of W that together exceed the caches several times
                for cache in ("hot", "cold") if M <= args.cold_max_m else ("hot",):
                    x = torch.randn(M, K)
                    if cache == "cold":
                        ws = [w] + [w.clone() for _ in range(max(1, -(-args.cold_mb * 10**6 // w.numel())) - 1)]
                        wfs = [wf] + [wf.clone() for _ in range(max(1, -(-args.cold_mb * 10**6 // (4 * wf.numel()))) - 1)]
                    else:
                        ws, wfs = [w], [wf]
                    it = [0]

                    def run_kq():
                        it[0] += 1
                        return kq.kq_matmul(x, ws[it[0] % len(ws)], t, N, K)

                    def run_fp32():
                        it[0] += 1
                        return x @ wfs[it[0] % len(wfs)].T

                    s = timeit(run_kq, args.seconds)
                    cpu_s = CPU_TIMES[-1]
                    key = (M, cache)
                    if key not in fp32_done:
                        s32 = timeit(run_fp32, args.seconds)
                        fp32_done[key] = {"type": "fp32 (torch, dequantized)", "M": M, "cache": cache, "ms": s32 * 1e3,
                                          "cpu_ms": CPU_TIMES[-1] * 1e3,
                                          "GFLOPs": 2 * M * N * K / s32 / 1e9, "weight_MB": wf.numel() * 4 / 1e6,
                                          "GBps": wf.numel() * 4 / s32 / 1e9}
                    rows.append({"type": name, "M": M, "cache": cache, "ms": s * 1e3, "cpu_ms": cpu_s * 1e3,
                                 "GFLOPs": 2 * M * N * K / s / 1e9,
                                 "weight_MB": w.numel() / 1e6, "GBps": w.numel() / s / 1e9,
                                 "x_vs_fp32": fp32_done[key]["ms"] / (s * 1e3)})
                    if not args.quiet:
                        print(f"{shape} {name} M={M} {cache}: {s * 1e3:.3f} ms", file=sys.stderr)
        rows += list(fp32_done.values())
        res = {"shape": {"N": N, "K": K}, "date": date, "cpu": cpu_model(), "threads": torch.get_num_threads(),
               "cold_mb": args.cold_mb,
               "omp_threads_env": os.environ.get("OMP_NUM_THREADS"), "isa": kq.kq_isa(),
               "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(), "bandwidth": bw, "rows": rows}
        md = [f"## kquant_bench: N x K = {N} x {K} ({date}, {cpu_model()}, {torch.get_num_threads()} threads, "
              f"isa {kq.kq_isa()}, load average {load0[0]:.2f} at start)", "",
              f"Streaming: copy {bw['copy_GBps']:.1f} GB/s (read+write {bw['copy_read_plus_write_GBps']:.1f}), "
              f"read-only sum {bw['read_sum_GBps']:.1f} GB/s.", "",
              "| type | M | weights | ms | CPU ms | GFLOP/s | weight MB | weight GB/s | of read bw | speed-up vs fp32 |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            frac = r["GBps"] / bw["read_sum_GBps"]
            sp = f"{r['x_vs_fp32']:.2f}x" if "x_vs_fp32" in r else "1"
            md.append(f"| {r['type']} | {r['M']} | {r['cache']} | {r['ms']:.3f} | {r['cpu_ms']:.3f} | {r['GFLOPs']:.1f} | "
                      f"{r['weight_MB']:.2f} | {r['GBps']:.2f} | {frac:.0%} | {sp} |")
        md += ["", "hot: the same W every call (it may sit in the caches); cold: rotating over copies of W "
               f"({args.cold_mb} MB in all), so GEMV streams W from memory.  of read bw: weight GB/s over the "
               "read-only sum's GB/s.  ms: median wall time; CPU ms: median process CPU time, all threads (with "
               "--threads 1 on a busy machine, the time it ran).  GFLOP/s, GB/s and speed-ups from wall time."]
        suffix = (f"-t{args.threads}" if args.threads else "") + (f"-{args.isa}" if args.isa != "auto" else "")
        write_report(out, result_name("kquant_bench", f"{N}x{K}{suffix}"), res, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
