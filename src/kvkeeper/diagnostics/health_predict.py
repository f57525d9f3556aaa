"""Cache-health predictors behind one interface: will this server breach, in about how many seconds, and why.

A predictor is fed one telemetry sample at a time (a dict; the fields of
:data:`kvkeeper.eval.health.scenarios.SAMPLE_FIELDS`: ``t`` seconds, ``usage`` and ``pool_rate`` 0..1,
``ttft_p99`` seconds, ...; a missing field counts as absent) and returns a :class:`Forecast`: whether it warns
now, the predicted seconds to the breach (None when it does not estimate one) and the reason in words.
:class:`WarningTracker` turns the per-sample forecasts into warnings that open and close (hysteresis), the same
way for the evaluation and the server.

* :class:`EwmaPredictor`: today's detector (:class:`~kvkeeper.diagnostics.health.HealthMonitor`, EWMA control
  charts, Roberts 1959) as a predictor: it warns while a chart is past its limit; it gives no time.
* :class:`TrendPredictor`: per signal, the least-squares slope over the last ``window`` samples, and the time at
  which the fitted line reaches the signal's limit, ``eta = (limit - level) / slope`` (a linear forecast, the
  "time to threshold" of capacity planning; e.g. Hyndman and Athanasopoulos, *Forecasting: Principles and
  Practice*, 3rd ed., section 7.1).  It warns when ``eta <= horizon_s`` and the rise is sustained: the slope of
  each half of the window is positive by more than ``min_t`` standard errors and at least half the whole
  window's slope, so that a step (an admitted burst) is not a trend; and the level is past ``gate`` x its
  limit.  It also warns, with no time estimated, on a **near miss**: a TTFT at least ``near_miss`` x its limit
  (0.6: 1.8 s of a 3 s objective).  A long-context prefill is a step, not a trend, and the first such request
  is the earliest evidence that two at once will breach (the scenarios' ``longctx``: the trend alone caught
  4 of 19 held-out episodes on 2026-12-02).  The defaults were chosen on the training seeds' traces (0-11, the
  generator of 2026-12-06) by ``kvkeeper.eval.health.tune_trend``: a grid over window, gate, ``min_t``,
  ``near_miss`` and the horizon, keeping precision and recall at least 0.9 and at most 1 false alarm an hour,
  then the longest median lead (30.0 s there, 0.95 recall, 0.68 false alarms an hour; the defaults before,
  window 20 and gate 0.35, had 22 s).
* :class:`LstmPredictor`: the LSTM with additive attention over a window of the telemetry that published
  articles on KV-cache health describe (the attention of Bahdanau, Cho and Bengio, "Neural machine
  translation by jointly learning to align and translate", ICLR 2015, over the LSTM's outputs), giving the
  probability of a breach within its training horizon; trained by ``benchmarks/health/train_health_lstm.py`` on
  generated traces of training seeds, its weights shipped as package data (``health_lstm.safetensors``).
  It gives no time either: its ETA is its training horizon when it warns.
* :class:`GbtPredictor`: gradient-boosted regression trees (J. H. Friedman, "Greedy function approximation: a
  gradient boosting machine", *Annals of Statistics* 29(5), 2001; scikit-learn's
  ``GradientBoostingClassifier`` fits them) over summary features of a window of the telemetry
  (:func:`window_features`: per signal the last value, mean, max, min, least-squares slope and change), giving
  the probability of a breach within its training horizon.  Trained by ``kvkeeper.eval.health.train_gbt`` on the
  training seeds' traces; the trees are shipped as JSON (``health_gbt.json``) and walked here in plain Python,
  so that serving needs no scikit-learn.  Its ETA is its training horizon when it warns.  The shipped trees
  (2026-12-06): seeds 0-47, horizon 60 s, threshold 0.93 for 2 samples in a row, chosen out of fold under 0.6
  false alarms an hour.
* :class:`TreesAndTrendPredictor` (``gbt_trend``, the default, :data:`DEFAULT_PREDICTOR`): the trees, backed by
  the trend's forecast of a usage breach within 20 s, which catches the plain usage ramp the trees miss.  On
  held-out seeds 500-519 (``kvkeeper.eval.health.evaluate``, 2026-12-06): precision 0.96, recall 1.00, median lead
  31.3 s, 0.8 false alarms an hour (docs/serving/health.md).

Limits (:class:`Limits`): usage 0.95 (the breaker's usage threshold: past it, compaction cannot help and it
offloads), TTFT p99 ``ttft_objective_s`` (default 3 s, the scenarios' objective).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .health import HealthConfig, HealthMonitor

LSTM_WEIGHTS = Path(__file__).resolve().parent / "health_lstm.safetensors"
GBT_MODEL = Path(__file__).resolve().parent / "health_gbt.json"
# the gradient-boosted trees' signals (sample fields; a missing one reads 0, hit_rate 1) and their window statistics
GBT_SIGNALS = ("usage", "pool_rate", "ttft_p99", "ttft_mean", "host_fill", "waiting", "running", "eviction_rate",
               "hit_rate", "preemption_rate", "tier", "prefill_backlog", "busy", "head_wait_s", "sessions")
GBT_STATS = ("last", "mean", "max", "min", "slope", "change")
# the learned model's inputs, per sample, each scaled to about 0..1 (see features())
FEATURES = ("usage", "pool_rate", "ttft_p99", "ttft_mean", "host_fill", "waiting", "eviction_rate", "hit_rate",
            "preemption_rate", "tier")


@dataclass(frozen=True)
class Forecast:
    """One predictor's answer after a sample: ``warn``; ``eta_s`` the predicted seconds to the breach (None: no
    estimate); ``reason`` in words, naming the signal; ``signal`` its name (None when not warning)."""

    warn: bool
    eta_s: float | None = None
    reason: str = ""
    signal: str | None = None


@dataclass
class Limits:
    """The levels a breach is defined by: ``usage`` (fraction of the pool, 0..1) and ``ttft_p99`` (s)."""

    usage: float = 0.95
    ttft_p99: float = 3.0

    def __post_init__(self):
        if not 0.0 < self.usage <= 1.0 or self.ttft_p99 <= 0:
            raise ValueError(f"limits: usage must be in (0, 1] and ttft_p99 > 0 s, got {self.usage}, {self.ttft_p99}")


class Predictor:
    """The interface: :meth:`update` with one sample, returns a :class:`Forecast`; :attr:`name`."""

    name = "none"

    def update(self, sample: dict) -> Forecast:
        raise NotImplementedError


class EwmaPredictor(Predictor):
    """Today's EWMA detector as a predictor (see the module docstring).  ``config``: its
    :class:`~kvkeeper.diagnostics.health.HealthConfig` (default: warm-up 20 samples, gates from the default
    breaker)."""

    name = "ewma"
    FIELDS = {"usage": "usage", "pool_rate": "pool_rate", "eviction_rate": "eviction_rate",
              "preemption_rate": "preemption_rate", "hit_rate": "prefix_hit_rate", "ttft_mean": "ttft"}

    def __init__(self, config: HealthConfig | None = None):
        self.monitor = HealthMonitor(config or HealthConfig(), clock=lambda: 0.0)

    def update(self, sample: dict) -> Forecast:
        sig = {self.FIELDS[k]: v for k, v in sample.items() if k in self.FIELDS and v is not None}
        self.monitor.observe_signals(sig, now=sample.get("t", 0.0))
        active = self.monitor.active_signals()
        if not active:
            return Forecast(False)
        reasons = [self.monitor._reason(self.monitor.charts[n])["text"] for n in active]
        return Forecast(True, None, "; ".join(reasons), active[0])


@dataclass
class TrendConfig:
    """The trend forecast's settings: ``window`` samples fitted, ``horizon_s`` (warn when the breach is this
    close, seconds), ``min_t`` (each half-window slope at least this many standard errors above 0), ``gate``
    (the level must be past this fraction of its limit); ``ttft_field``: the sample field held against the TTFT
    limit (the scenarios' ``ttft_p99``; the server's detector has the interval's mean, ``ttft_mean``);
    ``half_ratio``: each half-window slope must be at least this fraction of the whole window's; ``near_miss``:
    warn, with no time estimated, while the TTFT is at least this fraction of its limit (0: off); ``ttft``: False
    forecasts usage alone."""

    window: int = 12
    horizon_s: float = 90.0
    min_t: float = 1.5
    gate: float = 0.3
    limits: Limits = field(default_factory=Limits)
    ttft_field: str = "ttft_p99"
    half_ratio: float = 0.5
    near_miss: float = 0.6
    ttft: bool = True

    def __post_init__(self):
        if self.window < 6 or self.horizon_s <= 0 or self.min_t < 0 or not 0 <= self.gate < 1:
            raise ValueError("trend: window >= 6 samples, horizon_s > 0, min_t >= 0 and gate in [0, 1) are needed")
        if not 0 <= self.near_miss < 1:
            raise ValueError(f"trend: near_miss must be in [0, 1) (0: off), got {self.near_miss}")


def _fit(ts: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b t: (b, a + b t_last, standard error of b)."""
    n = len(ts)
    tm, ym = sum(ts) / n, sum(ys) / n
    sxx = sum((t - tm) ** 2 for t in ts)
    if sxx <= 0:
        return 0.0, ym, math.inf
    b = sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / sxx
    a = ym - b * tm
    rss = sum((y - a - b * t) ** 2 for t, y in zip(ts, ys))
    se = math.sqrt(rss / max(n - 2, 1) / sxx)
    return b, a + b * ts[-1], se


class TrendPredictor(Predictor):
    """Time to breach from a fitted slope against each limit (see the module docstring)."""

    name = "trend"

    def __init__(self, config: TrendConfig | None = None):
        self.config = c = config or TrendConfig()
        self.signals = {"usage": c.limits.usage, **({c.ttft_field: c.limits.ttft_p99} if c.ttft else {})}
        self.hist: dict[str, deque] = {k: deque(maxlen=c.window) for k in self.signals}

    def _eta(self, name: str, limit: float) -> tuple[float, float] | None:
        """(eta seconds, level) when the signal's rise is sustained and past its gate, else None."""
        c, h = self.config, self.hist[name]
        if len(h) < c.window:
            return None
        ts, ys = [t for t, _ in h], [y for _, y in h]
        b, level, _ = _fit(ts, ys)
        if b <= 0 or level < c.gate * limit:
            return None
        m = c.window // 2
        for lo, hi in ((0, m), (m, c.window)):
            bh, _, se = _fit(ts[lo:hi], ys[lo:hi])
            if not (bh > c.min_t * se and bh >= c.half_ratio * b):
                return None
        return max(0.0, (limit - level) / b), level

    def update(self, sample: dict) -> Forecast:
        best = None
        for name, limit in self.signals.items():
            v = sample.get(name)
            if v is None:
                continue
            self.hist[name].append((float(sample.get("t", 0.0)), float(v)))
            got = self._eta(name, limit)
            if got is not None and (best is None or got[0] < best[0]):
                best = (got[0], got[1], name, limit)
        if best is None or best[0] > self.config.horizon_s:
            near = self._near_miss(sample)
            if near is not None:
                return near
            return Forecast(False, None if best is None else best[0])
        eta, level, name, limit = best
        return Forecast(True, eta, f"{name} {level:.3g} rising toward its limit {limit:g}: breach in about "
                                   f"{eta:.0f} s at the fitted slope", name)


    def _near_miss(self, sample: dict) -> Forecast | None:
        """A warning while the TTFT is at least ``near_miss`` x its limit (see the module docstring)."""
        c = self.config
        v, limit = sample.get(c.ttft_field), c.limits.ttft_p99
        if not c.near_miss or v is None or v < c.near_miss * limit:
            return None
        return Forecast(True, None, f"{c.ttft_field} {v:.3g} s is {v / limit:.0%} of its limit {limit:g} s: a near "
                                    f"miss; another prefill as long at the same time breaches it", c.ttft_field)


def features(sample: dict, ttft_objective_s: float = 3.0) -> list[float]:
    """The learned model's input vector of one sample (:data:`FEATURES`, each scaled to about 0..1; TTFTs over
    the objective, waiting over 8 sequences, eviction rate x 10, preemption rate and tier over 3, capped at 3)."""
    g = lambda k: float(sample.get(k) or 0.0)  # noqa: E731
    return [g("usage"), g("pool_rate"), min(g("ttft_p99") / ttft_objective_s, 3.0),
            min(g("ttft_mean") / ttft_objective_s, 3.0), min(g("host_fill"), 3.0), min(g("waiting") / 8.0, 3.0),
            min(10.0 * g("eviction_rate"), 3.0), g("hit_rate") if "hit_rate" in sample else 1.0,
            min(g("preemption_rate") / 3.0, 3.0), g("tier") / 3.0]


class LstmAttention(torch.nn.Module):
    """LSTM over a window of feature vectors, additive attention over its outputs (Bahdanau et al. 2015), a
    linear head: input (batch, window, len(FEATURES)) float32, output (batch,) logits of a breach within the
    training horizon."""

    def __init__(self, n_features: int = len(FEATURES), hidden: int = 16):
        super().__init__()
        self.lstm = torch.nn.LSTM(n_features, hidden, batch_first=True)
        self.att = torch.nn.Linear(hidden, 1)
        self.head = torch.nn.Linear(2 * hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, _) = self.lstm(x)  # (B, W, H)
        w = torch.softmax(self.att(torch.tanh(out)).squeeze(-1), dim=1)  # (B, W)
        ctx = (w.unsqueeze(-1) * out).sum(1)  # (B, H)
        return self.head(torch.cat([ctx, h[-1]], dim=-1)).squeeze(-1)


def load_lstm(path: Path = LSTM_WEIGHTS) -> tuple[LstmAttention, dict]:
    """The shipped model and its metadata (window, horizon_s, threshold, hidden, training seeds).  Raises
    FileNotFoundError naming the training script when the weights file is missing."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not Path(path).exists():
        raise FileNotFoundError(f"{path} is missing: regenerate it with python benchmarks/health/train_health_lstm.py")
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    info = {"window": int(meta["window"]), "horizon_s": float(meta["horizon_s"]),
            "threshold": float(meta["threshold"]), "hidden": int(meta["hidden"]),
            "ttft_objective_s": float(meta["ttft_objective_s"]), "seeds": meta.get("seeds", "")}
    model = LstmAttention(hidden=info["hidden"])
    model.load_state_dict(load_file(str(path)))
    model.eval()
    return model, info


class LstmPredictor(Predictor):
    """The learned model (see the module docstring); warns while its breach probability is at least its
    threshold for ``confirm`` samples in a row.  ``model``/``info``: as :func:`load_lstm` returns (default:
    the shipped weights)."""

    name = "lstm"

    def __init__(self, model: LstmAttention | None = None, info: dict | None = None, confirm: int = 2):
        if model is None:
            model, info = load_lstm()
        self.net, self.info, self.confirm = model, info, confirm
        self.window: deque = deque(maxlen=info["window"])
        self._run = 0

    def probability(self) -> float | None:
        if len(self.window) < self.window.maxlen:
            return None
        with torch.inference_mode():
            x = torch.tensor([list(self.window)], dtype=torch.float32)
            return float(torch.sigmoid(self.net(x))[0])

    def update(self, sample: dict) -> Forecast:
        self.window.append(features(sample, self.info["ttft_objective_s"]))
        p = self.probability()
        self._run = self._run + 1 if p is not None and p >= self.info["threshold"] else 0
        if self._run < self.confirm:
            return Forecast(False)
        return Forecast(True, self.info["horizon_s"], f"learned model: breach probability {p:.2f} within "
                                                      f"{self.info['horizon_s']:.0f} s", "lstm")


def window_features(window: list[dict], signals: tuple[str, ...] | list[str] = GBT_SIGNALS) -> list[float]:
    """The trees' input of a window of samples (oldest first; each a dict with ``t`` in seconds): for each of
    ``signals`` (default :data:`GBT_SIGNALS`), the :data:`GBT_STATS` (last, mean, max, min, the least-squares slope
    per second, last minus first), signal-major; ``len(signals) * len(GBT_STATS)`` floats.  Raises ValueError for
    an empty window."""
    if not window:
        raise ValueError("window_features needs at least one sample")
    ts = [float(s.get("t", 0.0)) for s in window]
    n = len(ts)
    tm = sum(ts) / n
    sxx = sum((t - tm) ** 2 for t in ts)
    out: list[float] = []
    for k in signals:
        dflt = 1.0 if k == "hit_rate" else 0.0
        ys = [float(s.get(k) if s.get(k) is not None else dflt) for s in window]
        ym = sum(ys) / n
        slope = sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / sxx if sxx > 0 else 0.0
        out += [ys[-1], ym, max(ys), min(ys), slope, ys[-1] - ys[0]]
    return out


def load_gbt(path: Path = GBT_MODEL) -> dict:
    """The shipped trees and settings (a dict: ``init`` and ``learning_rate`` of the raw score, ``trees`` each with
    ``left``, ``right``, ``feature``, ``threshold``, ``value`` arrays in scikit-learn's layout, ``window``,
    ``horizon_s``, ``threshold``, ``confirm``, ``seeds``).  Raises FileNotFoundError naming the training script."""
    import json

    if not Path(path).exists():
        raise FileNotFoundError(f"{path} is missing: regenerate it with python -m kvkeeper.eval.health.train_gbt")
    return json.loads(Path(path).read_text())


def gbt_raw(model: dict, x: list[float]) -> float:
    """The boosted raw score (log-odds) of feature vector ``x``: ``init + learning_rate * sum(tree leaf)``.  Each
    feature is rounded to float32 first, as scikit-learn's trees compare it (``x <= threshold`` goes left)."""
    import struct

    xf = [struct.unpack("f", struct.pack("f", v))[0] for v in x]
    raw = model["init"]
    lr = model["learning_rate"]
    for tr in model["trees"]:
        left, right, feat, thr = tr["left"], tr["right"], tr["feature"], tr["threshold"]
        node = 0
        while left[node] != -1:
            node = left[node] if xf[feat[node]] <= thr[node] else right[node]
        raw += lr * tr["value"][node]
    return raw


class GbtPredictor(Predictor):
    """Gradient-boosted trees over window features (see the module docstring); warns while the breach
    probability is at least the model's ``threshold`` for ``confirm`` samples in a row.  ``model``: as
    :func:`load_gbt` returns (default: the shipped trees)."""

    name = "gbt"

    def __init__(self, model: dict | None = None):
        self.model = model if model is not None else load_gbt()
        self.window: deque = deque(maxlen=int(self.model["window"]))
        self._run = 0

    def probability(self) -> float | None:
        if len(self.window) < self.window.maxlen:
            return None
        raw = gbt_raw(self.model, window_features(list(self.window), self.model.get("signals", GBT_SIGNALS)))
        return 1.0 / (1.0 + math.exp(-raw)) if raw > -700 else 0.0

    def update(self, sample: dict) -> Forecast:
        self.window.append(sample)
        p = self.probability()
        m = self.model
        self._run = self._run + 1 if p is not None and p >= m["threshold"] else 0
        if self._run < int(m["confirm"]):
            return Forecast(False)
        return Forecast(True, float(m["horizon_s"]), f"gradient-boosted trees: breach probability {p:.2f} within "
                                                     f"{float(m['horizon_s']):.0f} s", "gbt")


class TreesAndTrendPredictor(Predictor):
    """The boosted trees, backed by the trend forecast of an imminent usage breach: warns when the trees warn
    (:class:`GbtPredictor`; ETA their horizon), or when the trend's fitted line of KV usage reaches its limit
    within ``backstop_s`` seconds (:class:`TrendPredictor` on usage alone, ``horizon_s=backstop_s``, no near miss;
    its ETA from the slope, reported first when both warn).  The trees warn earlier on what moves together before a breach
    in the generated incidents (the host tier filling, open sessions, TTFT and evictions creeping), but they miss
    what they were never shown, a usage ramp with nothing else moving (``test_a_ramp_is_forecast_before_it_crosses``);
    the backstop catches that ramp ``backstop_s`` seconds ahead and, that late, added no false alarm on the
    training seeds (0-35, trees out of fold, 2026-12-06: 0.68 an hour with or without it at 20 s, 1.36 at 45 s;
    forecasting the TTFT p99 as well added 2 in ``bursts``).
    The trees' warning counts only while their window shows **pressure** (:func:`pressured`): they were trained
    on incidents, all under load, and extrapolate on a quiet server (issue 44: light traffic, 40 idle sessions
    pinning half the pool, TTFTs of 0.2 s, no queue: breach probability 0.98); the backstop is not gated.
    ``trees``: a :class:`GbtPredictor` (default: the shipped trees); ``limits``: the trend's
    (:class:`Limits`)."""

    name = "gbt_trend"

    def __init__(self, trees: Predictor | None = None, backstop_s: float = 20.0, limits: Limits | None = None):
        self.trees = trees if trees is not None else GbtPredictor()
        self.backstop_s = backstop_s
        self.limits = limits or Limits()
        self.trend = TrendPredictor(TrendConfig(horizon_s=backstop_s, near_miss=0.0, ttft=False,
                                                limits=self.limits))
        w = getattr(self.trees, "window", None)  # the trees' window: pressure anywhere in it lets them warn
        self.recent: deque = deque(maxlen=w.maxlen if isinstance(w, deque) else 16)

    def update(self, sample: dict) -> Forecast:
        self.recent.append(sample)
        a, b = self.trend.update(sample), self.trees.update(sample)
        if a.warn:
            return a
        return b if b.warn and any(pressured(s, self.limits) for s in self.recent) else Forecast(False)


# a sample is under pressure when one of these is at least its level (a fraction of the limit for usage and TTFT)
PRESSURE = {"waiting": 1, "preemption_rate": 1e-9, "eviction_rate": 1e-9, "tier": 1, "host_fill": 0.5}
PRESSURE_OF_LIMIT = {"usage": 0.6, "ttft_p99": 0.5, "head_wait_s": 0.5}


def pressured(sample: dict, limits: Limits) -> bool:
    """Whether ``sample`` shows load that can lead to a breach: a queue (``waiting`` >= 1), a preemption or an
    eviction, the breaker past closed, the host tier half full, KV usage at 60% of its limit (the EWMA detector's
    usage gate), or a TTFT p99 or a head-of-queue wait at half the TTFT limit (s).  A quiet server, however many
    idle sessions it holds below that usage, is not."""
    if any((sample.get(k) or 0) >= v for k, v in PRESSURE.items()):
        return True
    lim = {"usage": limits.usage, "ttft_p99": limits.ttft_p99, "head_wait_s": limits.ttft_p99}
    return any((sample.get(k) or 0) >= f * lim[k] for k, f in PRESSURE_OF_LIMIT.items())


PREDICTORS = {"ewma": EwmaPredictor, "trend": TrendPredictor, "lstm": LstmPredictor, "gbt": GbtPredictor,
              "gbt_trend": TreesAndTrendPredictor}
DEFAULT_PREDICTOR = "gbt_trend"


def make_predictor(name: str, **kw) -> Predictor:
    """A fresh predictor by name (:data:`PREDICTORS`); raises ValueError naming the choices."""
    if name not in PREDICTORS:
        raise ValueError(f"unknown health predictor {name!r}; choose one of {', '.join(PREDICTORS)}")
    return PREDICTORS[name](**kw)


class WarningTracker:
    """Warnings from per-sample forecasts: one opens at the first warning forecast and closes after
    ``clear_after`` samples in a row without one.  ``events``: (t, "warning" | "clear", forecast)."""

    def __init__(self, clear_after: int = 10):
        self.clear_after = clear_after
        self.open = False
        self._calm = 0
        self.events: list[tuple[float, str, Forecast]] = []
        self.last: Forecast = Forecast(False)

    def update(self, t: float, fc: Forecast) -> bool:
        """Record a forecast at time ``t`` (s); returns whether a warning opened now."""
        self.last = fc
        if fc.warn:
            self._calm = 0
            if not self.open:
                self.open = True
                self.events.append((t, "warning", fc))
                return True
            return False
        if self.open:
            self._calm += 1
            if self._calm >= self.clear_after:
                self.open = False
                self.events.append((t, "clear", fc))
        return False
