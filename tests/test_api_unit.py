"""Fast checks of the HTTP layer on a fake engine (no model): 503 on a full queue, no stack traces on 500."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvkeeper.api.app import create_app  # noqa: E402
from kvkeeper.api.async_engine import AsyncEngine  # noqa: E402
from kvkeeper.kvcache.namespace import Namespace  # noqa: E402


class FakeEngine:
    """Just enough of LLMEngine for the server to start; every chat prompt fails with a bug."""

    model_name = "fake"
    context_length = 64
    namespace = Namespace("rev0")
    tokenizer = None

    def __init__(self, waiting: int = 0):
        self.waiting = waiting

    def stats(self) -> dict:
        return {"kv_usage": 0.0, "prefix_query_tokens": 0, "prefix_hit_tokens": 0, "num_preemptions": 0,
                "num_running": 0, "num_waiting": self.waiting}

    def has_unfinished(self) -> bool:
        return False

    def encode_chat(self, messages, **chat):
        raise RuntimeError("secret internal detail")


class FakeSessions:
    """Just enough of SessionManager: sessions open on request, each turn fails like the engine's prompts."""

    def __init__(self, engine):
        self.engine = engine
        self.sessions = {}

    def __contains__(self, sid):
        return sid in self.sessions

    def __iter__(self):
        return iter(list(self.sessions.values()))

    def open(self, session_id=None, **kw):
        mgr = self

        class S:
            id, priority, trim_budget, trimmed_turns = session_id, 0, None, 0

            def begin_turn(self, messages=None, **kw):
                mgr.engine.encode_chat(messages)

        self.sessions[session_id] = S()
        return self.sessions[session_id]

    def close(self, sid):
        from kvkeeper.errors import SessionNotFoundError

        if self.sessions.pop(sid, None) is None:
            raise SessionNotFoundError(f"no open session {sid!r}")
        return 0

    def stats(self) -> dict:
        return {"sessions": len(self.sessions), "pinned_blocks": 0, "offload": {}}

    def save_all(self) -> int:
        return 0


def _app(engine, sessions=None, max_queue=2):
    return create_app(AsyncEngine(engine, sessions or FakeSessions(engine), max_queue=max_queue))


BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def test_queue_full_is_503_with_retry_after():
    app = _app(FakeEngine(waiting=3))
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        assert c.get("/metrics").text.count("kvkeeper:num_requests_waiting 3.0") == 1


def test_internal_error_is_generic_500():
    app = _app(FakeEngine())
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 500
        assert "secret" not in r.text and "Traceback" not in r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert c.get("/health").status_code == 200  # the engine thread survived


def test_validation_and_model_errors():
    app = _app(FakeEngine())
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={**BODY, "top_p": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        assert c.post("/v1/chat/completions", json={**BODY, "model": "other"}).status_code == 404
        assert c.post("/v1/completions", json={"prompt": "x"}, headers={"content-length": "99999999"}).status_code == 413
        assert c.delete("/v1/sessions/nope").status_code == 404


class DegradedSessions(FakeSessions):
    """A circuit breaker in its degrade tier: new sessions are refused."""

    def open(self, session_id=None, **kw):
        from kvkeeper.sessions.breaker import OverloadedError

        raise OverloadedError("KV memory is short: new sessions are refused for now", 3)


def test_breaker_refusal_is_503_with_retry_after_and_priority_is_validated():
    app = _app(FakeEngine(), DegradedSessions(FakeEngine()))
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=BODY, headers={"X-Session-ID": "new-one"})
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "kv_memory_short" and "session" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json=BODY, headers={"X-Session-ID": "s", "X-Session-Priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Priority"
        assert c.get("/admin/breaker").json() == {"tier": 0, "enabled": False}


class ContextFullEngine(FakeEngine):
    """Every prompt is over the context window."""

    def encode_chat(self, messages, **chat):
        from kvkeeper.errors import ContextLengthError

        raise ContextLengthError(100, self.context_length)


def test_a_refused_first_request_leaves_no_empty_session_open():
    eng = ContextFullEngine()
    sessions = FakeSessions(eng)
    app = _app(eng, sessions)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=BODY, headers={"X-Session-ID": "first"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "first" not in sessions
        old = sessions.open("old")  # an open conversation keeps its session after a refused turn
        assert c.post("/v1/chat/completions", json=BODY, headers={"X-Session-ID": "old"}).status_code == 400
        assert sessions.sessions.get("old") is old


@pytest.mark.parametrize("junk", ["1_0", "0x10", "1e2", "", "5 5"])
def test_session_priority_junk_is_400(junk):
    # int() took "1_0" as 10
    app = _app(FakeEngine(), DegradedSessions(FakeEngine()))
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=BODY, headers={"X-Session-ID": "s", "X-Session-Priority": junk})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Priority", r.text
