"""What the KV cache's own operations cost: offload/restore (host, disk) against recomputing the prompt,
pool compaction, the reuse audit and the telemetry sample, with this machine's copy and disk bandwidth.

Usage: python benchmarks/kv/kvops_bench.py [--tokens 1000] [--repeats 3] [--out benchmarks/results/kvops_bench]
Writes kvops_bench-<config>-<date>.json and .md.  SmolLM2-135M-Instruct, fp32 weights and KV, CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import cpu_model, result_name, write_report  # noqa: E402

from kvkeeper import LLMEngine, SamplingParams, SessionManager  # noqa: E402
from kvkeeper.diagnostics.audit import audit_sequence  # noqa: E402
from kvkeeper.kvcache.block_pool import BlockPool  # noqa: E402
from kvkeeper.kvcache.telemetry import pool_stats  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"


def _t(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def machine_limits(tmp: Path) -> dict:
    x = torch.ones(256 << 20, dtype=torch.uint8)
    y = torch.zeros_like(x)
    copies = [_t(lambda: y.copy_(x))[0] for _ in range(5)]
    copy_gbs = 2 * x.numel() / min(copies) / 1e9  # read + write
    f = tmp / "disk-probe.bin"
    buf = os.urandom(64 << 20)

    def write():
        with open(f, "wb") as fh:
            fh.write(buf)
            fh.flush()
            os.fsync(fh.fileno())

    w = min(_t(write)[0] for _ in range(2))
    f.unlink()
    return {"copy_gb_s": round(copy_gbs, 2), "disk_write_fsync_gb_s": round(len(buf) / w / 1e9, 3)}


def sessions_of(eng) -> SessionManager:
    """The engine's session manager (the one main() attaches)."""
    return next(h for h in eng.kv.holders if isinstance(h, SessionManager))


def session_with(eng, n_tokens: int, sid: str, offset: int = 2000):
    """A session whose first turn holds about ``n_tokens`` tokens of the novel from word ``offset`` on."""
    words = TEXT.read_text(encoding="utf-8").split()
    msg = " ".join(words[offset:offset + int(n_tokens * 0.75)])
    s = sessions_of(eng).open(session_id=sid)
    s.send("Summarise this passage in one line:\n" + msg, SamplingParams(max_tokens=4, temperature=0))
    return s


def offload_restore(eng, tier: str, n_tokens: int, repeats: int) -> dict:
    store = sessions_of(eng).store
    off, back, nbytes = [], [], 0
    s = session_with(eng, n_tokens, f"bench-{tier}")
    ntok = s.num_tokens
    for _ in range(repeats):
        dt, _ = _t(lambda: s.offload(tier))
        rec = store.records[s.id]
        nbytes = rec.nbytes
        off.append(dt)
        dt, ok = _t(lambda: store.restore(s))
        assert ok, "restore failed"
        back.append(dt)
    s.close()
    return {"tokens": ntok, "bytes": nbytes, "offload_s": min(off), "restore_s": min(back),
            "offload_gb_s": nbytes / min(off) / 1e9, "restore_gb_s": nbytes / min(back) / 1e9}


def recompute_prefill(eng, n_tokens: int, repeats: int) -> dict:
    ts = []
    for r in range(repeats):
        s = session_with(eng, n_tokens, f"bench-recompute-{r}")
        ids = s.kv.token_ids[: s.kv.num_computed]
        s.close()
        ns = eng.isolated_namespace(f"recompute-{r}")
        seq = eng.add_request(ids + [ids[-1]], SamplingParams(max_tokens=1), namespace=ns)
        t0 = time.perf_counter()
        eng.run_until_done([seq])
        ts.append(time.perf_counter() - t0)
    return {"tokens": len(ids), "prefill_s": min(ts)}


def compaction(eng) -> dict:
    ss = [session_with(eng, 300, f"frag-{i}", offset=5000 + 400 * i) for i in range(8)]
    for s in ss[::2]:
        s.close()
    before = eng.kv.pool_stats()
    dt, res = _t(eng.kv.compact)
    after = eng.kv.pool_stats()
    moved_bytes = res["moved"] * eng.block_size * eng.kv.bytes_per_token
    for s in ss[1::2]:
        s.close()
    return {"owned_blocks": before.owned, "cached_blocks": before.cached, "cached_after": after.cached,
            "moved_blocks": res["moved"], "evicted": res["evicted"],
            "pool_rate_before": round(before.pool_rate, 3), "pool_rate_after": round(after.pool_rate, 3),
            "seconds": dt, "moved_gb_s": moved_bytes / dt / 1e9 if dt > 0 else None}


