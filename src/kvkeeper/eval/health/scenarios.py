"""Cache-health incidents that develop over time, generated deterministically on a real engine (issue 29).

An *episode* drives a real :class:`~kvkeeper.engine.llm_engine.LLMEngine` (a tiny random Llama of load
format ``dummy``: 2 layers, hidden size 32, a 256-token byte vocabulary, 128 KV blocks of 16 tokens), its
:class:`~kvkeeper.sessions.manager.SessionManager` and the :class:`~kvkeeper.sessions.breaker.CircuitBreaker`
under a seeded workload, on a **simulated clock**: the clock advances by :class:`CostModel`'s cost of each
engine step (``base_s + per_token_s x tokens computed + per_context_token_s x context tokens attended``), and
by ``idle_tick_s`` while the engine idles, so that times to first token depend on the seed alone, never on
the machine.  Every ``sample_every_s`` simulated seconds the telemetry is sampled (:data:`SAMPLE_FIELDS`).

Kinds (:data:`KINDS`); an incident starts at its recorded ``onset_s`` (drawn per seed), the background load
(stateless requests with a shared prefix, short conversations that close) runs throughout:

* ``flood``: new conversations arrive at a rate ramping up from the onset (the slope drawn per seed);
* ``leak``: a pinned conversation opens every few seconds and is never closed;
* ``frag``: long conversations that keep growing beside short ones closed at once (fragmentation creep);
* ``host``: idle conversations are offloaded to a small host tier; once it is full their KV is dropped and
  each later turn prefills its whole history again;
* ``longctx``: long-context requests (640-1,200 tokens) at a rising rate crowd out the decode of the rest;
* ``swings`` (fault-free): daily-style load swings (a sine of the request rate, period 80-140 s);
* ``bursts`` (fault-free): bursts of 4-8 short requests, admitted and served without a breach.

Injected KV corruption is not a kind: it does not develop over time (one faulty block is there or not), and
the reuse audit (:mod:`kvkeeper.diagnostics.audit`) catches it on the request it touches.

The **breach** is recorded when it happens (the first sample at or after it), never inferred: the TTFT p99 of
the first tokens of the last ``ttft_window_s`` seconds over ``ttft_objective_s``, the breaker at a tier above
compaction (offload or degrade), or a new session refused (the server's 503).  An episode ends
``after_breach_s`` after its breach or at ``duration_s``.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...diagnostics.health import prefill_backlog  # noqa: F401 (the server's feed measures it the same way)
from ...sessions.breaker import BreakerConfig, CircuitBreaker
from ...engine.llm_engine import LLMEngine
from ...errors import KVKeeperError, OverloadedError
from ...sampling.params import SamplingParams
from ...sessions.manager import SessionManager

INCIDENTS = ("flood", "leak", "frag", "host", "longctx")
FAULT_FREE = ("swings", "bursts")
KINDS = INCIDENTS + FAULT_FREE
# one telemetry sample: t (s), usage and pool_rate (0..1), waiting and running (sequences), ttft_p99 and
# ttft_mean (s, over the last ttft_window_s; 0 when no first token), eviction_rate (cached blocks evicted
# per second / pool blocks), preemption_rate (1/s), hit_rate (prefix-cache hit tokens / looked-up tokens
# over the interval), host_fill (host-tier bytes / its budget), sessions (open), tier (breaker, 0..3),
# prefill_backlog (prompt tokens admitted and not yet computed, tokens), busy (fraction of the interval the
# engine spent computing steps, 0..1), head_wait_s (how long the oldest request still without its first token
# has waited, s: the TTFT of the queue's head so far, 0 when none waits; added 2026-12-06, traces before lack it)
SAMPLE_FIELDS = ("t", "usage", "pool_rate", "waiting", "running", "ttft_p99", "ttft_mean", "eviction_rate",
                 "preemption_rate", "hit_rate", "host_fill", "sessions", "tier", "prefill_backlog", "busy",
                 "head_wait_s")
TINY_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True}


@dataclass(frozen=True)
class CostModel:
    """Simulated seconds of one engine step: ``base_s + per_token_s * T + per_context_token_s * C`` for T
    tokens computed in the step and C context tokens attended (the sum of the scheduled sequences' lengths).
    The defaults are a small server's shape (40 ms a step, 2 ms a prefilled token, 20 us per token of context),
    not a measurement of this machine."""

    base_s: float = 0.04
    per_token_s: float = 0.002
    per_context_token_s: float = 2e-5

    def step_s(self, tokens: int, context_tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_context_token_s * context_tokens


@dataclass
class ScenarioConfig:
    """An episode's settings (times in simulated seconds; ``num_kv_blocks`` of ``block_size`` tokens)."""

    duration_s: float = 240.0
    sample_every_s: float = 1.0
    onset_range_s: tuple[float, float] = (60.0, 100.0)
    ttft_objective_s: float = 3.0
    ttft_window_s: float = 10.0
    after_breach_s: float = 5.0
    idle_tick_s: float = 0.05
    num_kv_blocks: int = 128
    block_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    host_offload_bytes: int = 64 * 1024
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self):
        if self.duration_s <= 0 or self.sample_every_s <= 0 or self.ttft_objective_s <= 0:
            raise ValueError("duration_s, sample_every_s and ttft_objective_s must be > 0 seconds")


