"""kvkeeper.eval.health.evaluate recomputes its table from saved traces, without an engine, in seconds: 14 traces
(seeds 0-1 of the training seeds, every kind) shipped beside this test, scored by every predictor."""

from __future__ import annotations

import gzip
import json

import pytest

from kvkeeper.diagnostics.health_predict import DEFAULT_PREDICTOR, make_predictor
from kvkeeper.eval.health import evaluate as health_eval_module
from kvkeeper.eval.health import scenarios as health_scenarios
from kvkeeper.eval.health import tune_trend as health_tune_trend
from kvkeeper.eval.health.score import score, score_episode
from tests.utils.paths import ROOT

TRACES = ROOT / "tests" / "unit" / "eval" / "data" / "health_traces.jsonl.gz"


def read_saved() -> list[dict]:
    with gzip.open(TRACES, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture()
def health_eval(monkeypatch):
    def no_engine(*a, **k):
        raise AssertionError("scoring saved traces must not build an engine")

    monkeypatch.setattr(health_scenarios, "LLMEngine", no_engine)
    monkeypatch.setattr(health_scenarios, "run_episode", no_engine)
    monkeypatch.setattr(health_eval_module, "run_episode", no_engine)
    return health_eval_module


def test_the_table_is_recomputed_from_saved_traces(health_eval, tmp_path):
    out = tmp_path / "eval.json"
    assert health_eval.main(["--from-traces", str(TRACES), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    traces = health_eval.read_traces(TRACES)
    assert res["episodes"] == len(traces) == 14 and res["seeds"] == "0-1"
    assert res["default_predictor"] == "gbt_trend"
    assert set(res["predictors"]) == {"ewma", "trend", "lstm", "gbt", "gbt_trend"}
    for name, table in res["predictors"].items():
        again = score(traces, name)
        for k in ("precision", "recall", "median_lead_s", "false_alarms_per_hour", "true_positives",
                  "false_alarms", "breaching_episodes"):
            assert table[k] == again[k], (name, k)
        assert set(table["per_kind"]) == set(health_scenarios.KINDS)
    for k in ("precision", "recall", "median_lead_s", "false_alarms_per_hour"):
        assert res[k] == res["predictors"]["gbt_trend"][k]
    # the traces breach where they say: every incident breached, no fault-free episode did
    assert res["predictors"]["trend"]["breaching_episodes"] == sum(t["breach_s"] is not None for t in traces)
    assert all(t["breach_s"] is None for t in traces if t["kind"] in health_scenarios.FAULT_FREE)
    md = out.with_suffix(".md").read_text()
    assert "| trend |" in md and "| ewma |" in md and "| gbt_trend |" in md


def test_the_default_predictor_warns_ahead_of_the_saved_breaches():
    """On the saved traces the default predictor warns before every incident's breach and never in a fault-free
    episode.  These are training seeds (0-1) of the shipped trees, so this checks the wiring, not the accuracy
    (that is the held-out evaluation's).  The trend alone misses host seed 1, whose usage falls back with every
    offload to the host tier so that its 12-sample half-windows do not both rise; the trees read the host tier."""
    missed = []
    for tr in read_saved():
        row = score_episode(tr, make_predictor(DEFAULT_PREDICTOR))
        if tr["breach_s"] is None:
            assert row["fp"] == 0, (tr["kind"], tr["seed"], row["first_warning"])
        elif row["tp"] == 0:
            missed.append((tr["kind"], tr["seed"]))
        else:
            assert row["lead_s"] > 0 and row["fp"] == 0, (tr["kind"], tr["seed"])
    assert missed == []
    trend_missed = [(t["kind"], t["seed"]) for t in read_saved()
                    if t["breach_s"] is not None and score_episode(t, make_predictor("trend"))["tp"] == 0]
    assert trend_missed == [("host", 1)]


def test_seeds_are_parsed_or_refused(health_eval):
    assert health_eval.parse_seeds("100-103") == [100, 101, 102, 103]
    assert health_eval.parse_seeds("1,5") == [1, 5]
    with pytest.raises(ValueError, match="A-B"):
        health_eval.parse_seeds("a-b")


def test_the_tuning_grid_refuses_held_out_seeds(health_eval, tmp_path):
    """kvkeeper.eval.health.tune_trend chooses the trend's defaults on tuning seeds only: traces holding a
    held-out seed (100 and up) are refused before any scoring."""
    traces = health_eval.read_traces(TRACES)[:2]
    bad = tmp_path / "mixed.jsonl.gz"
    health_eval.write_traces(bad, traces + [dict(traces[0], seed=300)])
    with pytest.raises(SystemExit):
        health_tune_trend.main(["--traces", str(bad)])
