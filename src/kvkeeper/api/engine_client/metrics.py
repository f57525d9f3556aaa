"""Prometheus metrics of the server, on their own ``CollectorRegistry``.

Gauges and counters that mirror engine state are read from a snapshot the engine
thread refreshes after every step (so the event loop never touches the engine);
latency histograms are observed by the engine thread when a request finishes.

=========================================  =========  =====================================================
name                                       kind       meaning (unit)
=========================================  =========  =====================================================
kvkeeper:kv_cache_usage_perc               gauge      fraction of KV blocks referenced (0..1)
kvkeeper:prefix_cache_queries_total        counter    prompt tokens looked up in the prefix cache (tokens)
kvkeeper:prefix_cache_hits_total           counter    of those, tokens found cached (tokens)
kvkeeper:prompt_tokens_total               counter    prompt tokens of finished requests, as their usage's
                                                      prompt_tokens (tokens)
kvkeeper:prompt_tokens_cached_total{source} counter   of those, served from cache, as usage's cached_tokens, by
                                                      ``source`` (:data:`REUSE_SOURCES`): prefix_cache, session
                                                      (a session's own KV handed to its next turn), fork (a
                                                      forked session's or previous_response_id's), host / disk
                                                      (restored from the tier), import (an imported session's);
                                                      the true reuse share = cached / prompt (tokens)
kvkeeper:num_requests_running              gauge      sequences being prefilled or decoded
kvkeeper:num_requests_waiting              gauge      sequences queued (engine queue plus not yet admitted)
kvkeeper:num_preemptions_total             counter    sequences preempted for lack of blocks
kvkeeper:sessions_open                     gauge      open sessions (``X-Session-ID``)
kvkeeper:pinned_blocks                     gauge      KV blocks pinned by idle sessions (blocks)
kvkeeper:sessions_expired_total            counter    sessions closed after --session-ttl idle (sessions)
kvkeeper:kv_cache_bytes_per_token          gauge      KV bytes per token, all layers, values plus scales (bytes)
kvkeeper:weight_format{format}             gauge      1 for the weight format the model runs (--quantization):
                                                      none, gguf, int8 or int4
kvkeeper:breaker_tier                      gauge      circuit breaker tier: 0 closed, 1 compaction, 2 offload, 3 degrade
kvkeeper:breaker_trips_total               counter    times the breaker tripped from closed
kvkeeper:breaker_actions_total             counter    breaker actions, labels ``tier`` and ``action``
kvkeeper:kv_audit_total                    counter    requests whose reused KV was audited (requests)
kvkeeper:kv_audit_mismatch_total           counter    of those, with a divergent layer or logits (requests)
kvkeeper:kv_audit_skipped_total            counter    sampled for the audit but not audited (requests)
kvkeeper:kv_health_score                  gauge      KV cache health score of the EWMA detector
                                                      (kvkeeper.diagnostics.health): 1 healthy, 0.5 on a
                                                      control limit, 0 at twice the limit (0..1)
kvkeeper:kv_health_warnings_total          counter    health warnings opened (warnings)
kvkeeper:kv_health_breach_eta_seconds      gauge      predicted seconds to a breach (--health-predictor); +Inf
                                                      when none is forecast (s)
kvkeeper:time_to_first_token_seconds       histogram  arrival to first token (s)
kvkeeper:time_per_output_token_seconds     histogram  mean gap between output tokens of a request (s)
kvkeeper:e2e_request_latency_seconds       histogram  arrival to finish (s)
kvkeeper:kv_fragmentation_internal         gauge      unused token slots in owned blocks / owned slots,
                                                      mean over ``window`` = 1s, 10s, 60s (0..1)
kvkeeper:kv_fragmentation_external         gauge      1 - longest run of free block ids / free blocks (free
                                                      plus cached), mean over ``window`` (0..1)
kvkeeper:kv_fragmentation_rate             gauge      pool fragmentation rate: (owned - longest run of owned
                                                      ids) / owned, mean over ``window`` (0..1)
kvkeeper:kv_blocks                         gauge      blocks by ``state``: free, cached, owned (these three sum
                                                      to the pool size) and offloaded (outside the pool) (blocks)
kvkeeper:kv_offload_total{tier}            counter    idle sessions offloaded to tier host / disk (sessions)
kvkeeper:kv_offload_bytes_total{tier}      counter    KV bytes written to the tier (bytes)
kvkeeper:kv_restore_total{tier}            counter    sessions whose KV came back from the tier (sessions)
kvkeeper:kv_restore_failures_total{tier}   counter    offloaded sessions recomputed instead (corrupt file, no room)
kvkeeper:kv_checkpoint_total               counter    idle sessions copied to disk, KV kept in the pool (sessions)
kvkeeper:kv_offloaded_bytes{tier}          gauge      KV bytes held in the tier now (bytes)
kvkeeper:kv_offloaded_blocks               gauge      blocks' worth of KV held in host plus disk tiers (blocks)
kvkeeper:kv_held_blocks                    gauge      blocks under a live retention hold (cache_control
                                                      breakpoints, prompt_cache_retention 24h): kept from LRU
                                                      eviction, at most --kv-hold-share of the pool (blocks)
kvkeeper:kv_holds                          gauge      live retention holds (holds)
kvkeeper:kv_holds_expired_total            counter    holds ended at their deadline (holds)
kvkeeper:kv_holds_gave_way_total           counter    holds ended early because an allocation found no other
                                                      block; their blocks were evicted, not offloaded (holds)
kvkeeper:kv_holds_displaced_total          counter    holds ended early by a newer hold over the share bound
kvkeeper:cache_miss_total{reason}          counter    session / prompt_cache_key requests that read less from the
                                                      cache than their predecessor left, by ``reason``:
                                                      content_changed, namespace_changed, evicted
                                                      (:mod:`kvkeeper.api.engine_client.cache_miss`) (requests)
kvkeeper:context_turns_total               counter    session turns by context ``policy`` and ``kind``: kept,
                                                      dropped, summarized, retrieved, over the session turns (turns)
kvkeeper:context_memory_seconds            histogram  time a turn spent storing and retrieving memory (s)
kvkeeper:spec_decode_num_drafts_total      counter    decode rows that carried draft tokens (speculative decoding)
kvkeeper:spec_decode_num_draft_tokens_total counter   draft tokens scored (tokens)
kvkeeper:spec_decode_num_accepted_tokens_total counter draft tokens accepted (tokens)
kvkeeper:spec_decode_num_accepted_tokens_per_pos_total counter  accepted draft tokens by ``position`` in the draft
                                                      (0 = first); per-position acceptance rate = this / drafts
kvkeeper:context_summary_seconds           histogram  time a turn spent writing its session's summary, on the
                                                      engine thread (s; turns of summary / hybrid sessions)
=========================================  =========  =====================================================

The fragmentation figures are defined in :mod:`kvkeeper.kvcache.telemetry`; the engine
thread samples them at most every 0.1 s (see :mod:`kvkeeper.api.engine_client.async_engine`).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...sessions.breaker import ACTIONS
from .cache_miss import REASONS as MISS_REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# snapshot key -> (metric name, kind, help)
_FROM_SNAPSHOT = {
    "kv_usage": ("kvkeeper:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks referenced (0..1)."),
    "prefix_query_tokens": ("kvkeeper:prefix_cache_queries", "counter",
                            "Prompt tokens looked up in the prefix cache (tokens)."),
    "prefix_hit_tokens": ("kvkeeper:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache (tokens)."),
    "num_running": ("kvkeeper:num_requests_running", "gauge", "Sequences running (prefill or decode)."),
    "num_waiting": ("kvkeeper:num_requests_waiting", "gauge", "Sequences waiting to be scheduled."),
    "num_preemptions": ("kvkeeper:num_preemptions", "counter", "Sequences preempted for lack of KV blocks."),
    "sessions": ("kvkeeper:sessions_open", "gauge", "Open sessions."),
    "kv_bytes_per_token": ("kvkeeper:kv_cache_bytes_per_token", "gauge",
                           "KV cache bytes per token across all layers, values plus scales (bytes)."),
    "pinned_blocks": ("kvkeeper:pinned_blocks", "gauge", "KV blocks pinned by idle sessions (blocks)."),
    "sessions_expired": ("kvkeeper:sessions_expired", "counter", "Sessions closed after --session-ttl idle "
                         "(sessions)."),
    "kv_audit_total": ("kvkeeper:kv_audit", "counter",
                       "Requests whose prompt KV was recomputed and compared (reuse audit) (requests)."),
    "kv_audit_mismatch_total": ("kvkeeper:kv_audit_mismatch", "counter",
                                "Audited requests with a divergent layer or first-token logits (requests)."),
    "kv_audit_skipped_total": ("kvkeeper:kv_audit_skipped", "counter",
                               "Requests sampled for the audit but not audited: compressed KV or an audit "
                               "error (requests)."),
    "spec_decode.num_drafts": ("kvkeeper:spec_decode_num_drafts", "counter",
                               "Decode rows that carried draft tokens (speculative decoding)."),
    "spec_decode.num_draft_tokens": ("kvkeeper:spec_decode_num_draft_tokens", "counter",
                                     "Draft tokens scored by speculative decoding (tokens)."),
    "spec_decode.num_accepted_tokens": ("kvkeeper:spec_decode_num_accepted_tokens", "counter",
                                        "Draft tokens accepted by speculative decoding (tokens)."),
    "kv_health_score": ("kvkeeper:kv_health_score", "gauge", "KV cache health score of the EWMA detector: 1 "
                        "healthy, 0.5 on a control limit, 0 at twice the limit (0..1)."),
    "kv_health_warnings": ("kvkeeper:kv_health_warnings", "counter", "KV cache health warnings opened (warnings)."),
    "kv_health_breach_eta_seconds": ("kvkeeper:kv_health_breach_eta_seconds", "gauge",
                                     "Predicted seconds until the server breaches (usage past the breaker's "
                                     "threshold, TTFT over its objective); +Inf when no breach is forecast (s)."),
    "kv_held_blocks": ("kvkeeper:kv_held_blocks", "gauge", "KV blocks under a live retention hold (cache_control "
                       "breakpoints, prompt_cache_retention 24h), kept from LRU eviction (blocks)."),
    "kv_holds": ("kvkeeper:kv_holds", "gauge", "Live retention holds (holds)."),
    "kv_holds_expired": ("kvkeeper:kv_holds_expired", "counter", "Retention holds ended at their deadline (holds)."),
    "kv_holds_gave_way": ("kvkeeper:kv_holds_gave_way", "counter", "Retention holds ended early because an "
                          "allocation found no other block; their blocks were evicted (holds)."),
    "kv_holds_displaced": ("kvkeeper:kv_holds_displaced", "counter", "Retention holds ended early by a newer hold "
                           "over the --kv-hold-share bound (holds)."),
    # the offload tiers (snapshot["offload"]); a dict value is one sample per tier (label ``tier``)
    "offload.offload_total": ("kvkeeper:kv_offload", "counter", "Idle sessions offloaded to the tier (sessions)."),
    "offload.offload_bytes_total": ("kvkeeper:kv_offload_bytes", "counter", "KV bytes written to the tier (bytes)."),
    "offload.restore_total": ("kvkeeper:kv_restore", "counter",
                              "Sessions whose KV came back from the tier (sessions)."),
    "offload.restore_failures_total": ("kvkeeper:kv_restore_failures", "counter",
                                       "Offloaded sessions recomputed instead of restored (sessions)."),
    "offload.checkpoint_total": ("kvkeeper:kv_checkpoint", "counter",
                                 "Idle sessions copied to the disk tier, their KV kept in the pool (sessions)."),
    "offload.offloaded_bytes": ("kvkeeper:kv_offloaded_bytes", "gauge", "KV bytes held in the tier now (bytes)."),
    "offload.offloaded_blocks": ("kvkeeper:kv_offloaded_blocks", "gauge",
                                 "Blocks' worth of KV held in the host and disk tiers."),
}
_PER_TIER = {"offload.offload_total", "offload.offload_bytes_total", "offload.restore_total",
             "offload.restore_failures_total", "offload.offloaded_bytes"}
TIERS = ("host", "disk")
# where a request's reused prompt KV came from (kvkeeper:prompt_tokens_cached_total's ``source``)
REUSE_SOURCES = ("prefix_cache", "session", "fork", "host", "disk", "import")


_ABSENT = {"kv_health_breach_eta_seconds": math.inf}  # what an absent key reads as, when not 0


def _lookup(snap: dict, key: str):
    """The snapshot's value at a dotted key (0 when absent, or its :data:`_ABSENT` value)."""
    v = snap
    for k in key.split("."):
        v = v.get(k) if isinstance(v, dict) else None
    return _ABSENT.get(key, 0) if v is None else v


