"""Choose the trend predictor's settings on the training seeds' traces (issue 29), never on held-out seeds.

    python -m kvkeeper.eval.health.evaluate --seeds 0-11 --predictors trend --json /tmp/train.json \\
        --traces /tmp/train.jsonl.gz                      # the tuning traces (seeds 0-11)
    python -m kvkeeper.eval.health.tune_trend --traces /tmp/train.jsonl.gz [--json OUT]

A grid over ``gate``, ``window``, ``min_t``, ``near_miss`` and ``horizon_s`` of
:class:`~kvkeeper.diagnostics.health_predict.TrendConfig`, each point scored on the traces by
:mod:`kvkeeper.eval.health.score`.  The chosen point: precision and recall at least 0.9 and false alarms per hour
at most ``--max-fa-per-hour`` (default 1, the target), then the longest median lead.  Refuses traces whose seeds reach ``--max-seed`` (default 99: held-out seeds start at 100).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from ...diagnostics.health_predict import TrendConfig, TrendPredictor
from .evaluate import read_training_traces
from .score import score_episode, summarize

RESULTS_NAME = "health_tune_trend"  # its reports' folder and name prefix under benchmarks/results/

GRID = {"gate": (0.28, 0.3, 0.32, 0.35), "window": (10, 12, 16, 20), "min_t": (1.0, 1.5, 2.0),
        "half_ratio": (0.5,), "near_miss": (0.6,), "horizon_s": (90.0, 120.0)}


def evaluate(traces: list[dict], **kw) -> dict:
    rows = [score_episode(t, TrendPredictor(TrendConfig(**kw))) for t in traces]
    out = summarize(rows)
    kinds = sorted({r["kind"] for r in rows})
    out["per_kind_lead_s"] = {k: summarize([r for r in rows if r["kind"] == k])["median_lead_s"] for k in kinds}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--max-fa-per-hour", type=float, default=1.0)
    ap.add_argument("--max-seed", type=int, default=99)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    traces = read_training_traces(ap, a.traces, a.max_seed, "tune")
    results = []
    for values in itertools.product(*GRID.values()):
        kw = dict(zip(GRID, values))
        r = evaluate(traces, **kw)
        results.append({"settings": kw, **r})
        print(json.dumps({**kw, **{k: r[k] for k in ("precision", "recall", "median_lead_s", "false_alarms_per_hour")}}),
              flush=True)
    ok = [r for r in results if (r["precision"] or 0) >= 0.9 and (r["recall"] or 0) >= 0.9
          and (r["false_alarms_per_hour"] or 0) <= a.max_fa_per_hour]
    best = max(ok, key=lambda r: r["median_lead_s"] or 0) if ok else None
    print("chosen:", json.dumps(best and {k: best[k] for k in ("settings", "precision", "recall", "median_lead_s",
                                                                  "false_alarms_per_hour", "per_kind_lead_s")}))
    if a.json:
        Path(a.json).write_text(json.dumps({"chosen": best, "grid": results}, indent=1))
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
