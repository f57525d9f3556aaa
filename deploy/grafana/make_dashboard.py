"""Write deploy/grafana/kvkeeper.json, the Grafana dashboard of kvkeeper's /metrics (run from the repo root).

Plain JSON of the Grafana dashboard model (schemaVersion 39, Grafana 10/11); the Prometheus data source is
a dashboard variable, chosen at import.  tests/api/test_grafana_dashboard.py checks that every metric its
queries name is exported by a running server.
"""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"


def target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def panel(pid: int, title: str, targets: list[tuple[str, str]], x: int, y: int, w: int = 8, h: int = 8,
          unit: str = "short", kind: str = "timeseries", stack: bool = False, extra: dict | None = None) -> dict:
    custom = {"lineWidth": 2, "fillOpacity": 20 if stack else 0, "showPoints": "never",
              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    p = {
        "id": pid, "type": kind, "title": title, "datasource": DS, "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [target(e, lg, chr(ord("A") + i)) for i, (e, lg) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, **({"custom": custom} if kind == "timeseries" else {})},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}} if kind == "timeseries" else
                   {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "background", "graphMode": "area", "textMode": "value_and_name"},
    }
    if extra:
        p["fieldConfig"]["defaults"].update(extra)
    return p


def quantiles(metric: str, what: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate(kvkeeper:{metric}_bucket[{RATE}])))", f"{what} p{int(q * 100)}")
            for q in (0.5, 0.9, 0.99)]


BREAKER_TIERS = {"type": "value", "options": {
    "0": {"text": "closed", "color": "green", "index": 0}, "1": {"text": "compaction", "color": "yellow", "index": 1},
    "2": {"text": "offload", "color": "orange", "index": 2}, "3": {"text": "degrade", "color": "red", "index": 3}}}


def row(pid: int, title: str, y: int) -> dict:
    return {"id": pid, "type": "row", "title": title, "collapsed": False, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
            "panels": []}


def panels() -> list[dict]:
    return [
        row(1, "KV cache", 0),
        panel(2, "KV cache usage", [("kvkeeper:kv_cache_usage_perc", "usage")], 0, 1, unit="percentunit",
              extra={"min": 0, "max": 1}),
        panel(3, "KV blocks by state", [("kvkeeper:kv_blocks", "{{state}}")], 8, 1, stack=True),
        panel(4, "Fragmentation (window means)",
              [("kvkeeper:kv_fragmentation_internal", "internal {{window}}"),
               ("kvkeeper:kv_fragmentation_external", "external {{window}}"),
               ("kvkeeper:kv_fragmentation_rate", "pool rate {{window}}")], 16, 1, unit="percentunit",
              extra={"min": 0, "max": 1}),
        panel(5, "Cache hit rate: prompt tokens served from cache (every reuse path)",
              [(f"sum(rate(kvkeeper:prompt_tokens_cached_total[{RATE}])) / "
                f"clamp_min(sum(rate(kvkeeper:prompt_tokens_total[{RATE}])), 1e-9)", "all reuse"),
               (f"sum by (source) (rate(kvkeeper:prompt_tokens_cached_total[{RATE}])) / ignoring (source) "
                f"group_left clamp_min(sum(rate(kvkeeper:prompt_tokens_total[{RATE}])), 1e-9)", "{{source}}"),
               (f"sum(rate(kvkeeper:prefix_cache_hits_total[{RATE}])) / "
                f"clamp_min(sum(rate(kvkeeper:prefix_cache_queries_total[{RATE}])), 1e-9)",
                "prefix-cache lookups only")],
              0, 9, unit="percentunit", extra={"min": 0, "max": 1}),
        panel(6, "Sessions open and pinned blocks",
              [("kvkeeper:sessions_open", "sessions open"), ("kvkeeper:pinned_blocks", "pinned blocks")], 8, 9),
        panel(7, "Offloaded KV by tier",
              [("kvkeeper:kv_offloaded_bytes", "{{tier}}"),
               (f"sum by (tier) (rate(kvkeeper:kv_restore_total[{RATE}]))", "restores/s {{tier}}")], 16, 9,
              unit="bytes"),
        row(8, "Circuit breaker and audit", 17),
        panel(9, "Breaker tier", [("kvkeeper:breaker_tier", "tier")], 0, 18, w=6, kind="stat",
              extra={"mappings": [BREAKER_TIERS], "min": 0, "max": 3}),
        panel(10, "Breaker actions", [(f"sum by (tier, action) (increase(kvkeeper:breaker_actions_total[{RATE}]))",
                                       "{{tier}}: {{action}}"),
                                      (f"increase(kvkeeper:breaker_trips_total[{RATE}])", "trips")], 6, 18, w=9),
        panel(11, "KV audit mismatches", [(f"increase(kvkeeper:kv_audit_mismatch_total[{RATE}])", "mismatches"),
                                          (f"increase(kvkeeper:kv_audit_total[{RATE}])", "audits"),
                                          (f"increase(kvkeeper:kv_audit_skipped_total[{RATE}])", "skipped")],
              15, 18, w=9),
        row(12, "Latency and load", 26),
        panel(13, "Time to first token", quantiles("time_to_first_token_seconds", "TTFT"), 0, 27, unit="s"),
        panel(14, "Time per output token", quantiles("time_per_output_token_seconds", "TPOT"), 8, 27, unit="s"),
        panel(15, "End-to-end request latency", quantiles("e2e_request_latency_seconds", "e2e"), 16, 27, unit="s"),
        panel(16, "Requests running and waiting",
              [("kvkeeper:num_requests_running", "running"), ("kvkeeper:num_requests_waiting", "waiting"),
               (f"rate(kvkeeper:num_preemptions_total[{RATE}])", "preemptions/s")], 0, 35, w=12),
    ]


def dashboard() -> dict:
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
                      "pluginName": "Prometheus"}],
        "uid": "kvkeeper", "title": "kvkeeper", "tags": ["kvkeeper", "llm", "kv-cache"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "timezone": "", "graphTooltip": 1, "links": [], "annotations": {"list": []},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0, "refresh": 1}]},
        "panels": panels(),
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("kvkeeper.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
