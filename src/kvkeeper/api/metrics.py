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
kvkeeper:num_requests_running              gauge      sequences being prefilled or decoded
kvkeeper:num_requests_waiting              gauge      sequences queued (engine queue plus not yet admitted)
kvkeeper:num_preemptions_total             counter    sequences preempted for lack of blocks
kvkeeper:sessions_open                     gauge      open sessions (``X-Session-ID``)
kvkeeper:pinned_blocks                     gauge      KV blocks pinned by idle sessions (blocks)
kvkeeper:kv_cache_bytes_per_token          gauge      KV bytes per token, all layers, values plus scales (bytes)
kvkeeper:kv_audit_total                    counter    requests whose reused KV was audited (requests)
kvkeeper:kv_audit_mismatch_total           counter    of those, with a divergent layer or logits (requests)
kvkeeper:kv_audit_skipped_total            counter    sampled for the audit but not audited (requests)
kvkeeper:time_to_first_token_seconds       histogram  arrival to first token (s)
kvkeeper:time_per_output_token_seconds     histogram  mean gap between output tokens of a request (s)
kvkeeper:e2e_request_latency_seconds       histogram  arrival to finish (s)
=========================================  =========  =====================================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
    "kv_audit_total": ("kvkeeper:kv_audit", "counter",
                       "Requests whose prompt KV was recomputed and compared (reuse audit) (requests)."),
    "kv_audit_mismatch_total": ("kvkeeper:kv_audit_mismatch", "counter",
                                "Audited requests with a divergent layer or first-token logits (requests)."),
    "kv_audit_skipped_total": ("kvkeeper:kv_audit_skipped", "counter",
                               "Requests sampled for the audit but not audited: compressed KV or an audit "
                               "error (requests)."),
}


class _SnapshotCollector:
    def __init__(self, owner: "ServerMetrics"):
        self.owner = owner

    def collect(self):
        snap = self.owner.snapshot
        for key, (name, kind, doc) in _FROM_SNAPSHOT.items():
            fam = GaugeMetricFamily(name, doc) if kind == "gauge" else CounterMetricFamily(name, doc)
            fam.add_metric([], float(snap.get(key, 0)))
            yield fam


class ServerMetrics:
    """The server's registry: engine-state snapshot plus latency histograms (seconds)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.snapshot: dict = {}
        self.registry.register(_SnapshotCollector(self))
        self.ttft = Histogram("kvkeeper:time_to_first_token_seconds", "Time from arrival to first token (s).",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvkeeper:time_per_output_token_seconds",
                              "Mean time between output tokens of a request (s).", buckets=_TPOT_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("kvkeeper:e2e_request_latency_seconds", "Time from arrival to finish (s).",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def update(self, snapshot: dict) -> None:
        """Replace the engine-state snapshot (called from the engine thread; a dict swap is atomic)."""
        self.snapshot = snapshot

    def observe_sequence(self, seq, t_end: float) -> None:
        """Record one finished sequence's latencies (perf_counter seconds)."""
        if seq.t_first_token is not None:
            self.ttft.observe(seq.t_first_token - seq.t_arrival)
            n = seq.num_output_tokens
            if n > 1 and seq.t_last_token is not None:
                self.tpot.observe((seq.t_last_token - seq.t_first_token) / (n - 1))
        self.e2e.observe(t_end - seq.t_arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
