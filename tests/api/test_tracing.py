"""OpenTelemetry request spans: the app in-process on the real engine, spans caught in memory."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")

from fastapi.testclient import TestClient  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from kvkeeper.api.app import create_app  # noqa: E402
from kvkeeper.api.engine_client.async_engine import AsyncEngine  # noqa: E402
from kvkeeper.api.engine_client.tracing import RequestTracer, configure_tracing  # noqa: E402
from tests.utils.sessionutil import sessions_of  # noqa: E402

pytestmark = pytest.mark.slow


def _serve(engine, tracer=None, **kw):
    return TestClient(create_app(AsyncEngine(engine, sessions_of(engine), tracer=tracer, **kw), "m"))


def test_request_spans_follow_genai_conventions(engine):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider.get_tracer("test"), "m")
    with _serve(engine, tracer) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Name two birds."}],
                                                 "max_tokens": 6, "temperature": 0, "n": 2, "seed": 5},
                   headers={"X-Session-ID": "trace-1", "X-Cache-Salt": "tenant-secret"})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        r2 = c.post("/v1/completions", json={"prompt": "One, two, three,", "max_tokens": 3, "temperature": 0})
        assert r2.status_code == 200
        assert c.delete("/v1/sessions/trace-1").status_code == 200  # the shared engine gets its blocks back
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    assert sorted(s.name for s in roots) == ["chat m", "text_completion m"]
    chat = next(s for s in roots if s.name == "chat m")
    a = chat.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
    assert a["gen_ai.response.id"] == r.json()["id"] and a["gen_ai.request.choice.count"] == 2
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.seed"] == 5
    assert list(a["gen_ai.response.finish_reasons"]) == [c["finish_reason"] for c in r.json()["choices"]]
    assert a["kvkeeper.session.id"] == "trace-1" and a["kvkeeper.cache_salt.set"] is True
    assert "tenant-secret" not in repr([dict(s.attributes) for s in spans])  # the salt never leaks into traces
    children = [s for s in spans if s.parent is not None and s.parent.span_id == chat.context.span_id]
    for i in (0, 1):
        phases = {s.name: s for s in children if s.attributes["kvkeeper.choice.index"] == i}
        assert set(phases) == {"queued", "prefill", "decode"}
        q, p, d = phases["queued"], phases["prefill"], phases["decode"]
        assert chat.start_time <= q.start_time <= q.end_time <= p.start_time <= p.end_time <= d.start_time
        assert d.end_time <= chat.end_time
        assert d.attributes["kvkeeper.decode.output_tokens"] >= 1
    assert all(s.context.trace_id == chat.context.trace_id for s in children)
    assert not engine.has_unfinished()


def test_tracing_is_off_by_default_and_exporters_are_checked(engine):
    assert configure_tracing("none") is None
    with pytest.raises(ValueError, match="console"):
        configure_tracing("jaeger")
    with _serve(engine) as c:  # no tracer: requests are served the same
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200


def test_max_new_tokens_caps_generation_after_the_context_check(engine):
    with _serve(engine, max_new_tokens=3) as c:
        r = c.post("/v1/completions", json={"prompt": "Count: 1, 2, 3,", "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"prompt": "Count", "max_tokens": 10**6})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