class _SnapshotCollector:
    def __init__(self, owner: "ServerMetrics"):
        self.owner = owner

    def collect(self):
        snap = self.owner.snapshot
        for key, (name, kind, doc) in _FROM_SNAPSHOT.items():
            tiered = key in _PER_TIER
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, doc, labels=["tier"] if tiered else None)
            v = _lookup(snap, key)
            for tier in TIERS if tiered else (None,):
                fam.add_metric([tier] if tiered else [], float(v.get(tier, 0) if isinstance(v, dict) else v))
            yield fam
        if snap.get("weight_format"):
            w = GaugeMetricFamily("kvkeeper:weight_format", "Weight format the model runs, label format "
                                  "(--quantization: none, gguf, int8, int4); value 1.", labels=["format"])
            w.add_metric([snap["weight_format"]], 1.0)
            yield w
        per_pos = (snap.get("spec_decode") or {}).get("accepted_per_position")
        if per_pos:
            c = CounterMetricFamily("kvkeeper:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by "
                                    "position in the draft (0 = first) (tokens).", labels=["position"])
            for i, n in enumerate(per_pos):
                c.add_metric([str(i)], float(n))
            yield c
        br = snap.get("breaker")
        if br is not None:
            g = GaugeMetricFamily("kvkeeper:breaker_tier",
                                  "Circuit breaker tier: 0 closed, 1 compaction, 2 offload, 3 degrade.")
            g.add_metric([], float(br["tier"]))
            yield g
            c = CounterMetricFamily("kvkeeper:breaker_trips", "Times the KV circuit breaker tripped from closed.")
            c.add_metric([], float(br["trips"]))
            yield c
            a = CounterMetricFamily("kvkeeper:breaker_actions", "Circuit breaker actions by tier and action.",
                                    labels=["tier", "action"])
            counts = dict.fromkeys(ACTIONS, 0.0)  # every series from start-up: a dashboard shows 0, not "no data"
            for item in br["actions"]:
                counts[(item["tier"], item["action"])] = float(item["count"])
            for (tier, action), n in sorted(counts.items()):
                a.add_metric([tier, action], n)
            yield a


