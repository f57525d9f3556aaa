"""The cache-health scenario generator (kvkeeper.eval.health.scenarios): a real tiny engine on a simulated
clock, deterministic per seed; onsets and breaches are recorded when they happen, not inferred afterwards."""

from __future__ import annotations

import random

import pytest

from kvkeeper.eval.health.scenarios import KINDS, SAMPLE_FIELDS, Episode, ScenarioConfig, run_episode

CFG = ScenarioConfig(duration_s=150.0, onset_range_s=(30.0, 50.0))


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    a, b = run_episode("leak", 3, config=CFG), run_episode("leak", 3, config=CFG)
    assert a == b
    c = run_episode("leak", 4, config=CFG)
    assert c["onset_s"] != a["onset_s"] and c["samples"] != a["samples"]
    assert set(a["samples"][0]) == set(SAMPLE_FIELDS)


def test_onset_and_breach_are_recorded_when_they_happen():
    ep = Episode("leak", 3, config=CFG)
    breaches = []
    orig = ep._breach

    def spy(reason):  # every call of the generator's breach recorder, with the clock at that moment
        breaches.append((ep.now, reason))
        orig(reason)

    ep._breach = spy
    tr = ep.run()
    assert 30.0 <= tr["onset_s"] <= 50.0
    assert tr["breach_s"] is not None and tr["breach_s"] > tr["onset_s"]
    assert tr["breach_s"] == round(breaches[0][0], 3) and tr["breach_reason"] == breaches[0][1]
    # the recorded breach is the first sample over a limit: the breaker above compaction, or TTFT over the objective
    first = next(s for s in tr["samples"] if s["tier"] >= 2 or s["ttft_p99"] > CFG.ttft_objective_s)
    assert abs(first["t"] - tr["breach_s"]) <= CFG.sample_every_s
    assert tr["samples"][-1]["t"] <= tr["breach_s"] + CFG.after_breach_s + CFG.sample_every_s


def test_a_fault_free_kind_has_no_onset():
    tr = run_episode("swings", 0, config=ScenarioConfig(duration_s=60.0))
    assert tr["onset_s"] is None and tr["breach_s"] is None and len(tr["samples"]) >= 60


def test_an_unknown_kind_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="flood"):
        Episode("nope", 0)
    assert "corruption" not in KINDS  # it does not develop over time: the reuse audit's job (see the module)


def test_a_ramping_rate_is_sampled_as_it_ramps():
    """flood and longctx arrive at a rate rising from the onset, ``a + b x`` per second x seconds after it: the gaps
    (:meth:`Episode._ramp_gap`, inversion of the cumulative rate) give on average ``a T + b T^2 / 2`` arrivals in
    the first T seconds.  Before 2026-12-06 each gap was drawn at the rate of the last arrival (longctx's
    0.02/s at the onset: 50 s on average), a third as many here after the one made at the onset itself, so that
    the ramp was skipped."""
    class Stub:
        rng = random.Random(0)

    a, b, horizon, runs = 0.02, 0.007, 30.0, 4000
    count = 0
    for _ in range(runs):
        t = Episode._ramp_gap(Stub, a, b, 0.0)
        while t <= horizon:
            count += 1
            t += Episode._ramp_gap(Stub, a, b, t)
    expected = a * horizon + b * horizon ** 2 / 2  # 3.75 arrivals
    assert count / runs == pytest.approx(expected, rel=0.05)
