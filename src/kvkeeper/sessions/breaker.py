"""A tiered circuit breaker for KV memory: degrade gracefully instead of failing.

The breaker watches the block pool (:mod:`kvkeeper.kvcache.telemetry`) and trips when
the pool fragmentation rate reaches ``frag_threshold`` (default 0.683) while KV usage is at
least ``frag_min_usage`` (default 0.5: on a pool mostly free, scattered blocks cost nothing), or
KV usage reaches ``usage_threshold`` (default 0.95).  While tripped it applies three tiers in
order, giving each ``escalate_after_s`` seconds to work before the next:

1. **compaction**: defragment the pool (``engine.kv.compact()``,
   :meth:`kvkeeper.engine.kv_access.KVAccess.compact`: owned blocks renumbered contiguously, then the
   prefix cache's blocks, their KV moved; the prefix cache is kept, since its unreferenced blocks are
   allocatable already and evicting them would only lose hits);
2. **offload**: move idle sessions' KV out of the pool, to host memory first, then to
   disk when a data directory is configured (``SessionManager.offload_idle``), until
   usage would fall to ``recover_usage``;
3. **degrade**: refuse new sessions (the server answers 503 with ``Retry-After``) and trim
   the oldest turns of the lowest-priority sessions: their pinned KV is released and,
   while degraded, their prompts are rendered without their oldest turns so that they
   fit ``degrade_budget_tokens`` (:func:`kvkeeper.sessions.context.trim_oldest_turns`).

Fragmentation alone (usage below its threshold) never escalates past compaction: the
breaker compacts again every ``escalate_after_s`` instead, since offloading sessions or
refusing new ones would not defragment anything.  Usage still at ``recover_usage`` or more
``escalate_after_s`` after compaction (idle sessions hold it) moves on to the offload tier, never
further, so that the breaker can close.

The breaker closes (back to tier 0: new sessions admitted, no trimming) once usage is
below ``recover_usage`` and the fragmentation rate below ``recover_frag`` for
``cooldown_s`` seconds.  Every action is reversible and loses nothing a client was
promised: compaction moves KV bit for bit, offloaded sessions come back on their next
turn, trimming only changes what is rendered while degraded (the conversation itself is
kept, by the session or the client), and running requests are never touched (the
scheduler's preemption keeps them correct).  Every action is logged at WARNING, kept in
:attr:`CircuitBreaker.events` and counted in :attr:`CircuitBreaker.actions`.

The tiers follow the load-shedding order of production servers: reclaim what costs
nothing (fragmentation), then move state to slower memory (vLLM's CPU swap
space, LMCache's host and disk tiers), and only then refuse work (Nygard's circuit
breaker, *Release It!*, with a half-open cool-down).

**Early signal.** ``early_warning`` (a callable returning the names of the signals a health detector
flags now, :meth:`kvkeeper.diagnostics.health.HealthMonitor.active_signals`) is read while the breaker is
closed: when it first names a pool signal (usage, fragmentation, evictions, preemptions) the breaker logs a
``health_warning`` event, and while it names ``pool_rate`` (and usage is at least ``frag_min_usage``) it
compacts ahead of a trip (action
``early_compact``, at most every ``cooldown_s``), without tripping or refusing anything.

**Acting on a forecast.** ``forecast`` (a callable returning the latest
:class:`~kvkeeper.diagnostics.health_predict.Forecast` of a breach predictor, or None) is read while the breaker
is closed: when it forecasts that usage reaches its threshold within ``act_ahead_s`` seconds, the breaker
compacts the pool and offloads idle sessions (least recently used first) until usage would fall to
``recover_usage`` (action ``ahead_offload``, at most every ``cooldown_s``), before the trip that would have
escalated to the offload tier; it stays armed for ``act_ahead_s`` after the last such forecast, offloading
again whenever usage is back at ``recover_usage``.  A forecast of TTFT (not KV memory) is left to the operator: offloading would
not shorten a prefill queue.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

from ..argtypes import positive_int
from ..errors import OverloadedError
from ..options import option
from ..engine.handle import EngineHandle

log = logging.getLogger(__name__)

TIER_NAMES = ("closed", "compaction", "offload", "degrade")
# every (tier name, action) the breaker counts in CircuitBreaker.actions: /metrics exports each from start-up (at 0)
ACTIONS = (("closed", "health_warning"), ("closed", "early_compact"), ("closed", "ahead_offload"), ("closed", "close"), ("compaction", "compact"),
           ("offload", "offload_idle_sessions"), ("degrade", "refuse_new_sessions"), ("degrade", "trim_session"),
           ("degrade", "refused_session"))
EARLY_SIGNALS = ("usage", "pool_rate", "eviction_rate", "preemption_rate")  # the pool's signals of a health detector


@dataclass
class BreakerConfig:
    """Thresholds are fractions in (0, 1]; times in seconds; ``degrade_budget_tokens`` in tokens.

    recover_usage / recover_frag default to min(0.80, 0.85 x usage_threshold) and
    min(0.5, 0.75 x frag_threshold).  Raises ValueError for values out of range.
    """

    frag_threshold: float = field(default=0.683, metadata=option(
        "--breaker-frag-threshold", "trip at this pool fragmentation rate, 0..1", type=float, metavar="F"))
    usage_threshold: float = field(default=0.95, metadata=option(
        "--breaker-usage-threshold", "trip at this KV usage, 0..1", type=float, metavar="U"))
    frag_min_usage: float = field(default=0.5, metadata=option(
        "--breaker-frag-min-usage", "fragmentation counts (trips, early compaction) only at this KV usage or "
        "more, 0..1 (default 0.5; 0: always)", type=float, metavar="U"))
    recover_usage: float | None = field(default=None, metadata=option(
        "--breaker-recover-usage", "close again below this KV usage, 0..1 (default: min(0.80, 0.85 x the usage "
        "threshold))", type=float, metavar="U"))
    recover_frag: float | None = None
    interval_s: float = 0.25
    escalate_after_s: float = 0.5
    cooldown_s: float = 2.0
    retry_after_s: int = 2
    act_ahead_s: float = field(default=60.0, metadata=option(
        "--breaker-act-ahead", "offload idle sessions when the health forecast puts the usage breach within S "
        "seconds (0: never act on a forecast)", type=float, metavar="S"))
    degrade_budget_tokens: int = field(default=512, metadata=option(
        "--degrade-budget-tokens", "while degraded, the lowest-priority sessions' prompts keep only their newest "
        "turns that fit N tokens", type=positive_int, metavar="N"))

    def __post_init__(self):
        if self.recover_usage is None:
            self.recover_usage = min(0.80, 0.85 * self.usage_threshold)
        if self.recover_frag is None:
            self.recover_frag = min(0.5, 0.75 * self.frag_threshold)
        for k in ("frag_threshold", "usage_threshold", "recover_usage", "recover_frag"):
            v = getattr(self, k)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{k} must be in (0, 1], got {v}")
        if not 0.0 <= self.frag_min_usage <= 1.0:
            raise ValueError(f"frag_min_usage must be in [0, 1], got {self.frag_min_usage}")
        if self.recover_usage > self.usage_threshold or self.recover_frag > self.frag_threshold:
            raise ValueError("recovery thresholds must not exceed the trip thresholds")
        for k in ("interval_s", "escalate_after_s", "cooldown_s", "act_ahead_s"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0 seconds, got {getattr(self, k)}")
        if self.retry_after_s < 1 or self.degrade_budget_tokens < 1:
            raise ValueError("retry_after_s and degrade_budget_tokens must be at least 1")


class CircuitBreaker:
    """Watches ``engine`` (an :class:`~kvkeeper.engine.llm_engine.LLMEngine`) and applies the tiers to its
    ``sessions`` (a :class:`~kvkeeper.sessions.manager.SessionManager`).

    It runs before every engine step (it adds :meth:`evaluate` to ``engine.step_hooks``; call it too
    while the engine idles: it rate-limits itself to ``interval_s``) and checks every new session
    (``sessions.admission``).  ``tier``: the highest tier applied in the current episode (0 = closed).
    """

    def __init__(self, engine: EngineHandle, sessions, config: BreakerConfig | None = None, clock=time.monotonic):
        self.engine = engine
        self.sessions = sessions
        self.config = config or BreakerConfig()
        self.clock = clock
        self.tier = 0
        self.trips = 0
        self.actions: Counter[tuple[str, str]] = Counter()
        self.events: deque[dict] = deque(maxlen=1000)
        self.trimmed_sessions: set[str] = set()
        self._last_eval = -math.inf
        self._tier_at = -math.inf  # when the current tier was applied
        self._calm_since: float | None = None
        self.last_stats = None
        self.early_warning = None  # () -> list of signal names; see the module docstring
        self.forecast = None  # () -> Forecast | None; see the module docstring
        self._ahead_at = -math.inf
        self._armed_until = -math.inf
        self.evicted_blocks = 0  # cached blocks its compactions evicted (not allocation pressure)
        self._early_on = False
        self._early_at = -math.inf
        engine.step_hooks.append(self.evaluate)
        sessions.admission = self.check_new_session

    # ---- state -----------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        return self.tier >= 3

    def _fragmented(self, st, level: float) -> bool:
        """The pool fragmentation rate at ``level`` or more while usage is at ``frag_min_usage`` or more
        (below it free blocks abound, and compacting would only copy blocks)."""
        return st.usage >= self.config.frag_min_usage and st.pool_rate >= level

    def _over(self, st) -> bool:
        c = self.config
        return st.usage >= c.usage_threshold or self._fragmented(st, c.frag_threshold)

    def _calm(self, st) -> bool:
        c = self.config
        return st.usage < c.recover_usage and not self._fragmented(st, c.recover_frag)

    def _event(self, tier: int, action: str, before, after=None, **detail) -> None:
        ev = {"t": time.time(), "tier": tier, "tier_name": TIER_NAMES[tier], "action": action,
              "usage": round(before.usage, 4), "pool_rate": round(before.pool_rate, 4), **detail}
        if after is not None:
            ev["usage_after"], ev["pool_rate_after"] = round(after.usage, 4), round(after.pool_rate, 4)
        self.events.append(ev)
        self.actions[(TIER_NAMES[tier], action)] += 1
        log.warning("circuit breaker tier %d (%s): %s; usage %.3f, fragmentation rate %.3f%s", tier,
                    TIER_NAMES[tier], action, before.usage, before.pool_rate,
                    "".join(f", {k}={v}" for k, v in detail.items()))

    # ---- the loop --------------------------------------------------------------------
    def evaluate(self, now: float | None = None, force: bool = False):
        """Check the pool and act; returns the :class:`PoolStats` it saw (None when rate-limited)."""
        now = self.clock() if now is None else now
        if not force and now - self._last_eval < self.config.interval_s:
            return None
        self._last_eval = now
        st = self.engine.kv.pool_stats()
        self.last_stats = st
        if self._over(st):
            self._calm_since = None
            if self.tier == 0:
                self.trips += 1
                self._apply(1, st, now)
            elif self.tier < 3 and now - self._tier_at >= self.config.escalate_after_s:
                if st.usage >= self.config.usage_threshold:
                    self._apply(self.tier + 1, st, now)
                else:  # fragmentation alone: compaction is what fixes it; offloading or refusing would not
                    self._relieve(st, now)
            elif self.degraded and now - self._tier_at >= self.config.escalate_after_s:
                self._relieve(st, now)
        elif self.tier == 0:
            self._heed_early_warning(st, now)
            self._act_on_forecast(st, now)
        else:
            if self._calm(st):
                if self._calm_since is None:
                    self._calm_since = now
                elif now - self._calm_since >= self.config.cooldown_s:
                    self._close(st)
            else:
                self._calm_since = None
                if now - self._tier_at >= self.config.escalate_after_s:
                    if self.tier == 1 and st.usage >= self.config.recover_usage:
                        # compaction frees no owned block: idle sessions' KV keeps usage over the recovery
                        # level, and without the offload tier the breaker would stay tripped for as long as they do
                        self._apply(2, st, now)
                    else:
                        self._relieve(st, now)
        return st

    def _heed_early_warning(self, st, now: float) -> None:
        """Closed, under the trip levels: log a health warning naming pool signals; compact early on
        fragmentation (see the module docstring)."""
        names = self.early_warning() if self.early_warning is not None else []
        pool = [n for n in names if n in EARLY_SIGNALS]
        if not pool:
            self._early_on = False
            return
        if not self._early_on:
            self._early_on = True
            self._event(0, "health_warning", st, signals=",".join(pool))
        if ("pool_rate" in pool and st.usage >= self.config.frag_min_usage
                and now - self._early_at >= self.config.cooldown_s):
            self._early_at = now
            res = self.engine.kv.compact()
            self.evicted_blocks += res["evicted"]
            self._event(0, "early_compact", st, self.engine.kv.pool_stats(), evicted=res["evicted"],
                        moved=res["moved"])

    def _act_on_forecast(self, st, now: float) -> None:
        """Closed: offload ahead of a forecast usage breach (see the module docstring).  Once a forecast has put
        the breach within ``act_ahead_s``, the breaker stays armed for ``act_ahead_s`` seconds after the last
        such forecast (acting changes the very trend the forecast reads) and offloads again whenever usage is
        back at ``recover_usage``."""
        fc = self.forecast() if self.forecast is not None else None
        c = self.config
        if (fc is not None and fc.warn and fc.signal == "usage" and fc.eta_s is not None
                and fc.eta_s <= c.act_ahead_s):
            self._armed_until = now + c.act_ahead_s
            why, eta = fc.reason, round(fc.eta_s, 1)
        elif now < self._armed_until:
            why, eta = "armed by an earlier forecast", None
        else:
            return
        if now - self._ahead_at < c.cooldown_s or st.owned <= self._calm_owned(st):
            return
        self._ahead_at = now
        res = self.engine.kv.compact()
        self.evicted_blocks += res["evicted"]
        freed = self.sessions.offload_idle(st.owned - self._calm_owned(st), tier="host")
        self._event(0, "ahead_offload", st, self.engine.kv.pool_stats(), blocks=freed, eta_s=eta, reason=why)

    def _relieve(self, st, now: float) -> None:
        """Tripped but not yet calm (between the recovery and trip levels, or degraded): every
        ``escalate_after_s`` compact again and, from the offload tier on, offload idle sessions again, so that
        the pool reaches the recovery level and the breaker can close instead of staying tripped (and, when
        degraded, refusing new sessions) for as long as idle sessions hold KV.  Logged only when it acted."""
        self._tier_at = now
        if self._fragmented(st, self.config.recover_frag):
            self._compact(st, log_empty=False)
        if self.tier >= 2 and st.owned > self._calm_owned(st):
            self._offload(st, log_empty=False)

    def _apply(self, tier: int, st, now: float) -> None:
        self.tier = tier
        self._tier_at = now
        if tier == 1:
            self._compact(st)
        elif tier == 2:
            self._offload(st)
        else:
            self._event(3, "refuse_new_sessions", st, retry_after_s=self.config.retry_after_s)
            self._trim_lowest_priority(st)

    def _calm_owned(self, st) -> int:
        """The most owned blocks that count as calm (usage below ``recover_usage``)."""
        return math.ceil(self.config.recover_usage * st.num_blocks) - 1

    def _compact(self, st, log_empty: bool = True) -> None:
        eng = self.engine
        res = eng.kv.compact()
        self.evicted_blocks += res["evicted"]
        if log_empty or res["evicted"] or res["moved"]:
            self._event(1, "compact", st, eng.kv.pool_stats(), evicted=res["evicted"], moved=res["moved"])

    def _offload(self, st, log_empty: bool = True) -> None:
        """Offload idle sessions until usage would fall to the recovery level (host tier; it spills to disk)."""
        eng = self.engine
        freed = self.sessions.offload_idle(max(1, st.owned - self._calm_owned(st)), tier="host")
        if log_empty or freed:
            held = self.sessions.offloaded_bytes()
            self._event(2, "offload_idle_sessions", st, eng.kv.pool_stats(), blocks=freed,
                        host_bytes=held.get("host", 0), disk_bytes=held.get("disk", 0))

    def _trim_lowest_priority(self, st) -> None:
        low, ids = self.sessions.lowest_priority_open()
        budget = self.config.degrade_budget_tokens
        for sid in ids:
            freed = self.sessions.trim_session(sid, budget)
            self.trimmed_sessions.add(sid)
            self._event(3, "trim_session", st, session=sid, priority=low, blocks=freed, budget_tokens=budget)

    def _close(self, st) -> None:
        for sid in self.trimmed_sessions:
            self.sessions.trim_session(sid, None)
        n = len(self.trimmed_sessions)
        self.trimmed_sessions.clear()
        self._event(0, "close", st, from_tier=self.tier, untrimmed_sessions=n)
        self.tier = 0
        self._calm_since = None

    # ---- admission -----------------------------------------------------------------------
    def check_new_session(self, session_id: str) -> None:
        """Raise :class:`OverloadedError` when degraded (a new session would add KV the pool cannot hold)."""
        if self.degraded:
            self.actions[("degrade", "refused_session")] += 1
            raise OverloadedError(
                f"KV memory is short (circuit breaker tier {self.tier}, {TIER_NAMES[self.tier]}): new sessions are "
                f"refused for now; retry after {self.config.retry_after_s} s or continue without X-Session-ID",
                self.config.retry_after_s)

    def snapshot(self) -> dict:
        """JSON-able state: tier, trips, action counts, recent events, config."""
        return {"tier": self.tier, "tier_name": TIER_NAMES[self.tier], "trips": self.trips,
                "actions": [{"tier": t, "action": a, "count": n} for (t, a), n in sorted(self.actions.items())],
                "trimmed_sessions": sorted(self.trimmed_sessions), "events": list(self.events),
                "config": asdict(self.config)}