def audit_cost(eng, n_tokens: int, repeats: int) -> dict:
    """The audit recomputes the prompt in a private cache: compare it with a full prefill of the same ids."""
    ts, pre = [], []
    for r in range(repeats):
        s = session_with(eng, n_tokens, f"audit-{r}", offset=20000 + 700 * r)
        st = s.kv
        ids = st.token_ids[: st.num_computed]
        dt, rep = _t(lambda: audit_sequence(eng, st))
        assert rep.ok, rep.summary()
        ts.append(dt)
        s.close()
        seq = eng.add_request(ids, SamplingParams(max_tokens=1), namespace=eng.isolated_namespace(f"audit-{r}"))
        t0 = time.perf_counter()
        eng.run_until_done([seq])
        pre.append(time.perf_counter() - t0)
    return {"tokens": len(ids), "audit_s": min(ts), "prefill_s": min(pre), "ratio": min(ts) / min(pre)}


def telemetry_cost(eng) -> dict:
    out = {}
    dt = min(_t(eng.kv.pool_stats)[0] for _ in range(20))
    out[f"{eng.pool.num_blocks}_blocks_ms"] = dt * 1e3
    big = BlockPool(22528, 16)
    tables = [big.allocate(50) for _ in range(200)]
    from types import SimpleNamespace

    owners = [("x", SimpleNamespace(block_table=t, num_computed=790, kv_offset=0)) for t in tables]
    out["22528_blocks_ms"] = min(_t(lambda: pool_stats(big, owners))[0] for _ in range(10)) * 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000, help="session length for offload/restore (tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kvops_bench")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        limits = machine_limits(tmp)
        eng = LLMEngine(validate_every=0, quantization="none", kv_dtype="fp32")  # the exact path (docstring)
        SessionManager(eng, data_dir=tmp / "data")
        res = {"machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), **limits},
               "kv_bytes_per_token": eng.kv.bytes_per_token, "kv_dtype": str(eng.runner.kv_format.storage),
               "weight_format": eng.runner.weight_format,
               "recompute": recompute_prefill(eng, args.tokens, args.repeats),
               "host": offload_restore(eng, "host", args.tokens, args.repeats),
               "disk": offload_restore(eng, "disk", args.tokens, args.repeats),
               "compaction": compaction(eng),
               "audit": audit_cost(eng, 500, args.repeats),
               "telemetry": telemetry_cost(eng)}
    rc, h, d = res["recompute"], res["host"], res["disk"]
    m = res["machine"]
    md = [f"# KV operations ({m['cpu']}, {m['threads']} threads)", "",
          f"Machine: copy {m['copy_gb_s']} GB/s (read+write), disk write+fsync {m['disk_write_fsync_gb_s']} GB/s. "
          f"KV {res['kv_bytes_per_token']} bytes/token ({res['kv_dtype']}, weights {res['weight_format']}).", "",
          "| operation | tokens | bytes | seconds | GB/s | vs recompute (prefill) |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in (("host offload", h), ("host restore", h), ("disk offload", d), ("disk restore", d)):
        key = "offload" if "offload" in name else "restore"
        md.append(f"| {name} | {r['tokens']} | {r['bytes']:,} | {r[key + '_s']:.4f} | {r[key + '_gb_s']:.2f} | "
                  f"{rc['prefill_s'] / r[key + '_s']:.1f}x faster |")
    md.append(f"| recompute (prefill) | {rc['tokens']} | | {rc['prefill_s']:.3f} | | 1x |")
    c = res["compaction"]
    md += ["", f"Compaction: {c['moved_blocks']} blocks moved ({c['owned_blocks']} owned and {c['cached_blocks']} "
           f"unreferenced cached blocks renumbered) in {c['seconds'] * 1e3:.1f} ms ({c['moved_gb_s'] or 0:.2f} GB/s), "
           f"fragmentation rate {c['pool_rate_before']} -> {c['pool_rate_after']}, {c['evicted']} cached blocks "
           f"evicted, {c['cached_after']} still cached.", ""]
    a = res["audit"]
    md += [f"Reuse audit of a {a['tokens']}-token prompt (recompute in a private cache, compare logits and 30 "
           f"layers of K/V): {a['audit_s']:.3f} s, {a['ratio']:.2f}x a full prefill of the same ids "
           f"({a['prefill_s']:.3f} s).", ""]
    t = res["telemetry"]
    md += ["Telemetry sample (`pool_stats`): " + ", ".join(f"{k.replace('_ms', '')}: {v:.2f} ms" for k, v in t.items()), ""]
    write_report(args.out, result_name("kvops_bench"), res, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
