#!/usr/bin/env python
"""Reuse-audit noise of KIVI int4 / int2 KV (the measurement behind their tolerances in
:func:`kvkeeper.diagnostics.audit.default_tolerance`).

MT-Bench two-turn sessions on SmolLM2-135M with fp32 weights (the test suite's engine) and the given KV dtype, the
reuse audit on every request with a tolerance too loose to fire; prints and writes the largest per-layer relative
K/V difference (``kv_max_rel_diff``) and logits difference over all audits.  Writes
``benchmarks/results/kivi_audit_noise/kivi_audit_noise-<kv dtype>-<date>.json``.

    PYTHONPATH=src:. python benchmarks/kv/kivi_audit_noise.py int4 [--sessions 2] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import result_path  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kv_dtype")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    from kvkeeper import LLMEngine, SamplingParams
    from kvkeeper.diagnostics.audit import AuditTolerance, ReuseAuditor
    from kvkeeper.sessions import SessionManager

    root = Path(__file__).resolve().parents[2]
    mt = [json.loads(x) for x in (root / "data" / "mt_bench" / "question.jsonl").read_text().splitlines() if x.strip()]
    eng = LLMEngine(quantization="none", num_kv_blocks=400, kv_dtype=args.kv_dtype)
    eng.auditor = ReuseAuditor(1.0, tolerance=AuditTolerance(kv_atol=1e9, kv_rtol=1e9, logits_atol=1e9)).attach(eng)
    worst_kv = worst_lg = 0.0
    t = time.time()
    for q in mt[: args.sessions]:
        s = SessionManager(eng).open()
        for turn in q["turns"]:
            s.send(turn, SamplingParams(max_tokens=args.max_tokens))
        s.close()
        for r in eng.auditor.reports:
            worst_kv, worst_lg = max(worst_kv, r.kv_max_rel_diff), max(worst_lg, r.logits_max_abs_diff)
        eng.auditor.reports.clear()
    res = {"kv_dtype": args.kv_dtype, "sessions": args.sessions, "audits": eng.auditor.total,
           "max_kv_rel_diff": worst_kv, "max_logits_abs_diff": worst_lg, "seconds": time.time() - t,
           "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    out = result_path("kivi_audit_noise", args.kv_dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
