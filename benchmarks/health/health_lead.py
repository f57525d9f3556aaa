"""How early can a long-context breach be seen?  Queue signals against the trend forecast, on training traces (issue 29).

    python -m kvkeeper.eval.health.evaluate --seeds 0-11 --predictors trend --json /tmp/train.json \\
        --traces /tmp/train.jsonl.gz                      # the training traces (seeds 0-11)
    python benchmarks/health/health_lead.py --traces /tmp/train.jsonl.gz --json benchmarks/results/health_lead/health_lead-training-DATE.json

Two questions, on the training seeds only (refuses seeds above ``--max-seed``, default 99):

1. **The bound**: per ``longctx`` episode, the first sample after the onset with a long prefill queued
   (``prefill_backlog`` at least ``--evidence-tokens``, default 300; in the fault-free parts of every training
   trace the backlog never passes 40 tokens) and the breach: no predictor that reads the telemetry can warn
   before that evidence, since until the first long request arrives the incident has changed nothing the server
   can see.  ``breach - evidence`` bounds the lead.
2. **The signals**: the default trend predictor with an added near miss on the queue (the wait of the queue's
   oldest request without a first token, ``head_wait_s``, or the prompt tokens queued, ``prefill_backlog``), over
   a few levels each: precision, recall, median lead and false alarms an hour, per kind, scored like
   ``kvkeeper.eval.health.evaluate``.  Writes JSON and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from kvkeeper.diagnostics.health_predict import Forecast, TrendPredictor
from kvkeeper.eval.health.evaluate import read_training_traces
from kvkeeper.eval.health.score import score_episode, summarize


class QueueTrend(TrendPredictor):
    """The trend predictor, plus a near miss (no time given) while ``head_wait_s`` >= ``head`` s or
    ``prefill_backlog`` >= ``backlog`` tokens (None: that one off)."""

    def __init__(self, head: float | None = None, backlog: float | None = None):
        super().__init__()
        self.head, self.backlog = head, backlog

    def update(self, sample: dict) -> Forecast:
        fc = super().update(sample)
        if fc.warn:
            return fc
        if self.head is not None and (sample.get("head_wait_s") or 0) >= self.head:
            return Forecast(True, None, f"oldest queued request waiting {sample['head_wait_s']:.2f} s", "head_wait_s")
        if self.backlog is not None and (sample.get("prefill_backlog") or 0) >= self.backlog:
            return Forecast(True, None, f"{sample['prefill_backlog']} prompt tokens queued", "prefill_backlog")
        return fc


def bound(traces: list[dict], tokens: int) -> dict:
    rows = []
    for t in traces:
        if t["kind"] != "longctx" or t["breach_s"] is None:
            continue
        ev = next((s["t"] for s in t["samples"] if s["t"] >= t["onset_s"] and (s.get("prefill_backlog") or 0)
                   >= tokens), None)
        rows.append({"seed": t["seed"], "onset_s": t["onset_s"], "evidence_s": ev, "breach_s": t["breach_s"],
                     "bound_s": None if ev is None else round(t["breach_s"] - ev, 1)})
    b = [r["bound_s"] for r in rows if r["bound_s"] is not None]
    ff = max((s.get("prefill_backlog") or 0) for t in traces for s in t["samples"]
             if t["onset_s"] is None or s["t"] < t["onset_s"])
    return {"episodes": rows, "median_bound_s": statistics.median(b) if b else None,
            "max_backlog_fault_free_tokens": ff}


def variant(traces: list[dict], **kw) -> dict:
    rows = [score_episode(t, QueueTrend(**kw)) for t in traces]
    s = summarize(rows)
    s["per_kind_lead_s"] = {k: summarize([r for r in rows if r["kind"] == k])["median_lead_s"]
                            for k in sorted({r["kind"] for r in rows})}
    return {"settings": kw, **s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--evidence-tokens", type=int, default=300)
    ap.add_argument("--max-seed", type=int, default=99)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    traces = read_training_traces(ap, a.traces, a.max_seed, "tune", need_head_wait=True)
    res = {"seeds": sorted({t["seed"] for t in traces}), "bound": bound(traces, a.evidence_tokens),
           "evidence_tokens": a.evidence_tokens, "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
           "variants": [variant(traces, **kw) for kw in ({}, {"head": 1.8}, {"head": 1.2}, {"backlog": 300},
                                                          {"backlog": 500}, {"head": 1.2, "backlog": 300})]}
    out = Path(a.json)
    out.write_text(json.dumps(res, indent=1))
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    kinds = list(res["variants"][0]["per_kind_lead_s"])
    lines = [f"Long-context lead, training seeds {res['seeds'][0]}-{res['seeds'][-1]}: the first long prefill queued "
             f"(>= {a.evidence_tokens} tokens) comes a median {f(res['bound']['median_bound_s'])} s before the "
             f"breach (per episode: {', '.join(f(r['bound_s']) for r in res['bound']['episodes'])}); fault-free "
             f"backlog at most {res['bound']['max_backlog_fault_free_tokens']} tokens.\n",
             "| trend + near miss on | precision | recall | median lead (s) | false alarms / h | "
             + " | ".join(f"{k} lead" for k in kinds) + " |", "|---" * (5 + len(kinds)) + "|"]
    for v in res["variants"]:
        name = ", ".join(f"{k} {x}" for k, x in v["settings"].items()) or "(the default trend)"
        lines.append(f"| {name} | {f(v['precision'], 3)} | {f(v['recall'], 3)} | {f(v['median_lead_s'])} | "
                     f"{f(v['false_alarms_per_hour'], 2)} | " + " | ".join(f(v["per_kind_lead_s"][k]) for k in kinds)
                     + " |")
    md = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
