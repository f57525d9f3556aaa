"""Cache-health predictors (kvkeeper.diagnostics.health_predict) on small synthetic streams: a ramp is forecast
before it crosses its limit, a flat noisy stream raises no warning, a step from an admitted burst that does not
breach raises none; the warning tracker; scoring (kvkeeper.eval.health.score) on hand-made traces."""

from __future__ import annotations

import random

import pytest

from kvkeeper.diagnostics.health_predict import (PREDICTORS, Forecast, Limits, TrendConfig, TrendPredictor,
                                                 WarningTracker, make_predictor)
from kvkeeper.eval.health.score import score_episode, summarize


def _sample(t, rng, usage=0.3, ttft=0.4, **kw):
    return {"t": float(t), "usage": usage + rng.gauss(0, 0.01), "pool_rate": 0.3 + rng.gauss(0, 0.03),
            "ttft_p99": ttft * (1 + rng.gauss(0, 0.1)), "ttft_mean": 0.5 * ttft * (1 + rng.gauss(0, 0.1)),
            "eviction_rate": 0.0, "preemption_rate": 0.0, "hit_rate": 0.7 + rng.gauss(0, 0.03), "host_fill": 0.0,
            "waiting": 0, "running": 2, "sessions": 3, "tier": 0, **kw}


def _ramp(rng, n=260, start=100, slope=0.005):
    """usage flat at 0.3 until ``start``, then rising ``slope`` per second: crosses 0.95 at start + 130 s."""
    return [_sample(t, rng, usage=0.3 + max(0, t - start) * slope) for t in range(n)]


def _first_warning(pred, stream):
    tr = WarningTracker()
    for s in stream:
        if tr.update(s["t"], pred.update(s)):
            return s["t"], tr.last
    return None, None


NAMES = list(PREDICTORS)  # the learned model with its shipped weights (benchmarks/health/train_health_lstm.py)


@pytest.fixture(params=NAMES)
def predictor(request):
    try:
        return make_predictor(request.param)
    except FileNotFoundError as e:
        pytest.fail(str(e))


def test_a_ramp_is_forecast_before_it_crosses(predictor, request):
    if predictor.name == "gbt":  # the boosted trees' defect, kept visible (strict: a retrained model that passes
        # shows): trained on the generated incidents, where usage rises together with open sessions, evictions and
        # TTFT, they were never shown a usage ramp alone; the trees of 2026-12-06 (seeds 0-47) give it a breach
        # probability of at most 0.29 (threshold 0.93).  The default, gbt_trend, backs them with the usage trend.
        request.applymarker(pytest.mark.xfail(strict=True, reason="the trees miss a usage ramp with nothing else"))
    rng = random.Random(0)
    stream = _ramp(rng)
    cross = next(s["t"] for s in stream if s["usage"] >= 0.95)
    t, fc = _first_warning(predictor, stream)
    if predictor.name == "ewma":  # it warns when its chart is past the limit: no time given
        assert t is not None and t < cross and fc.eta_s is None
        return
    assert t is not None and 100 < t < cross, (t, cross)
    if predictor.name in ("trend", "gbt_trend"):  # gbt_trend: its usage backstop warns, within 20 s
        assert fc.signal == "usage" and "usage" in fc.reason
        assert fc.eta_s == pytest.approx(cross - t, abs=15)  # the fitted line knows when it will cross


def test_a_flat_noisy_stream_raises_no_warning(predictor, request):
    if predictor.name == "lstm":  # a defect of the learned model, kept visible (strict: a retrained model that
        # passes shows): on its training traces a pool 70% full was mostly on the way to a breach
        request.applymarker(pytest.mark.xfail(strict=True, reason="the LSTM warns on a flat stream at usage 0.7"))
    rng = random.Random(1)
    stream = [_sample(t, rng, usage=0.7) for t in range(600)]
    assert _first_warning(predictor, stream) == (None, None)


def test_a_step_from_an_admitted_burst_that_does_not_breach_raises_none(predictor, request):
    """A burst admitted at t=100: usage steps from 0.3 to 0.75 and TTFT p99 from 0.4 to 1.2 s for 10 s, then
    both fall back; nothing comes near a limit (0.95, 3 s)."""
    if predictor.name == "ewma":  # the baseline's known defect, kept visible: its TTFT chart (gate: twice the
        # baseline) flags the burst's tripled TTFT although nothing nears a limit; strict, so a fix shows
        request.applymarker(pytest.mark.xfail(strict=True, reason="EWMA charts warn on a burst that does not breach"))
    if predictor.name == "lstm":
        request.applymarker(pytest.mark.xfail(strict=True, reason="the LSTM warns on a burst that does not breach"))
    rng = random.Random(2)
    stream = [_sample(t, rng, usage=0.75 if 100 <= t < 130 else 0.3, ttft=1.2 if 100 <= t < 110 else 0.4)
              for t in range(300)]
    assert _first_warning(predictor, stream) == (None, None)


def test_trend_ignores_a_rise_below_its_gate_and_reads_ttft_against_its_objective():
    rng = random.Random(3)
    low = [_sample(t, rng, usage=0.05 + 0.002 * t) for t in range(100)]  # rising, but under half the limit
    assert _first_warning(TrendPredictor(), low) == (None, None)
    ttft = [_sample(t, rng, ttft=0.4 + max(0, t - 50) * 0.03) for t in range(150)]  # crosses 3 s near t=137
    t, fc = _first_warning(TrendPredictor(TrendConfig(limits=Limits(ttft_p99=3.0))), ttft)
    assert t is not None and t < 137 and fc.signal == "ttft_p99"