# figure of kvkeeper.kvcache.telemetry.PoolStats -> (metric name, help)
_FRAGMENTATION = {
    "internal": ("kvkeeper:kv_fragmentation_internal",
                 "Internal fragmentation: unused token slots in owned KV blocks / owned slots, window mean (0..1)."),
    "external": ("kvkeeper:kv_fragmentation_external",
                 "External fragmentation: 1 - longest run of free block ids / free blocks, window mean (0..1)."),
    "pool_rate": ("kvkeeper:kv_fragmentation_rate",
                  "Pool fragmentation rate: (owned - longest run of owned block ids) / owned, window mean (0..1)."),
}
BLOCK_STATES = ("free", "cached", "owned", "offloaded")


class _FragmentationCollector:
    """Fragmentation window means (label ``window``) and block counts by state (label ``state``)."""

    def __init__(self, owner: "ServerMetrics"):
        self.owner = owner

    def collect(self):
        snap = self.owner.snapshot
        wins = snap.get("kv_fragmentation") or {}
        for fig, (name, doc) in _FRAGMENTATION.items():
            fam = GaugeMetricFamily(name, doc, labels=["window"])
            for w, vals in wins.items():
                fam.add_metric([w], float(vals.get(fig, 0.0)))
            yield fam
        states = snap.get("kv_block_states") or {}
        fam = GaugeMetricFamily("kvkeeper:kv_blocks", "KV blocks by state: free, cached, owned (summing to the pool "
                                "size) and offloaded (session KV outside the pool) (blocks).", labels=["state"])
        for st in BLOCK_STATES:
            if st in states:
                fam.add_metric([st], float(states[st]))
        yield fam


