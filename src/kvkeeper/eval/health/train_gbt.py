"""Train the cache-health gradient-boosted trees (kvkeeper.diagnostics.health_predict.GbtPredictor) on generated traces.

    python -m kvkeeper.eval.health.evaluate --seeds 0-11 --predictors trend --json /tmp/train.json \\
        --traces /tmp/train.jsonl.gz                      # the training traces (seeds 0-11)
    python -m kvkeeper.eval.health.train_gbt --traces /tmp/train.jsonl.gz [--out src/kvkeeper/diagnostics/health_gbt.json]

Needs scikit-learn (the ``train`` extra: ``pip install 'kvkeeper[train]'``); serving does not (the trees are
exported to JSON and walked in plain Python).  Windows of ``--window`` samples
(:func:`~kvkeeper.diagnostics.health_predict.window_features`) from the training seeds' traces, labelled 1 when
the episode's recorded breach lies within the horizon of the window's last sample (samples after a breach left
out).  ``GradientBoostingClassifier`` (Friedman 2001; ``random_state=0``, no subsampling: the same traces give the
same trees).  The horizon (``--horizons``), the warning threshold and the number of samples in a row it must
hold (``confirm``) are chosen by cross-validation over the seeds (``--folds`` groups of seeds; each fold's trees
score the episodes of seeds they were not fitted on, with :mod:`kvkeeper.eval.health.score`): precision and
recall at least 0.9 and at most ``--max-fa-per-hour`` false alarms an hour, then the longest median lead (the
rule of ``kvkeeper.eval.health.tune_trend``); failing that, the best F1.  The final trees are fitted on all the
training seeds.  Refuses traces whose seeds reach ``--max-seed`` (default 99: held-out seeds start at 100).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ...diagnostics.health_predict import (GBT_MODEL, GBT_SIGNALS, GBT_STATS, Forecast, Predictor,
                                          TreesAndTrendPredictor, gbt_raw, window_features)
from .evaluate import read_training_traces
from .score import score_episode, summarize

RESULTS_NAME = "health_train_gbt"  # its reports' folder and name prefix under benchmarks/results/

PARAMS = {"n_estimators": 150, "max_depth": 3, "learning_rate": 0.1, "subsample": 1.0, "random_state": 0}


def episode_windows(tr: dict, window: int, signals=GBT_SIGNALS) -> tuple[list[list[float]], list[float]]:
    """(feature rows, their samples' times) of every full window of one trace, up to its breach."""
    xs, ts = [], []
    s, br = tr["samples"], tr["breach_s"]
    for i in range(window - 1, len(s)):
        if br is not None and s[i]["t"] > br:
            break
        xs.append(window_features(s[i - window + 1: i + 1], signals))
        ts.append(s[i]["t"])
    return xs, ts


def labels(tr: dict, ts: list[float], horizon_s: float) -> list[int]:
    br = tr["breach_s"]
    return [int(br is not None and br - t <= horizon_s) for t in ts]


def fit(x, y):
    from sklearn.ensemble import GradientBoostingClassifier

    return GradientBoostingClassifier(**PARAMS).fit(x, y)


def export(model, window: int, horizon_s: float, signals=GBT_SIGNALS) -> dict:
    """The fitted classifier as the JSON :func:`~kvkeeper.diagnostics.health_predict.load_gbt` reads."""
    import numpy as np

    trees = []
    for est in model.estimators_[:, 0]:
        t = est.tree_
        trees.append({"left": t.children_left.tolist(), "right": t.children_right.tolist(),
                      "feature": t.feature.tolist(), "threshold": [float(v) for v in t.threshold],
                      "value": [float(v) for v in t.value[:, 0, 0]]})
    # the raw score's constant (the prior log-odds): decision_function minus the trees' sum, at any row
    zero = np.zeros((1, len(signals) * len(GBT_STATS)))
    tree_sum = sum(float(e.predict(zero)[0]) for e in model.estimators_[:, 0])
    init = float(model.decision_function(zero)[0]) - model.learning_rate * tree_sum
    return {"init": init, "learning_rate": model.learning_rate, "trees": trees, "window": window,
            "horizon_s": horizon_s, "threshold": 0.5, "confirm": 1,
            "signals": list(signals), "features": [f"{k}.{st}" for k in signals for st in GBT_STATS],
            "params": PARAMS}


class _Replay(Predictor):
    """Forecasts from precomputed probabilities (the GbtPredictor's rule: ``confirm`` in a row at ``threshold``)."""

    name = "gbt"

    def __init__(self, probs: dict[float, float], threshold: float, confirm: int, horizon_s: float):
        self.probs, self.th, self.confirm, self.h = probs, threshold, confirm, horizon_s
        self._run = 0

    def update(self, sample: dict) -> Forecast:
        p = self.probs.get(sample["t"])
        self._run = self._run + 1 if p is not None and p >= self.th else 0
        return Forecast(self._run >= self.confirm, self.h if self._run >= self.confirm else None, "", "gbt")


def _either(trees: Predictor, backstop_s: float) -> Predictor:
    """The server's ``gbt_trend``: the replayed trees backed by the trend's forecast of a breach within
    ``backstop_s`` seconds."""
    return TreesAndTrendPredictor(trees, backstop_s)


def choose(results: list[dict], max_fa: float) -> dict:
    ok = [r for r in results if (r["precision"] or 0) >= 0.9 and (r["recall"] or 0) >= 0.9
          and (r["false_alarms_per_hour"] or 0) <= max_fa]
    if ok:
        return max(ok, key=lambda r: (r["median_lead_s"] or 0, -r["false_alarms_per_hour"]))

    def f1(r):
        p, q = r["precision"] or 0, r["recall"] or 0
        return 2 * p * q / (p + q) if p + q else 0

    return max(results, key=f1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--horizons", default="60,90", help="horizons (s) tried for the labels")
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--max-fa-per-hour", type=float, default=1.0)
    ap.add_argument("--max-seed", type=int, default=99)
    ap.add_argument("--out", default=str(GBT_MODEL))
    ap.add_argument("--json", help="also write the cross-validation grid here")
    ap.add_argument("--signals", default=",".join(GBT_SIGNALS), help="sample fields the trees read")
    ap.add_argument("--thresholds", default="0.3,0.4,0.5,0.6,0.7,0.8,0.9,0.95,0.97,0.99",
                    help="warning thresholds tried (probabilities)")
    ap.add_argument("--confirms", default="1,2,3,5,8", help="samples in a row tried")
    ap.add_argument("--save-oof", help="write the out-of-fold probabilities (per horizon, trace and sample time) here")
    ap.add_argument("--with-trend", action="store_true",
                    help="choose the threshold and run length for the trees backed by the trend (gbt_trend)")
    ap.add_argument("--backstop-s", type=float, default=20.0, help="with --with-trend: the trend's horizon (s)")
    a = ap.parse_args(argv)
    signals = tuple(a.signals.split(","))
    import numpy as np

    t0 = time.time()
    traces = read_training_traces(ap, a.traces, a.max_seed, "train", need_head_wait=True)
    seeds = sorted({t["seed"] for t in traces})
    folds = [seeds[i::a.folds] for i in range(a.folds)]
    wins = [episode_windows(t, a.window, signals) for t in traces]
    print(f"{len(traces)} traces, seeds {seeds}, {sum(len(w[0]) for w in wins)} windows", flush=True)
    grid, oof = [], {}
    for h in [float(v) for v in a.horizons.split(",")]:
        probs: list[dict] = [dict() for _ in traces]  # out-of-fold probability per sample time
        for fold in folds:
            tr_idx = [i for i, t in enumerate(traces) if t["seed"] not in fold]
            x = np.array([r for i in tr_idx for r in wins[i][0]], dtype=np.float64)
            y = np.array([v for i in tr_idx for v in labels(traces[i], wins[i][1], h)])
            m = fit(x, y)
            for i, t in enumerate(traces):
                if t["seed"] in fold and wins[i][0]:
                    p = m.predict_proba(np.array(wins[i][0]))[:, 1]
                    probs[i] = dict(zip(wins[i][1], p.tolist()))
            print(f"horizon {h:g}: fold {fold} fitted ({int(y.sum())} of {len(y)} positive)", flush=True)
        oof[h] = [{"kind": t["kind"], "seed": t["seed"], "probs": list(probs[i].items())} for i, t in enumerate(traces)]
        if a.save_oof:
            Path(a.save_oof).write_text(json.dumps(oof))
        for th in [float(v) for v in a.thresholds.split(",")]:
            for confirm in [int(v) for v in a.confirms.split(",")]:
                rows = [score_episode(t, _either(_Replay(probs[i], th, confirm, h), a.backstop_s) if a.with_trend else
                                      _Replay(probs[i], th, confirm, h)) for i, t in enumerate(traces)]
                s = summarize(rows)
                kinds = sorted({r["kind"] for r in rows})
                s["per_kind_lead_s"] = {k: summarize([r for r in rows if r["kind"] == k])["median_lead_s"]
                                        for k in kinds}
                grid.append({"horizon_s": h, "threshold": th, "confirm": confirm, **s})
                print(json.dumps({k: grid[-1][k] for k in ("horizon_s", "threshold", "confirm", "precision",
                                                            "recall", "median_lead_s", "false_alarms_per_hour")}),
                      flush=True)
    best = choose(grid, a.max_fa_per_hour)
    print("chosen (out of fold):", json.dumps({k: best[k] for k in ("horizon_s", "threshold", "confirm", "precision",
                                                                    "recall", "median_lead_s",
                                                                    "false_alarms_per_hour", "per_kind_lead_s")}))
    h = best["horizon_s"]
    x = np.array([r for w in wins for r in w[0]], dtype=np.float64)
    y = np.array([v for i, t in enumerate(traces) for v in labels(t, wins[i][1], h)])
    m = fit(x, y)
    out = export(m, a.window, h, signals)
    out.update(threshold=best["threshold"], confirm=best["confirm"], seeds=f"train {seeds[0]}-{seeds[-1]}",
               scored_with_trend=a.with_trend, cross_validation={k: best[k] for k in ("precision", "recall", "median_lead_s",
                                                      "false_alarms_per_hour", "per_kind_lead_s")})
    # the exported trees must give scikit-learn's own scores
    rows = x[:: max(1, len(x) // 500)]
    diff = max(abs(gbt_raw(out, r.tolist()) - d) for r, d in zip(rows, m.decision_function(rows)))
    if diff > 1e-6:
        raise SystemExit(f"the exported trees differ from scikit-learn's scores by {diff}")
    Path(a.out).write_text(json.dumps(out, separators=(",", ":")) + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"chosen": best, "grid": grid}, indent=1))
    print(f"wrote {a.out} ({len(out['trees'])} trees; export max |diff| {diff:.1e}; {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
