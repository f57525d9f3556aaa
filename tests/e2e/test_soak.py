"""The soak test's two-minute form (benchmarks/soak.py --minutes 2): simulated users with sessions, streaming,
hang-ups, n=2, offloads, deletes and a restart that restores the sessions from disk; the pass criteria hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from tests.utils.paths import ROOT



def test_two_minute_soak_passes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # two minutes of load, each server life one: its second half (30 s) is still warm-up (the allocator grows in
    # steps of a few MiB), so the bound here, 30 MiB/min, catches only gross leaks (the 30-minute run: 2 MiB/min)
    # the exact float32 path (weights and KV): its audit tolerance sits about ten times above the fp32 noise
    # measured over 652 soak audits, so a mismatch is a wrong block (the verdict carries the server log's lines); with the default gguf weights and bf16 KV the audit flags rounding on a few percent of long
    # prompts (README: Soak test)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "2", "--users", "3", "--sample-s", "2",
           "--rss-slope-bound", "100", "--max-tokens", "12",
           "--hangup-fraction", "0.3", "--offload-fraction", "0.3", "--out", str(tmp_path), "--name", "soak2",
           "--server-arg=--quantization", "--server-arg=none", "--server-arg=--kv-dtype", "--server-arg=fp32"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    res = json.loads((tmp_path / "soak2.json").read_text())
    v, c = res["verdict"], res["counts"]
    assert v["checks"]["no_5xx"], (c, res["errors"])
    assert v["checks"]["no_leaked_blocks_idle"], res["idle"]
    assert v["checks"]["zero_audit_mismatches"] and v["audits"] > 0, v
    assert v["checks"]["sessions_restored"] and res["restart"]["open_before"] > 0, res["restart"]
    assert v["checks"]["rss_flat"], res["rss"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the run did what the soak promises: sessions, streams, hang-ups, n=2, offloads and deletes all happened
    assert min(c["turns"], c["streamed"], c["hung_up"], c["n2"], c["offloads"], c["deletes"]) > 0, c
    # a graceful stop: uvicorn shuts down, the sessions are saved, and it re-raises SIGTERM (exit status -15)
    assert res["restart"]["exit_code"] in (0, -15) and len(res["rss"]) == 2
    s = res["samples"]
    assert s and all(x.get("rss_mib") and x.get("fds") and x.get("threads") for x in s)
    assert all(x.get(f"blocks_{st}") is not None for x in s for st in ("free", "cached", "owned"))
    assert res["latency"]["ttft_p50_s"] is not None and res["health"]["samples"] > 0
    assert (tmp_path / "soak2.png").stat().st_size > 10_000 and (tmp_path / "soak2.md").exists()