def test_a_first_token_near_the_objective_warns_at_once_with_no_time():
    """Long-context crowding (the scenarios' ``longctx``): one long request's first token takes 2.4 s, 80% of the
    3 s objective, and the TTFT p99 steps up for the 10 s of its window.  No trend shows (it is a step), yet a
    second prefill as long at the same time breaches: the trend predictor warns on the near miss at once, naming
    the TTFT and giving no time; with ``near_miss=0`` it stays silent (the predictor before 2026-12-06 did)."""
    rng = random.Random(5)
    stream = [_sample(t, rng, ttft=2.4 if 100 <= t < 110 else 0.3) for t in range(200)]
    t, fc = _first_warning(TrendPredictor(), stream)
    assert t == 100 and fc.signal == "ttft_p99" and fc.eta_s is None and "near miss" in fc.reason
    assert _first_warning(TrendPredictor(TrendConfig(near_miss=0)), stream) == (None, None)


def test_bad_settings_and_names_are_refused():
    with pytest.raises(ValueError, match="window"):
        TrendConfig(window=2)
    with pytest.raises(ValueError, match="near_miss"):
        TrendConfig(near_miss=1.5)
    with pytest.raises(ValueError, match="usage"):
        Limits(usage=1.5)
    with pytest.raises(ValueError, match="trend"):
        make_predictor("nope")


def test_the_tracker_opens_once_and_closes_after_calm_samples():
    tr = WarningTracker(clear_after=3)
    on, off = Forecast(True, 10.0, "x", "usage"), Forecast(False)
    opened = [tr.update(t, fc) for t, fc in enumerate([on, on, off, on, off, off, off, on])]
    assert opened == [True, False, False, False, False, False, False, True]
    assert [e[1] for e in tr.events] == ["warning", "clear", "warning"]


def test_scoring_counts_true_positives_false_alarms_and_lead():
    rng = random.Random(4)
    ramp = {"kind": "leak", "seed": 0, "onset_s": 100.0, "breach_s": 230.0, "samples": _ramp(rng, n=232)}
    flat = {"kind": "swings", "seed": 0, "onset_s": None, "breach_s": None,
            "samples": [_sample(t, rng) for t in range(300)]}
    a, b = score_episode(ramp, TrendPredictor()), score_episode(flat, TrendPredictor())
    assert a["tp"] == 1 and a["fp"] == 0 and 30 <= a["lead_s"] < 130 and a["fault_free_s"] == 100.0
    assert b["tp"] == b["fp"] == 0 and b["fault_free_s"] == 299.0
    s = summarize([a, b])
    assert s["precision"] == 1.0 and s["recall"] == 1.0 and s["false_alarms_per_hour"] == 0.0
    # a warning before the onset is a false alarm
    early = dict(ramp, onset_s=250.0, breach_s=260.0)
    c = score_episode(early, TrendPredictor())
    assert c["fp"] == 1 and c["tp"] == 0 and summarize([c])["recall"] == 0.0


def test_window_features_are_each_signals_statistics():
    from kvkeeper.diagnostics.health_predict import GBT_SIGNALS, GBT_STATS, window_features

    w = [{"t": float(t), "usage": 0.1 * t, "ttft_p99": 1.0} for t in range(5)]
    x = window_features(w)
    assert len(x) == len(GBT_SIGNALS) * len(GBT_STATS)
    u = GBT_SIGNALS.index("usage") * len(GBT_STATS)
    assert x[u: u + 6] == pytest.approx([0.4, 0.2, 0.4, 0.0, 0.1, 0.4])  # last, mean, max, min, slope/s, change
    h = GBT_SIGNALS.index("hit_rate") * len(GBT_STATS)  # absent: 1 (no look-up missed)
    assert x[h: h + 6] == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least one sample"):
        window_features([])


def test_exported_trees_give_scikit_learns_scores():
    """kvkeeper.eval.health.train_gbt's export, walked in plain Python (gbt_raw), against the fitted model."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("sklearn")
    from kvkeeper.eval.health.train_gbt import export, fit

    from kvkeeper.diagnostics.health_predict import GBT_SIGNALS, GBT_STATS, gbt_raw

    rng = np.random.default_rng(0)
    x = rng.random((300, len(GBT_SIGNALS) * len(GBT_STATS)))
    y = (x[:, 0] + 0.3 * x[:, 5] > 0.8).astype(int)
    m = fit(x, y)
    out = export(m, window=8, horizon_s=60.0)
    got = [gbt_raw(out, r.tolist()) for r in x[:50]]
    assert got == pytest.approx(m.decision_function(x[:50]).tolist(), abs=1e-6)


def test_the_server_builds_the_default_predictor_and_every_choice():
    from kvkeeper.api.server import breach_forecaster
    from kvkeeper.diagnostics.health import HealthConfig
    from kvkeeper.diagnostics.health_predict import DEFAULT_PREDICTOR
    from kvkeeper.sessions.breaker import BreakerConfig

    assert HealthConfig().predictor == DEFAULT_PREDICTOR  # what `kvkeeper serve` runs is what the evaluation scores
    assert breach_forecaster(HealthConfig(), BreakerConfig()).name == DEFAULT_PREDICTOR
    for name in HealthConfig.PREDICTORS:
        fc = breach_forecaster(HealthConfig(predictor=name), BreakerConfig(usage_threshold=0.9))
        assert (fc is None) if name == "none" else fc.name == name
    trend = breach_forecaster(HealthConfig(predictor="trend", ttft_objective_s=2.0), BreakerConfig(usage_threshold=0.9))
    assert trend.signals == {"usage": 0.9, "ttft_p99": 2.0}