def tiny_model_config(folder: Path | None = None) -> Path:
    """Write the tiny random Llama's config.json (:data:`TINY_MODEL`) to ``folder`` (default: a temporary
    directory); returns its path, for ``LLMEngine(path, load_format="dummy")``."""
    folder = Path(folder or tempfile.mkdtemp(prefix="kvkeeper-health-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(TINY_MODEL, sort_keys=True))
    return path


class _Conversation:
    """A workload conversation: a session, its token history, its next turn time and turns left."""

    def __init__(self, session, next_t: float, turns: int, closes: bool, prompt_len: tuple[int, int]):
        self.session, self.next_t, self.turns, self.closes, self.prompt_len = session, next_t, turns, closes, prompt_len
        self.history: list[int] = []
        self.seq = None
        self.asked_t = next_t  # when the user asks the first turn (TTFT of a held first turn counts from here)


class Episode:
    """One episode of ``kind`` with ``seed`` (see the module docstring); :meth:`run` returns its trace:
    ``{"kind", "seed", "onset_s" (None for a fault-free kind), "breach_s", "breach_reason", "samples": [...],
    "config"}``; a sample is a dict of :data:`SAMPLE_FIELDS`.  ``engine_factory(config_path, **settings)``
    builds the engine (default :class:`~kvkeeper.engine.llm_engine.LLMEngine`).  ``breaker_config``: the
    breaker's thresholds (default :class:`BreakerConfig`'s).  ``forecaster``: an object with
    ``update(sample) -> Forecast`` fed every sample, whose latest forecast the breaker reads
    (:attr:`CircuitBreaker.forecast`) to act ahead of a breach (None: the reactive breaker alone).
    Raises ValueError for an unknown kind."""

    def __init__(self, kind: str, seed: int, config: ScenarioConfig | None = None, model_path: Path | None = None,
                 engine_factory=None, breaker_config: BreakerConfig | None = None, forecaster=None,
                 defer_new_s: float = 0.0):
        if kind not in KINDS:
            raise ValueError(f"unknown scenario kind {kind!r}; choose one of {', '.join(KINDS)}")

        self.kind, self.seed = kind, seed
        self.cfg = c = config or ScenarioConfig()
        self.rng = random.Random(f"{kind}-{seed}")
        self.now = 0.0
        factory = engine_factory or LLMEngine
        self.eng = factory(str(model_path or tiny_model_config()), load_format="dummy", quantization="none",
                           num_kv_blocks=c.num_kv_blocks, block_size=c.block_size, validate_every=0,
                           max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                           num_threads=1, seed=0)
        host = c.host_offload_bytes if kind == "host" else 0
        self.sessions = SessionManager(self.eng, host_offload_bytes=host)
        self.breaker = CircuitBreaker(self.eng, self.sessions, breaker_config or BreakerConfig(),
                                      clock=lambda: self.now)
        self.forecaster = forecaster
        self.forecast = None
        self.defer_new_s = defer_new_s
        self.deferred = 0  # first turns held by admission control ahead of a forecast breach
        if forecaster is not None:
            self.breaker.forecast = lambda: self.forecast
        self.onset = None if kind in FAULT_FREE else round(self.rng.uniform(*c.onset_range_s), 1)
        self.arrival: dict[str, float] = {}
        self.first_tokens: list[tuple[float, float]] = []  # (time, ttft)
        self._pending_first: list[str] = []
        self.eng.first_token_hooks.append(lambda seq, logits: self._pending_first.append(seq.request_id))
        self.convs: list[_Conversation] = []
        self.requests = 0
        self.refusals = 0
        self.breach_s: float | None = None
        self.breach_reason: str | None = None
        self.samples: list[dict] = []
        self._prev = None
        self.busy_s = 0.0  # simulated seconds spent computing engine steps
        self._next_arrival = 0.0
        self._next_conv = 0.0
        self._kind_next = self.onset if self.onset is not None else 0.0
        self._ramp_started = False  # flood, longctx: the first arrival is drawn from the onset's rate, not at it
        self._params = {k: self.rng.uniform(*v) for k, v in
                        {"ramp": (0.004, 0.012), "period": (80.0, 140.0), "leak_every": (2.0, 4.0),
                         "long_rate": (0.004, 0.01)}.items()}
        self._prefix = [self.rng.randrange(1, 256) for _ in range(32)]

    # ---- workload -------------------------------------------------------------------------------------
    def _tokens(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(1, 256) for _ in range(self.rng.randint(lo, hi))]

    def _request(self, ids: list[int], max_tokens: int) -> None:
        self.requests += 1
        rid = f"r{self.requests}"
        self.eng.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0), rid)
        self.arrival[rid] = self.now

    def _open(self, turns: int, closes: bool, prompt_len=(24, 64), first_in: float = 0.0) -> None:
        sid = f"c{len(self.convs) + 1}"
        try:
            s = self.sessions.open(session_id=sid)
        except OverloadedError:
            self.refusals += 1
            self._breach("session refused (503)")
            return
        self.convs.append(_Conversation(s, self.now + first_in, turns, closes, prompt_len))

    def _turns(self) -> None:
        for cv in self.convs:
            s = cv.session
            if s.closed or s.turn is not None:
                continue
            if cv.seq is not None:  # its last turn finished
                cv.history = list(cv.seq.token_ids)
                cv.seq = None
                cv.turns -= 1
                cv.next_t = self.now + self.rng.uniform(6.0, 14.0)
            if cv.turns <= 0 or len(cv.history) > 900:
                if cv.closes:
                    s.close()
                continue
            if self.now < cv.next_t:
                continue
            first = cv.seq is None and not cv.history
            if first and self._deferring() and self.now - cv.asked_t < self.defer_new_s:
                if cv.next_t == cv.asked_t:
                    self.deferred += 1
                cv.next_t = self.now + 0.5  # held: asked again in 0.5 s while the forecast lasts
                continue
            ids = cv.history + self._tokens(*cv.prompt_len)
            self.requests += 1
            rid = f"{s.id}-{self.requests}"
            try:
                cv.seq = s.begin_turn(prompt=ids, params=SamplingParams(max_tokens=8, ignore_eos=True,
                                                                        temperature=0.0), request_id=rid)
            except KVKeeperError:
                cv.turns = 0
                continue
            self.arrival[rid] = cv.asked_t if first else self.now

    def _deferring(self) -> bool:
        """Admission control ahead of a forecast breach (``defer_new_s`` > 0): a new conversation's first turn is
        held while the forecaster warns of a usage breach within the breaker's ``act_ahead_s``, at most
        ``defer_new_s`` seconds; its TTFT counts from when it was asked, so the hold is paid in TTFT."""
        fc = self.forecast
        return (self.defer_new_s > 0 and fc is not None and fc.warn and fc.signal == "usage"
                and fc.eta_s is not None and fc.eta_s <= self.breaker.config.act_ahead_s)

    def _rate(self) -> float:
        """Stateless requests per second now."""
        base = 0.8
        if self.kind == "swings":
            return base * (1.0 + 0.7 * math.sin(2 * math.pi * self.now / self._params["period"]))
        return base

    def _arrivals(self) -> None:
        rng = self.rng
        while self._next_arrival <= self.now:
            self._request(self._prefix + self._tokens(16, 64), rng.randint(8, 16))
            self._next_arrival += rng.expovariate(max(self._rate(), 1e-3))
        while self._next_conv <= self.now:
            self._open(turns=rng.randint(2, 3), closes=True)
            self._next_conv += rng.expovariate(0.08)
        if self.now >= self._kind_next:
            self._incident()
        self._turns()

    def _ramp_gap(self, a: float, b: float, since: float) -> float:
        """Seconds to the next arrival of a Poisson process whose rate rises linearly, ``a + b x`` per second
        ``x`` seconds after the onset, drawn at ``since``: the gap ``g`` with ``a g + b (since g + g^2 / 2) = E``,
        ``E`` exponential with mean 1 (inversion of the cumulative rate; e.g. Ross, *Simulation*, 5th ed.,
        5.5).  Before 2026-12-06 the gap was drawn at the rate of the last arrival, so that a long first gap
        at the onset's low rate skipped the ramp (longctx: one request at the onset, then on average 50 s of
        nothing, then a flurry)."""
        e = self.rng.expovariate(1.0)
        lam = a + b * since
        if b <= 0:
            return e / lam
        return (math.sqrt(lam * lam + 2.0 * b * e) - lam) / b

    def _incident(self) -> None:
        """The kind's own load (from the onset; fault-free kinds from the start)."""
        rng, p, since = self.rng, self._params, self.now - (self.onset or 0.0)
        k = self.kind
        first, self._ramp_started = not self._ramp_started, True
        if k == "flood":
            if not first:
                self._open(turns=6, closes=True, first_in=rng.uniform(0, 2))
            self._kind_next = self.now + self._ramp_gap(0.05, p["ramp"], since)
        elif k == "leak":
            self._open(turns=1, closes=False, prompt_len=(48, 96))
            self._kind_next = self.now + p["leak_every"] * rng.uniform(0.7, 1.3)
        elif k == "frag":
            self._open(turns=30, closes=False, prompt_len=(16, 40))
            for _ in range(2):
                self._open(turns=1, closes=True, prompt_len=(20, 60))
            self._kind_next = self.now + rng.uniform(5.0, 9.0)
        elif k == "host":
            self._open(turns=8, closes=True, prompt_len=(48, 96))
            self._kind_next = self.now + rng.uniform(3.0, 6.0)
        elif k == "longctx":
            if not first:
                self._request(self._tokens(640, 1200), 4)
            self._kind_next = self.now + self._ramp_gap(0.02, p["long_rate"], since)
        elif k == "bursts":
            if self.now > 20:
                for _ in range(rng.randint(4, 8)):
                    self._request(self._prefix + self._tokens(16, 48), rng.randint(8, 12))
            self._kind_next = self.now + rng.uniform(25.0, 45.0)
        else:  # swings: the rate alone
            self._kind_next = math.inf

    def _offload_idle(self) -> None:
        """The host kind's server offloads conversations idle for 4 s to its (small) host tier."""
        if self.kind != "host":
            return
        for cv in self.convs:
            s = cv.session
            if not s.closed and s.idle and s.kv is not None and s.kv.block_table and self.now - cv.next_t > -4.0:
                try:
                    s.offload("host")
                except KVKeeperError:
                    pass

    # ---- the clock and the step -----------------------------------------------------------------------
    def _step(self) -> None:
        sched = self.eng.scheduler
        before = {id(s): (s, s.num_computed) for s in list(sched.running) + list(sched.waiting)}
        self.eng.step()
        tokens = ctx = 0
        for s, n0 in before.values():
            d = s.num_computed - n0
            if d > 0:
                tokens += d
                ctx += s.num_computed
        dt = self.cfg.cost.step_s(tokens, ctx) if tokens else self.cfg.idle_tick_s
        self.now += dt
        self.busy_s += dt if tokens else 0.0
        for rid in self._pending_first:
            t0 = self.arrival.pop(rid, None)
            if t0 is not None:
                self.first_tokens.append((self.now, self.now - t0))
        self._pending_first.clear()

    def _breach(self, reason: str) -> None:
        if self.breach_s is None:
            self.breach_s, self.breach_reason = round(self.now, 3), reason

    def _sample(self) -> dict:
        c, eng = self.cfg, self.eng
        st = eng.kv.pool_stats()
        w = [x for t, x in self.first_tokens if t > self.now - c.ttft_window_s]
        w.sort()
        p99 = w[min(len(w) - 1, math.ceil(0.99 * len(w)) - 1)] if w else 0.0
        cnt = (eng.kv.num_evictions - self.breaker.evicted_blocks, eng.scheduler.num_preemptions,
               *eng.kv.prefix_tokens(), self.busy_s)
        prev, self._prev = self._prev, cnt
        dt = c.sample_every_s
        ev = pr = busy = 0.0
        hit = 1.0
        if prev is not None:
            busy = min(1.0, (cnt[4] - prev[4]) / dt)
            ev = (cnt[0] - prev[0]) / st.num_blocks / dt
            pr = (cnt[1] - prev[1]) / dt
            q = cnt[2] - prev[2]
            hit = (cnt[3] - prev[3]) / q if q > 0 else 1.0
        host = self.sessions.store.bytes_in("host") / c.host_offload_bytes
        s = {"t": round(self.now, 3), "usage": st.usage, "pool_rate": st.pool_rate,
             "waiting": len(eng.scheduler.waiting), "running": len(eng.scheduler.running), "ttft_p99": p99,
             "ttft_mean": sum(w) / len(w) if w else 0.0, "eviction_rate": ev, "preemption_rate": pr, "hit_rate": hit,
             "host_fill": host, "sessions": sum(1 for cv in self.convs if not cv.session.closed),
             "tier": self.breaker.tier, "prefill_backlog": prefill_backlog(eng.scheduler), "busy": busy,
             "head_wait_s": self._head_wait()}
        s = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in s.items()}
        if p99 > c.ttft_objective_s:
            self._breach(f"TTFT p99 {p99:.2f} s over the {c.ttft_objective_s:g} s objective")
        if self.breaker.tier >= 2:
            self._breach(f"breaker tier {self.breaker.tier} (above compaction)")
        return s

    def _head_wait(self) -> float:
        """Seconds the oldest queued request without a first token has waited (0 when none): requests still in
        the scheduler only, so that an aborted one does not age forever."""
        sched = self.eng.scheduler
        ts = [self.arrival[s.request_id] for s in list(sched.waiting) + list(sched.running)
              if s.request_id in self.arrival]
        return self.now - min(ts) if ts else 0.0

    def run(self) -> dict:
        c = self.cfg
        next_sample = 0.0
        while self.now < c.duration_s:
            if self.breach_s is not None and self.now >= self.breach_s + c.after_breach_s:
                break
            self._arrivals()
            self._offload_idle()
            if self.eng.has_unfinished():
                self._step()
            else:
                self.breaker.evaluate()
                self.now += c.idle_tick_s
            while self.now >= next_sample:
                sample = self._sample()
                sample["t"] = round(next_sample, 3)
                self.samples.append(sample)
                if self.forecaster is not None:
                    self.forecast = self.forecaster.update(sample)
                next_sample += c.sample_every_s
        return {"kind": self.kind, "seed": self.seed, "onset_s": self.onset, "breach_s": self.breach_s,
                "breach_reason": self.breach_reason, "refusals": self.refusals, "requests": self.requests,
                "breaker_actions": {f"{t}:{a}": n for (t, a), n in sorted(self.breaker.actions.items())},
                "deferred_first_turns": self.deferred,
                "samples": self.samples, "config": _jsonable(asdict(c))}


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def run_episode(kind: str, seed: int, **kw) -> dict:
    """The trace of one episode (see :class:`Episode`)."""
    return Episode(kind, seed, **kw).run()