class ServerMetrics:
    """The server's registry: engine-state snapshot plus latency histograms (seconds)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.snapshot: dict = {}
        self.ttft_sum = 0.0  # seconds, over the sequences observed (the health detector's TTFT signal)
        self.ttft_count = 0
        self.registry.register(_SnapshotCollector(self))
        self.registry.register(_FragmentationCollector(self))
        self.ttft = Histogram("kvkeeper:time_to_first_token_seconds", "Time from arrival to first token (s).",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvkeeper:time_per_output_token_seconds",
                              "Mean time between output tokens of a request (s).", buckets=_TPOT_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("kvkeeper:e2e_request_latency_seconds", "Time from arrival to finish (s).",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.prompt_tokens = Counter("kvkeeper:prompt_tokens", "Prompt tokens of finished requests, as their usage's "
                                     "prompt_tokens (tokens).", registry=self.registry)
        self.cached_tokens = Counter("kvkeeper:prompt_tokens_cached", "Prompt tokens served from cache, as usage's "
                                     "cached_tokens, by source: prefix_cache, session, fork, host, disk, import "
                                     "(tokens).", ["source"], registry=self.registry)
        for src in REUSE_SOURCES:
            self.cached_tokens.labels(src)  # every series from start-up: a dashboard shows 0, not "no data"
        self.cache_misses = Counter("kvkeeper:cache_miss", "Session or prompt_cache_key requests that read less "
                                    "from the cache than their predecessor left, by reason: content_changed, "
                                    "namespace_changed, evicted (requests).", ["reason"], registry=self.registry)
        for reason in MISS_REASONS:
            self.cache_misses.labels(reason)
        self.context_turns = Counter("kvkeeper:context_turns", "Turns of session prompts by context policy and "
                                     "kind: kept, dropped, summarized, retrieved (turns).", ["policy", "kind"],
                                     registry=self.registry)
        self.context_memory = Histogram("kvkeeper:context_memory_seconds", "Time a turn spent storing and "
                                        "retrieving vector memory (s).", buckets=_TPOT_BUCKETS, registry=self.registry)
        self.context_summary = Histogram("kvkeeper:context_summary_seconds", "Time a turn spent writing its "
                                         "session's summary on the engine thread (s).", buckets=_LATENCY_BUCKETS,
                                         registry=self.registry)

    def observe_context(self, report) -> None:
        """Count one turn's :class:`~kvkeeper.sessions.context.ContextReport` (engine thread)."""
        for kind in ("kept", "dropped", "summarized", "retrieved"):
            self.context_turns.labels(report.policy, kind).inc(getattr(report, kind))
        if report.policy in ("memory", "hybrid"):
            self.context_memory.observe(report.memory_ms / 1000.0)
        if report.policy in ("summary", "hybrid"):
            self.context_summary.observe(report.summary_ms / 1000.0)

    def observe_cache_miss(self, reason: str) -> None:
        """Count one explained cache miss (engine thread)."""
        self.cache_misses.labels(reason).inc()

    def observe_usage(self, seq, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one finished request's usage (tokens): ``cached_tokens`` split between the KV a session handed
        ``seq`` (the lead sequence; ``seq.num_handed_over`` under ``seq.reuse_source``) and the prefix cache."""
        self.prompt_tokens.inc(prompt_tokens)
        handed = min(seq.num_handed_over, cached_tokens) if seq.reuse_source in REUSE_SOURCES else 0
        if handed:
            self.cached_tokens.labels(seq.reuse_source).inc(handed)
        if cached_tokens > handed:
            self.cached_tokens.labels("prefix_cache").inc(cached_tokens - handed)

    def update(self, snapshot: dict) -> None:
        """Replace the engine-state snapshot (called from the engine thread; a dict swap is atomic)."""
        self.snapshot = snapshot

    def observe_sequence(self, seq, t_end: float) -> None:
        """Record one finished sequence's latencies (perf_counter seconds)."""
        if seq.t_first_token is not None:
            self.ttft.observe(seq.t_first_token - seq.t_arrival)
            self.ttft_sum += seq.t_first_token - seq.t_arrival
            self.ttft_count += 1
            n = seq.num_output_tokens
            if n > 1 and seq.t_last_token is not None:
                self.tpot.observe((seq.t_last_token - seq.t_first_token) / (n - 1))
        self.e2e.observe(t_end - seq.t_arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
