"""The Grafana dashboard (deploy/grafana/kvkeeper.json) queries only metrics a running server exports."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils.serverproc import running_server
from tests.utils.paths import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "kvkeeper.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "le", "inf", "nan"}
# what the dashboard must show (issue 19): a word of each panel title
TOPICS = ("usage", "blocks by state", "fragmentation", "hit rate", "sessions open and pinned blocks", "breaker tier",
          "breaker actions", "audit mismatches", "time to first token", "time per output token", "end-to-end",
          "running and waiting")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads: identifiers outside strings, label matchers, ranges and
    by/without/on/ignoring lists that are not function calls, keywords or numbers."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", "", e)  # numbers (1e-9, 0.99)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or m.group().lower() in PROMQL_WORDS or m.group().startswith("$"):
            continue
        if m.start() and e[m.start() - 1] == "$":
            continue
        names.add(m.group())
    return names


def dashboard_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def exported_names(text: str) -> set[str]:
    """Sample names of a /metrics page, plus the names a declared counter or histogram family will have."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names.update(fam.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(fam.name)
    return names


def test_metric_name_parser():
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(kvkeeper:ttft_bucket{job="a"}[$__rate_interval])))') \
        == {"kvkeeper:ttft_bucket"}
    assert metric_names("sum(rate(a_total[5m])) / clamp_min(sum(rate(b_total[5m])), 1e-9)") == {"a_total", "b_total"}
    assert metric_names('x{window="10s"} and on (tier) y') == {"x", "y"}


def test_dashboard_is_well_formed_and_covers_the_topics():
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) and doc["uid"] and doc["schemaVersion"] >= 36
    titles = " | ".join(p["title"].lower() for p in doc["panels"])
    for topic in TOPICS:
        assert topic in titles, topic
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    for title, expr in exprs:
        names = metric_names(expr)
        assert names and all(n.startswith("kvkeeper:") for n in names), (title, expr, names)
    assert all(p.get("datasource", {}).get("uid") == "${datasource}" for p in doc["panels"] if p["type"] != "row")


def sample_names(text: str) -> set[str]:
    """Names of the samples a /metrics page holds (a declared family without samples counts for nothing)."""
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def queried_names() -> set[str]:
    return {n for _title, expr in dashboard_exprs() for n in metric_names(expr)}


@pytest.mark.slow
def test_every_dashboard_metric_is_exported(tmp_path):
    with running_server(tmp_path / "server.log", "--kv-blocks", "64") as base:
        fresh = httpx.get(base + "/metrics", timeout=30).text  # before any request: every series at its zero
        r = httpx.post(base + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        text = httpx.get(base + "/metrics", timeout=30).text
    missing = sorted(queried_names() - sample_names(fresh))
    assert not missing, f"before any traffic, /metrics has no series of what the dashboard queries: {missing}"
    from kvkeeper.sessions.breaker import ACTIONS

    actions = {(s.labels["tier"], s.labels["action"]) for fam in text_string_to_metric_families(fresh)
               for s in fam.samples if s.name == "kvkeeper:breaker_actions_total"}
    assert actions == set(ACTIONS)  # every labelled series, not just one
    exported = exported_names(text)
    missing = {(title, n) for title, expr in dashboard_exprs() for n in metric_names(expr) if n not in exported}
    assert not missing, f"the dashboard queries metrics /metrics does not export: {sorted(missing)}"
    # the check can fail: a misspelt name is caught
    assert "kvkeeper:kv_cache_usage_percent" not in exported


def test_every_breaker_action_is_declared():
    """ACTIONS (the series /metrics exports from start-up) lists every action the breaker counts."""
    import re

    import kvkeeper.sessions.breaker as br

    src = open(br.__file__, encoding="utf-8").read()
    counted = {(br.TIER_NAMES[int(t)], a) for t, a in re.findall(r'_event\((\d), "(\w+)"', src)}
    counted |= set(re.findall(r'actions\[\("(\w+)", "(\w+)"\)\]', src))
    assert counted and counted == set(br.ACTIONS)


def test_the_hit_rate_panel_shows_every_reuse_path():
    """Issue 44: the hit-rate panel showed the prefix cache's lookups only (16% for an aiperf multi-turn run served
    75% from cache); its first query is now the share of prompt tokens served from cache by every reuse path."""
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panel = next(p for p in doc["panels"] if "hit rate" in p["title"].lower())
    first = panel["targets"][0]["expr"]
    assert metric_names(first) == {"kvkeeper:prompt_tokens_cached_total", "kvkeeper:prompt_tokens_total"}, first
    assert any("by (source)" in t["expr"] for t in panel["targets"])
