"""The breach forecast on a real server (official openai client): conversations that open one after another and
are never closed (a pinned-session leak) fill a small KV pool; before the breaker trips, /metrics'
``kvkeeper:kv_health_breach_eta_seconds`` turns finite and /admin/health holds a ``forecast`` event that carries
the predicted breach and its reason, also logged."""

from __future__ import annotations

import math
import time

import httpx
import pytest

from kvkeeper.api.server import breach_forecaster
from kvkeeper.diagnostics.health import HealthConfig
from kvkeeper.sessions.breaker import BreakerConfig
from kvkeeper.eval.health.scenarios import SAMPLE_FIELDS
from kvkeeper.eval.health.score import read_server_trace, rescore_server_trace
from tests.utils.serverproc import running_server
from tests.utils.tiny_models import tiny_llama_folder

openai = pytest.importorskip("openai")
WORDS = "amber basalt cedar dune ember fjord glacier harbor island juniper kelp lagoon meadow nectar orchid".split()


def _gauge(http: httpx.Client, base: str, name: str) -> float | None:
    for line in http.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_a_leak_is_forecast_before_the_breaker_trips(tmp_path_factory, tmp_path):
    folder = tiny_llama_folder(tmp_path_factory.mktemp("tiny-forecast"))
    log = tmp_path / "server.log"
    trace = tmp_path / "health.jsonl"
    with running_server(log, "--model", str(folder), "--kv-blocks", "96", "--block-size", "16",
                        "--health-interval", "0.25", "--health-warmup", "4", "--breaker-act-ahead", "0",
                        "--health-predictor", "trend", "--health-trace", str(trace), timeout_s=180) as base, \
            httpx.Client(timeout=10) as http:  # one client: httpx.get builds one (about 40 ms of CPU) per call
        assert _gauge(http, base, "kvkeeper:kv_health_breach_eta_seconds") == math.inf  # nothing forecast at rest
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        eta = tier = None
        for i in range(200):  # bounded: the pool holds 96 blocks; each conversation pins about two more
            text = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(12)) + f" number {i}."
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                           max_tokens=2, temperature=0, extra_headers={"X-Session-ID": f"leak-{i}"})
            time.sleep(0.15)
            eta = _gauge(http, base, "kvkeeper:kv_health_breach_eta_seconds")
            tier = _gauge(http, base, "kvkeeper:breaker_tier")
            if math.isfinite(eta) or tier:
                break
        assert eta is not None and math.isfinite(eta) and eta >= 0, (eta, tier)
        assert tier == 0.0  # forecast ahead of the trip
        state = http.get(base + "/admin/health").json()
        ev = [e for e in state["events"] if e["event"] == "forecast"]
        assert ev and ev[0]["breach_eta_s"] is not None and "usage" in ev[0]["breach_reason"]
        assert state["predictor"] == "trend" and "usage" in state["breach_reason"]
        for _ in range(100):  # the log line: polled, never read once
            if "KV cache health forecast: breach in about" in log.read_text():
                break
            time.sleep(0.1)
        assert "KV cache health forecast: breach in about" in log.read_text()
    # the recorded samples carry every field the generated incidents record, and replaying them through the
    # server's own forecaster gives the live forecasts, sample by sample (the rescoring of a soak rests on this)
    records = read_server_trace(trace)
    assert len(records) >= 8
    assert set(SAMPLE_FIELDS) <= set(records[-1]["sample"]), set(SAMPLE_FIELDS) - set(records[-1]["sample"])
    assert all(r["predictor"] == "trend" for r in records)
    replay = rescore_server_trace(records, breach_forecaster(HealthConfig(predictor="trend"), BreakerConfig()))
    assert replay["compared"] == len(records) and replay["agree"] == len(records), replay
    assert replay["warnings"] >= 1
