"""Numerical noise the reuse audit must tolerate: per-token relative K/V difference between reused and recomputed KV.

Runs MT-Bench two-turn sessions on the default engine (gguf weights, bf16 KV) with the reuse audit on every request
and a tolerance too loose to fire, and records, per audited request, the largest (|stored - recomputed| - 0.01) /
max|recomputed| of any token and layer (the quantity :func:`kvkeeper.diagnostics.audit.default_tolerance`'s
``kv_rtol`` bounds), and the largest logits difference.  Writes benchmarks/results/audit_noise/audit_noise-smollm2-135m-<date>.{json,md}.

    python benchmarks/kv/audit_noise.py [--sessions 40] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # common

from kvkeeper import LLMEngine, SamplingParams  # noqa: E402
from kvkeeper.diagnostics import audit as A  # noqa: E402
from kvkeeper.diagnostics.audit import AuditTolerance, ReuseAuditor, default_tolerance  # noqa: E402
from kvkeeper.sessions import SessionManager  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    rels: list[float] = []
    first_divergence = A._first_divergence

    def record(stored, ref, tol):
        err = (stored - ref).abs().flatten(1).amax(dim=1)
        scale = ref.abs().flatten(1).amax(dim=1).clamp(min=1e-6)
        rels.append(float(((err - 1e-2).clamp(min=0) / scale).max()))
        return first_divergence(stored, ref, tol)

    A._first_divergence = record
    eng = LLMEngine(validate_every=0)
    default = default_tolerance(eng.runner.dtype, eng.runner.kv_format, eng.runner.weight_format)
    eng.auditor = ReuseAuditor(1.0, tolerance=AuditTolerance(1e-2, 10.0, 100.0)).attach(eng)
    qs = [json.loads(ln) for ln in (ROOT / "data" / "mt_bench" / "question.jsonl").read_text().splitlines() if ln]
    manager, per_request = SessionManager(eng), []
    for q in qs[: args.sessions]:
        s = manager.open()
        for turn in q["turns"]:
            before = len(rels)
            s.send(turn, SamplingParams(max_tokens=args.max_tokens))
            per_request.append(max(rels[before:], default=0.0))
        s.close()
    logits = [r.logits_max_abs_diff for r in eng.auditor.reports if r.logits_max_abs_diff is not None]
    out = {"weights": eng.runner.weight_description, "kv": eng.runner.kv_format.name, "audits": eng.auditor.total,
           "sessions": args.sessions, "max_tokens": args.max_tokens, "max_kv_rel": max(per_request),
           "max_logits": max(logits), "default_kv_rtol": default.kv_rtol, "default_logits_atol": default.logits_atol}
    from common import result_path

    result_path("audit_noise").parent.mkdir(parents=True, exist_ok=True)
    result_path("audit_noise").write_text(json.dumps(out, indent=1))
    result_path("audit_noise", suffix=".md").write_text(
        "| weights | KV | audits | max K/V relative difference | max logits difference | default kv_rtol | "
        "default logits_atol |\n|---|---|---|---|---|---|---|\n"
        f"| {out['weights']} | {out['kv']} | {out['audits']} | {out['max_kv_rel']:.4f} | {out['max_logits']:.3f} | "
        f"{out['default_kv_rtol']} | {out['default_logits_atol']} |\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
