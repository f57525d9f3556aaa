"""Cache-health prediction: EWMA control charts over the server's KV telemetry.

Every ``interval_s`` seconds the detector reads one sample of each signal and updates, per
signal, an exponentially weighted moving average ``z_t = lam * x_t + (1 - lam) * z_(t-1)``
with control limits ``mu +- L * sigma * sqrt(lam / (2 - lam) * (1 - (1 - lam)^(2t)))``
(the EWMA control chart of S. W. Roberts, "Control chart tests based on geometric moving
averages", *Technometrics* 1(3), 1959; NIST/SEMATECH e-Handbook of Statistical Methods,
section 6.3.2.4).  ``mu`` and ``sigma`` are the mean and standard deviation of the signal's
first ``warmup`` samples (the in-control baseline), with ``sigma`` never below the signal's
floor (a signal that was constant during warm-up would otherwise flag the first wobble).  The
audit mismatch count has a fixed baseline of 0 instead: every mismatch is a fault, and one
during warm-up must not become the norm.  Charts are one-sided: only the direction that hurts counts.

Signals (:data:`SIGNALS`; all read from counters the server already keeps):

=================  =========  ==============================================================
signal             bad when   sample (unit)
=================  =========  ==============================================================
usage              up         owned blocks / pool blocks (0..1)
pool_rate          up         pool fragmentation rate (0..1, :mod:`kvkeeper.kvcache.telemetry`)
prefix_hit_rate    down       prefix-cache hit tokens / looked-up tokens over the interval
eviction_rate      up         cached blocks evicted for new allocations per second / pool blocks
                              (1/s; blocks a breaker's compaction drops do not count)
preemption_rate    up         sequences preempted per second (1/s)
audit_mismatches   up         reuse-audit mismatches in the interval (requests)
ttft               up         mean time to first token of requests that started in the interval (s)
=================  =========  ==============================================================

A signal's **excess** is how far its EWMA has moved in the bad direction, in units of its
control-limit distance (0 at the baseline, 1 on the limit).  A signal only counts once it is
also past its **gate**, an absolute level that makes a shift matter (usage and fragmentation:
60% of the circuit breaker's trip thresholds; TTFT: twice its baseline and half its objective; the others: any
level), so that a server going from idle to busy is not a fault; fragmentation counts only while KV usage is
at least ``frag_min_usage`` (the breaker's, default 0.5).  The **health score** is
``1 - min(1, max excess / 2)`` over the counting signals: 1 healthy, 0.5 on a control limit,
0 at twice the limit.  A **warning** opens when some counting signal's excess reaches 1; it
lists the reasons (signal, value, EWMA, baseline, limit) and closes after ``clear_after``
samples with no signal past its limit.  Warnings are logged at WARNING and kept in
:attr:`HealthMonitor.events`; :meth:`HealthMonitor.active_signals` is the early signal the
circuit breaker reads (it compacts ahead of a trip when usage or fragmentation warn).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..argtypes import positive_int
from ..options import option
from ..engine.handle import EngineHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SignalSpec:
    """One chart: ``direction`` +1 (bad when up) or -1 (bad when down); ``sigma_floor`` in the signal's unit;
    ``gate``: absolute level the signal must pass (in the bad direction) to count; ``gate_rel``: the same as a
    multiple of its baseline mean (the larger of the two applies for direction +1).  ``fixed_baseline``: the
    in-control mean is this value, not learnt (sigma = ``sigma_floor``): for a signal whose every nonzero value
    is a fault, so that a fault during warm-up cannot become the baseline."""

    name: str
    direction: int
    sigma_floor: float
    gate: float = 0.0
    gate_rel: float = 0.0
    unit: str = ""
    fixed_baseline: float | None = None


SIGNALS = (
    SignalSpec("usage", +1, 0.02, unit="fraction"),
    SignalSpec("pool_rate", +1, 0.05, unit="fraction"),
    SignalSpec("prefix_hit_rate", -1, 0.1, gate=1.0, unit="fraction"),
    SignalSpec("eviction_rate", +1, 0.01, unit="1/s of the pool"),
    SignalSpec("preemption_rate", +1, 0.2, unit="1/s"),
    SignalSpec("audit_mismatches", +1, 0.05, unit="requests", fixed_baseline=0.0),
    SignalSpec("ttft", +1, 0.05, gate_rel=2.0, unit="s"),
)


@dataclass
class HealthConfig:
    """The detector's settings: ``interval_s`` between samples (seconds), ``warmup`` samples of baseline,
    ``lam`` the EWMA weight in (0, 1], ``limit_sigmas`` L (control-limit width), ``clear_after`` calm samples
    that close a warning; ``usage_gate`` / ``frag_gate``: usage and fragmentation levels below which a shift
    does not count (set from the breaker's thresholds by :func:`gates_from_breaker`); ``frag_min_usage``: the KV
    usage (0..1) below which fragmentation never counts, as the breaker's own ``frag_min_usage`` (on a pool mostly
    free, scattered blocks cost nothing: issue 29's warning at 1% usage); ``ttft_gate``: the fraction of
    ``ttft_objective_s`` the TTFT's EWMA must also reach to count (on a quiet server one long prompt among a few
    short ones doubles the mean TTFT of its interval, far under the objective: issue 44's warning at 1.1 s of 3 s);
    ``predictor``: the breach forecaster
    the server builds (:data:`PREDICTORS`; default ``gbt_trend``) and ``ttft_objective_s`` (s) the TTFT limit it forecasts against.
    Raises ValueError for values out of range."""

    interval_s: float = field(default=1.0, metadata=option(
        "--health-interval", "seconds between the health detector's samples", type=float, metavar="S"))
    warmup: int = field(default=20, metadata=option(
        "--health-warmup", "samples (one each --health-interval) of the health detector's baseline before it can warn",
        type=positive_int, metavar="N"))
    lam: float = 0.3
    limit_sigmas: float = field(default=3.0, metadata=option(
        "--health-limit-sigmas", "width L of the health detector's EWMA control limits, in standard deviations",
        type=float, metavar="L"))
    clear_after: int = 10
    PREDICTORS = ("trend", "gbt", "gbt_trend", "lstm", "none")
    predictor: str = field(default="gbt_trend", metadata=option(
        "--health-predictor", "what forecasts a breach (kvkeeper:kv_health_breach_eta_seconds, the warnings' "
        "predicted breach): trend (time to breach from a fitted slope), gbt (boosted trees over a window of the "
        "telemetry), gbt_trend (the trees, backed by the trend's forecast of a breach within 20 s), lstm (the "
        "learned model), none", choices=PREDICTORS))
    ttft_objective_s: float = field(default=3.0, metadata=option(
        "--ttft-objective", "the TTFT objective (seconds) the forecast measures a breach against", type=float,
        metavar="S"))
    trace: str | None = field(default=None, metadata=option(
        "--health-trace", "append every health sample (the detector's signals and the forecaster's sample, with its "
        "forecast) to FILE as JSON lines, for rescoring any predictor offline (benchmarks/health/health_rescore.py)",
        metavar="FILE"))
    usage_gate: float = 0.57
    frag_gate: float = 0.41
    frag_min_usage: float = 0.5
    ttft_gate: float = 0.5

    def __post_init__(self):
        if not 0.0 < self.lam <= 1.0:
            raise ValueError(f"lam must be in (0, 1], got {self.lam}")
        if not 0.0 <= self.frag_min_usage <= 1.0:
            raise ValueError(f"frag_min_usage must be in [0, 1], got {self.frag_min_usage}")
        if self.predictor not in self.PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(self.PREDICTORS)}, got {self.predictor!r}")
        if not 0.0 <= self.ttft_gate <= 1.0:
            raise ValueError(f"ttft_gate must be in [0, 1] (a fraction of ttft_objective_s), got {self.ttft_gate}")
        if self.ttft_objective_s <= 0:
            raise ValueError(f"ttft_objective_s must be > 0 seconds, got {self.ttft_objective_s}")
        if self.limit_sigmas <= 0 or self.interval_s < 0 or self.warmup < 2 or self.clear_after < 1:
            raise ValueError("limit_sigmas must be > 0, interval_s >= 0, warmup >= 2 and clear_after >= 1")


def gates_from_breaker(config: HealthConfig, breaker_config) -> HealthConfig:
    """``config`` with its usage and fragmentation gates at 60% of the breaker's trip thresholds and the
    breaker's minimum usage for fragmentation."""
    config.usage_gate = 0.6 * breaker_config.usage_threshold
    config.frag_gate = 0.6 * breaker_config.frag_threshold
    config.frag_min_usage = breaker_config.frag_min_usage
    return config


class EwmaChart:
    """One-sided EWMA control chart of one signal (Roberts 1959; NIST handbook 6.3.2.4).

    Feed :meth:`update` one sample at a time; the first ``warmup`` samples set ``mu`` and ``sigma``.
    """

    def __init__(self, spec: SignalSpec, lam: float, limit_sigmas: float, warmup: int, gate: float | None = None):
        self.spec = spec
        self.lam = lam
        self.L = limit_sigmas
        self.warmup = warmup
        self.gate = spec.gate if gate is None else gate
        self._base: list[float] = []
        self.mu: float | None = spec.fixed_baseline
        self.sigma: float | None = None if spec.fixed_baseline is None else spec.sigma_floor
        self.z: float | None = spec.fixed_baseline
        self.n = 0  # samples since the baseline was set
        self.value: float | None = None

    @property
    def ready(self) -> bool:
        return self.mu is not None

    def update(self, x: float) -> None:
        self.value = x
        if self.mu is None:
            self._base.append(x)
            if len(self._base) >= self.warmup:
                m = sum(self._base) / len(self._base)
                var = sum((v - m) ** 2 for v in self._base) / (len(self._base) - 1)
                self.mu, self.sigma = m, max(math.sqrt(var), self.spec.sigma_floor)
                self.z = m
            return
        self.n += 1
        self.z = self.lam * x + (1.0 - self.lam) * self.z

    def limit_distance(self) -> float:
        """L x the EWMA's standard deviation after ``n`` samples (the distance of the control limit from mu)."""
        f = self.lam / (2.0 - self.lam) * (1.0 - (1.0 - self.lam) ** (2 * max(self.n, 1)))
        return self.L * self.sigma * math.sqrt(f)

    def limit(self) -> float:
        return self.mu + self.spec.direction * self.limit_distance()

    def gated(self) -> bool:
        """Whether the EWMA is past the signal's gate (absolute, or relative to the baseline) in the bad direction."""
        d = self.spec.direction
        g = self.gate
        if self.spec.gate_rel:
            g = max(g, self.spec.gate_rel * self.mu) if d > 0 else min(g, self.spec.gate_rel * self.mu)
        return (self.z >= g) if d > 0 else (self.z <= g)

    def excess(self) -> float:
        """(EWMA - mu) in the bad direction over the control-limit distance; 0 before the baseline."""
        if not self.ready or self.n == 0:
            return 0.0
        return max(0.0, self.spec.direction * (self.z - self.mu) / self.limit_distance())

    def describe(self) -> dict:
        out = {"signal": self.spec.name, "value": self.value, "ready": self.ready}
        if self.ready:
            out.update(ewma=round(self.z, 6), baseline=round(self.mu, 6), sigma=round(self.sigma, 6),
                       limit=round(self.limit(), 6), excess=round(self.excess(), 4), gated=self.gated())
        return out


class CounterDeltas:
    """Turns cumulative counters into per-interval signal samples.

    Counters (a dict): ``usage``, ``pool_rate`` (levels, 0..1); ``num_blocks``; cumulative ``prefix_query_tokens``,
    ``prefix_hit_tokens``, ``evictions`` (blocks), ``preemptions``, ``audit_mismatches``, ``ttft_sum`` (s) and
    ``ttft_count``.  A counter that goes down (a restart) starts over from the new value.
    """

    def __init__(self):
        self.prev: dict | None = None
        self.t_prev: float | None = None

    def signals(self, now: float, c: dict) -> dict[str, float]:
        """Samples of :data:`SIGNALS` for the interval since the previous call (rates need one previous call;
        hit rate and TTFT are left out when the interval had no lookups or no first tokens)."""
        out = {"usage": float(c["usage"]), "pool_rate": float(c["pool_rate"])}
        p, tp = self.prev, self.t_prev
        self.prev, self.t_prev = dict(c), now
        if p is None or now <= tp:
            return out
        d = {k: c[k] - p[k] for k in ("prefix_query_tokens", "prefix_hit_tokens", "evictions", "preemptions",
                                       "audit_mismatches", "ttft_sum", "ttft_count")}
        if any(v < 0 for v in d.values()):
            return out
        dt = now - tp
        out["eviction_rate"] = d["evictions"] / max(1, c["num_blocks"]) / dt
        out["preemption_rate"] = d["preemptions"] / dt
        out["audit_mismatches"] = float(d["audit_mismatches"])
        if d["prefix_query_tokens"] > 0:
            out["prefix_hit_rate"] = d["prefix_hit_tokens"] / d["prefix_query_tokens"]
        if d["ttft_count"] > 0:
            out["ttft"] = d["ttft_sum"] / d["ttft_count"]
        return out


def engine_counters(engine: EngineHandle, auditor=None, ttft_sum: float = 0.0, ttft_count: int = 0, breaker=None,
                    stats=None) -> dict:
    """The counters :class:`CounterDeltas` reads, from an :class:`~kvkeeper.engine.llm_engine.LLMEngine`
    (its pool, prefix-cache and scheduler counters), a reuse auditor (None: no mismatches), the TTFT
    sum (seconds) and count the caller keeps, and a circuit breaker whose compactions' evictions are left
    out of the eviction count (None: none).  ``stats``: a fresh ``engine.kv.pool_stats()`` (None: taken here)."""
    st = stats if stats is not None else engine.kv.pool_stats()
    dropped = breaker.evicted_blocks if breaker is not None else 0
    query, hit = engine.kv.prefix_tokens()
    return {"usage": st.usage, "pool_rate": st.pool_rate, "num_blocks": st.num_blocks,
            "prefix_query_tokens": query, "prefix_hit_tokens": hit,
            "evictions": engine.kv.num_evictions - dropped, "preemptions": engine.scheduler.num_preemptions,
            "audit_mismatches": auditor.mismatches if auditor is not None else 0,
            "ttft_sum": ttft_sum, "ttft_count": ttft_count}


def prefill_backlog(scheduler) -> int:
    """Prompt tokens admitted to ``scheduler`` (waiting or running) and not yet computed: the prefill work
    queued ahead of a new request's first token (tokens)."""
    return sum(max(0, s.num_prompt_tokens - s.num_computed) for s in list(scheduler.waiting) + list(scheduler.running))


class ForecastFeed:
    """The breach forecaster's queue, latency and tier fields from a live engine, measured as the generated
    incidents (:mod:`kvkeeper.eval.health.scenarios`) measure them, so that a predictor scored there reads the
    same fields on a server.

    :meth:`fields` returns, at monotonic time ``now`` (s): ``ttft_p99`` and ``ttft_mean`` (s) of the first tokens
    of the last ``ttft_window_s`` seconds (0 when none; recorded at the first token by an engine
    ``first_token_hooks`` hook, not when the request ends), ``waiting`` and ``running`` (sequences),
    ``prefill_backlog`` (tokens, :func:`prefill_backlog`), ``head_wait_s`` (how long the oldest request still
    without a first token has waited, s; 0 when none), ``busy`` (fraction of the time since the previous call the
    engine spent in steps, 0..1, from :meth:`add_busy`), ``sessions`` (open sessions), ``host_fill`` (host-tier
    bytes / its budget, 0 without a host tier) and ``tier`` (the circuit breaker's, 0 without one).  Call
    :meth:`fields` and the hook from the engine thread."""

    def __init__(self, engine: EngineHandle, sessions=None, breaker=None, ttft_window_s: float = 10.0, clock=time.monotonic):
        self.engine, self.sessions, self.breaker = engine, sessions, breaker
        self.ttft_window_s, self.clock = ttft_window_s, clock
        self.first: deque[tuple[float, float]] = deque()  # (clock time, ttft s)
        self.busy_s = 0.0
        self._prev: tuple[float, float] | None = None  # (time, busy_s) at the previous fields()
        engine.first_token_hooks.append(self._first_token)

    def _first_token(self, seq, logits) -> None:
        self.first.append((self.clock(), time.perf_counter() - seq.t_arrival))

    def add_busy(self, seconds: float) -> None:
        """Add ``seconds`` the engine spent computing a step."""
        self.busy_s += seconds

    def fields(self, now: float) -> dict:
        while self.first and self.first[0][0] <= now - self.ttft_window_s:
            self.first.popleft()
        w = sorted(x for _, x in self.first)
        p99 = w[min(len(w) - 1, math.ceil(0.99 * len(w)) - 1)] if w else 0.0
        busy = 0.0
        if self._prev is not None and now > self._prev[0]:
            busy = min(1.0, (self.busy_s - self._prev[1]) / (now - self._prev[0]))
        self._prev = (now, self.busy_s)
        sched = self.engine.scheduler
        seqs = list(sched.waiting) + list(sched.running)
        heads = [s.t_arrival for s in seqs if s.t_first_token is None]
        out = {"ttft_p99": p99, "ttft_mean": sum(w) / len(w) if w else 0.0, "waiting": len(sched.waiting),
               "running": len(sched.running), "prefill_backlog": prefill_backlog(sched),
               "head_wait_s": max(0.0, time.perf_counter() - min(heads)) if heads else 0.0, "busy": busy,
               "sessions": 0, "host_fill": 0.0, "tier": self.breaker.tier if self.breaker is not None else 0}
        m = self.sessions
        if m is not None:
            out["sessions"] = sum(1 for s in list(m.sessions.values()) if not s.closed)
            budget = m.store.host_budget
            out["host_fill"] = m.store.bytes_in("host") / budget if budget > 0 else 0.0
        return out


class HealthMonitor:
    """The online detector: one :class:`EwmaChart` per signal, the score, warning events.

    Call :meth:`observe` with cumulative counters (see :class:`CounterDeltas`) as often as you like;
    it samples every ``config.interval_s`` seconds (``clock``: monotonic seconds).  ``events``: the last
    200 warning open/close events, each with ``t`` (wall time), ``t_mono``, ``score``, ``reasons`` and the
    forecast's ``breach_eta_s`` and ``breach_reason`` (None when none is forecast).

    ``forecaster``: None, or an object whose ``update(sample) -> Forecast`` (:mod:`kvkeeper.diagnostics.
    health_predict`) is fed each sample (``t``, ``usage``, ``pool_rate``, ``eviction_rate``,
    ``preemption_rate``, ``hit_rate``, ``ttft_mean``: the interval's mean TTFT, s; and, with ``feed`` (a
    :class:`ForecastFeed`), its fields, whose windowed ``ttft_mean`` replaces the interval's); a forecast that warns opens a
    ``forecast`` event (logged: "breach in about N s", the reason), closed after ``clear_after`` samples without
    one; :meth:`breach_eta` is its predicted seconds to the breach (inf when none is forecast).  With
    ``config.trace`` each sample is appended to that file as a JSON line: ``t`` (monotonic s), ``wall_t`` (Unix s),
    ``signals`` (the charts' input), ``sample`` (the forecaster's input), ``forecast`` (``warn``, ``eta_s``,
    ``signal``; null without a forecaster), ``warning`` (an EWMA warning open); an OSError writing it is logged
    once and stops the trace, never the detector.
    """

    def __init__(self, config: HealthConfig | None = None, clock=time.monotonic):
        self.config = c = config or HealthConfig()
        self.clock = clock
        gates = {"usage": c.usage_gate, "pool_rate": c.frag_gate, "ttft": c.ttft_gate * c.ttft_objective_s}
        self.charts = {s.name: EwmaChart(s, c.lam, c.limit_sigmas, c.warmup, gates.get(s.name)) for s in SIGNALS}
        self.deltas = CounterDeltas()
        self.score = 1.0
        self.warning = False
        self.warnings = 0  # warnings opened
        self.samples = 0
        self.events: deque[dict] = deque(maxlen=200)
        self._calm = 0
        self._next = -math.inf
        self._active: list[str] = []
        self.forecaster = None
        self.forecast = None  # the forecaster's latest Forecast
        self.forecasting = False
        self.forecasts = 0  # forecast warnings opened
        self._fc_calm = 0
        self.feed: ForecastFeed | None = None
        self._trace = None  # the open --health-trace file

    def observe(self, counters: dict, now: float | None = None) -> bool:
        """Take a sample if ``interval_s`` has passed since the last one; returns whether it did."""
        now = self.clock() if now is None else now
        if now < self._next:
            return False
        self._next = now + self.config.interval_s
        extra = self.feed.fields(now) if self.feed is not None else None
        self.observe_signals(self.deltas.signals(now, counters), now, extra)
        return True

    def observe_signals(self, signals: dict[str, float], now: float | None = None, extra: dict | None = None) -> None:
        """One sample of (some of) the signals, by name; unknown names raise KeyError.  ``extra``: more fields
        of the forecaster's sample (:class:`ForecastFeed`'s)."""
        now = self.clock() if now is None else now
        self.samples += 1
        for name, x in signals.items():
            self.charts[name].update(float(x))
        sample = None
        if self.forecaster is not None or self.config.trace:
            sample = self.forecast_sample(signals, now, extra)
        if self.forecaster is not None:
            self._forecast(sample, now)
        usage = self.charts["usage"].value
        frag_counts = usage is not None and usage >= self.config.frag_min_usage
        counting = [ch for ch in self.charts.values() if ch.ready and ch.n > 0 and ch.gated()
                    and (frag_counts or ch.spec.name != "pool_rate")]
        worst = max((ch.excess() for ch in counting), default=0.0)
        self.score = 1.0 - min(1.0, worst / 2.0)
        out = [ch for ch in counting if ch.excess() >= 1.0]
        self._active = [ch.spec.name for ch in out]
        if out and not self.warning:
            self.warning = True
            self.warnings += 1
            self._calm = 0
            self._event("warning", now, [self._reason(ch) for ch in out])
        elif self.warning:
            self._calm = 0 if out else self._calm + 1
            if self._calm >= self.config.clear_after:
                self.warning = False
                self._event("clear", now, [])
        if self.config.trace and sample is not None:
            self._write_trace(now, signals, sample)

    @staticmethod
    def forecast_sample(signals: dict[str, float], now: float, extra: dict | None = None) -> dict:
        """The forecaster's input: ``t`` and the signals under the generated incidents' field names (``hit_rate``
        1 for an interval without lookups, as they record it), then ``extra`` (which may replace them)."""
        names = {"usage": "usage", "pool_rate": "pool_rate", "eviction_rate": "eviction_rate",
                 "preemption_rate": "preemption_rate", "prefix_hit_rate": "hit_rate", "ttft": "ttft_mean"}
        out = {"t": now, "hit_rate": 1.0, **{names[k]: v for k, v in signals.items() if k in names}}
        return {**out, **(extra or {})}

    def _write_trace(self, now: float, signals: dict, sample: dict) -> None:
        fc = self.forecast if self.forecaster is not None else None
        rec = {"t": now, "wall_t": round(time.time(), 3), "signals": signals, "sample": sample,
               "forecast": None if fc is None else {"warn": fc.warn, "eta_s": fc.eta_s, "signal": fc.signal},
               "warning": self.warning, "predictor": getattr(self.forecaster, "name", None)}
        try:
            if self._trace is None:
                path = Path(self.config.trace)
                path.parent.mkdir(parents=True, exist_ok=True)
                self._trace = open(path, "a", buffering=1)  # line-buffered: each sample reaches the file
            self._trace.write(json.dumps(rec, separators=(",", ":")) + "\n")
        except OSError as e:
            log.error("--health-trace %s: %s; the trace stops here (the detector goes on)", self.config.trace, e)
            self.config.trace = None

    def _forecast(self, sample: dict, now: float) -> None:
        fc = self.forecast = self.forecaster.update(sample)
        if fc.warn:
            self._fc_calm = 0
            if not self.forecasting:
                self.forecasting = True
                self.forecasts += 1
                self._event("forecast", now, [{"signal": fc.signal, "text": fc.reason}])
        elif self.forecasting:
            self._fc_calm += 1
            if self._fc_calm >= self.config.clear_after:
                self.forecasting = False
                self._event("forecast_clear", now, [])

    def breach_eta(self) -> float:
        """Predicted seconds to the breach (the forecaster's, while it warns); inf when none is forecast."""
        fc = self.forecast
        return fc.eta_s if fc is not None and fc.warn and fc.eta_s is not None else math.inf

    def _reason(self, ch: EwmaChart) -> dict:
        s = ch.spec
        word = "above" if s.direction > 0 else "below"
        text = (f"{s.name} EWMA {ch.z:.4g} {word} its control limit {ch.limit():.4g} (baseline {ch.mu:.4g}, "
                f"sigma {ch.sigma:.3g}, last sample {ch.value:.4g} {s.unit})")
        return {"signal": s.name, "value": ch.value, "ewma": ch.z, "baseline": ch.mu, "limit": ch.limit(),
                "excess": ch.excess(), "text": text}

    def _event(self, kind: str, now: float, reasons: list[dict]) -> None:
        fc = self.forecast
        warn = fc is not None and fc.warn
        ev = {"t": time.time(), "t_mono": now, "event": kind, "score": round(self.score, 4), "reasons": reasons,
              "breach_eta_s": (round(fc.eta_s, 1) if fc.eta_s is not None else None) if warn else None,
              "breach_reason": fc.reason if warn else None}
        self.events.append(ev)
        if kind == "forecast":
            eta = "an unknown time" if ev["breach_eta_s"] is None else f"about {ev['breach_eta_s']:.0f} s"
            log.warning("KV cache health forecast: breach in %s (%s)", eta, fc.reason)
        elif kind == "forecast_clear":
            log.warning("KV cache health forecast cleared")
        elif kind == "warning":
            log.warning("KV cache health warning (score %.2f): %s", self.score, "; ".join(r["text"] for r in reasons))
        else:
            log.warning("KV cache health warning cleared (score %.2f)", self.score)

    def active_signals(self) -> list[str]:
        """Signals past their control limit (and gate) at the last sample: the breaker's early signal."""
        return list(self._active)

    def snapshot(self) -> dict:
        """JSON-able state: score, warning, counts (``warnings``: EWMA warnings opened, ``forecasts``: forecast
        warnings opened), each chart, recent events, config."""
        return {"score": self.score, "warning": self.warning, "warnings": self.warnings, "samples": self.samples,
                "forecasting": self.forecasting, "forecasts": self.forecasts,
                "breach_eta_s": None if math.isinf(self.breach_eta()) else self.breach_eta(),
                "breach_reason": self.forecast.reason if self.forecast is not None and self.forecast.warn else None,
                "predictor": getattr(self.forecaster, "name", None),
                "active": self.active_signals(), "signals": [ch.describe() for ch in self.charts.values()],
                "events": list(self.events), "config": asdict(self.config),
                "method": "EWMA control charts (Roberts 1959; NIST/SEMATECH e-Handbook 6.3.2.4)"}
