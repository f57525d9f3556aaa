"""The HTTP layer in process (FastAPI's TestClient, no server process), mostly on a fake engine (no model): what
a request gets when it cannot be served, and that nothing is left behind: 400 naming the field (unknown fields,
wrong JSON types, nulls, bodies that are not JSON objects, context headers where they do not apply), 503 with
Retry-After (full queue, breaker), a generic 500 without a stack trace, a refused first turn leaving no session,
one server per engine; with them the gauges published before an answer and HEAD /health.

The other HTTP files: ``test_request_fields.py`` (every request field applied or refused, on a real server),
``test_openai_client.py`` (the endpoints as the official client uses them), ``test_fuzz.py`` (generated requests).
"""

from __future__ import annotations

import pytest
from tests.utils.engines import make_engine

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvkeeper.api.app import create_app  # noqa: E402
from kvkeeper.api.engine_client.async_engine import AsyncEngine  # noqa: E402
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

    def find(self, tenant, sid):  # a server without keys: one tenant, None
        return self.sessions.get(sid)

    def of_tenant(self, tenant):
        return list(self.sessions.values())

    def check_quota(self, tenant, quota, opening):
        pass

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


# ---- gauges are published before a response leaves the engine thread ---------------------------


def test_gauges_are_published_before_outputs_and_answers(tmp_path, monkeypatch):
    """Driven by hand on the test's thread: when an output or an answer is handed to the event loop, the
    metrics snapshot already shows its effect (a session opened, KV freed at the end, a session closed)."""
    import asyncio

    from tests.utils.tiny_models import tiny_llama_folder

    from kvkeeper import SamplingParams
    from kvkeeper.api.engine_client import async_engine as ae
    from kvkeeper.api.engine_client import tracker as tr
    from kvkeeper.api.common.streams import GenerationRequest
    from kvkeeper.sessions.manager import SessionManager

    eng = make_engine(str(tiny_llama_folder(tmp_path / "tiny")), num_kv_blocks=64, block_size=4)
    aeng = AsyncEngine(eng, SessionManager(eng))
    seen = []  # the snapshot at each hand-over
    real_put, real_resolve = tr.put, ae._resolve
    monkeypatch.setattr(tr, "put", lambda loop, q, item: (seen.append(("out", dict(aeng.metrics.snapshot), item)),
                                                          real_put(loop, q, item)))

    def handle(kind, *args):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        snap = {}
        monkeypatch.setattr(ae, "_resolve", lambda f, r=None, e=None: (snap.update(aeng.metrics.snapshot),
                                                                       real_resolve(f, r, e)))
        aeng._handle(ae.Call(args[0], loop, fut) if kind == "call" else ae.Add(args[0], loop, fut, args[1]))
        return fut, snap

    async def run():
        q: asyncio.Queue = asyncio.Queue()
        req = GenerationRequest("r1", [SamplingParams(max_tokens=3, ignore_eos=True)], prompt="hello there",
                                session_id="s1")
        fut, snap = handle("add", req, q)
        await fut
        assert snap["sessions"] == 1  # the request opened its session: published before the answer
        while eng.has_unfinished():
            aeng._iterate()
        last = [s for kind, s, item in seen if kind == "out" and item.finished][0]
        assert last["sessions"] == 1 and last["num_running"] == 0  # finished, as the final output says
        fut, snap = handle("call", lambda e: aeng.sessions.close("s1"))
        await fut
        assert snap["sessions"] == 0 and snap["kv_usage"] == 0  # closed and freed before the answer

    asyncio.run(run())


def test_unknown_fields_refused_or_ignored_and_the_access_log(caplog):
    """Unknown fields: 400 naming them, or ignored with refuse_unknown_fields=False (``--ignore-unknown-fields``);
    one access-log line per request while the access logger is on (``--no-access-log`` turns it off)."""
    import logging

    from kvkeeper.api.common.access_log import ACCESS_LOGGER, configure_access_log

    body = {**BODY, "frobnicate": True, "messages": [{"role": "user", "content": "hi", "colour": "red"}]}
    eng = ContextFullEngine()
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    for refuse in (True, False):
        log = configure_access_log(True)
        log.addHandler(Keep())
        with TestClient(create_app(AsyncEngine(eng, FakeSessions(eng)), refuse_unknown_fields=refuse)) as c:
            r = c.post("/v1/chat/completions", json=body)
        if refuse:
            assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        else:  # the fields were ignored: the request reached the engine (whose prompts are all too long)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert len(lines) == 2 and all('"POST /v1/chat/completions" 400 prompt_tokens=- ' in ln for ln in lines)
    configure_access_log(False)
    logging.getLogger(ACCESS_LOGGER).addHandler(Keep())
    with TestClient(create_app(AsyncEngine(eng, FakeSessions(eng)))) as c:
        c.post("/v1/chat/completions", json=BODY)
    assert len(lines) == 2  # off: no line
    configure_access_log(False)


@pytest.mark.parametrize("header,value", [("X-Context-Policy", "last"), ("X-Context-Budget", "300")])
def test_context_headers_on_text_completions_are_refused(header, value):
    # they were accepted and ignored: a text completion has no messages for a policy to keep or drop
    app = _app(FakeEngine())
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"X-Session-ID": "s", header: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == header, r.text
        assert "/v1/chat/completions" in r.json()["error"]["message"]



def test_context_length_error_names_the_prompt_on_text_completions():
    # it named `messages`, a field /v1/completions does not have
    from fastapi import FastAPI

    from kvkeeper.api.common.errors import install_error_handlers
    from kvkeeper.errors import ContextLengthError

    app = FastAPI()
    install_error_handlers(app, RuntimeError)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def over():
        raise ContextLengthError(100, 64, 8)

    with TestClient(app) as c:
        for path, param in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
            err = c.post(path).json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == param, (path, err)


def test_null_in_openai_nullable_fields_means_the_default():
    # "n": null, "stream": null, "logprobs": null (chat) and "echo": null were 400s; OpenAI's schemas allow null
    from kvkeeper.api.chat.protocol import ChatCompletionRequest
    from kvkeeper.api.completions.protocol import CompletionRequest

    chat = ChatCompletionRequest.model_validate({**BODY, "n": None, "stream": None, "logprobs": None})
    assert (chat.n, chat.stream, chat.logprobs) == (1, False, False)
    comp = CompletionRequest.model_validate({"prompt": "x", "n": None, "stream": None, "echo": None, "logprobs": None})
    assert (comp.n, comp.stream, comp.echo, comp.logprobs) == (1, False, False, None)
    assert "n" not in chat.model_fields_set and not chat.model_extra


@pytest.mark.parametrize("content_type,body", [
    ("text/plain", b'{"prompt": "x"}'), (None, b'{"prompt": "x"}'), ("application/json", b""),
    ("application/json", b"[1]"), ("application/x-www-form-urlencoded", b"prompt=x")])
def test_a_body_that_is_not_a_json_object_says_how_to_send_one(content_type, body):
    # the message was pydantic's "Input should be a valid dictionary or object to extract fields from" / "Field required"
    with TestClient(_app(FakeEngine())) as c:
        r = c.post("/v1/completions", content=body, headers={"Content-Type": content_type} if content_type else {})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "JSON object" in msg and "Content-Type: application/json" in msg, msg


def test_health_answers_head_probes():
    # HEAD /health was 405: some load balancers probe with HEAD
    with TestClient(_app(FakeEngine())) as c:
        assert c.head("/health").status_code == 200 and c.get("/health").json() == {"status": "ok"}


def test_offload_tier_and_dump_range_errors_name_their_parameter():
    # they had param null
    from types import SimpleNamespace

    from kvkeeper.diagnostics.kvdump import parse_layers
    from kvkeeper.errors import InvalidRequestError
    from kvkeeper.sessions.offload import SessionStore

    for tier in ("moon", "disk"):
        with pytest.raises(InvalidRequestError) as e:
            SessionStore.check_tier(SimpleNamespace(disk=None), tier)
        assert e.value.param == "tier"
    for spec in ("a-b", "99"):
        with pytest.raises(InvalidRequestError) as e:
            parse_layers(spec, 30)
        assert e.value.param == "layers"


@pytest.mark.parametrize("field,value", [("add_generation_prompt", False), ("tools", []),
                                         ("continue_final_message", True)])
def test_tokenize_refuses_chat_fields_with_a_text_prompt(field, value):
    # they were accepted and ignored: a text prompt is not rendered by the chat template
    with TestClient(_app(FakeEngine())) as c:
        r = c.post("/tokenize", json={"prompt": "x", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("field,value", [("max_tokens", True), ("max_tokens", "5"), ("max_tokens", 2.0), ("n", "2"),
                                         ("stream", "yes"), ("stream", 1), ("prompt_logprobs", False),
                                         ("temperature", "0.5"), ("seed", "7")])
def test_values_of_the_wrong_json_type_are_refused(field, value):
    # they were coerced: "max_tokens": true ran with 1 token, "prompt_logprobs": false returned prompt logprobs
    with TestClient(_app(FakeEngine())) as c:
        r = c.post("/v1/chat/completions", json={**BODY, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert c.post("/detokenize", json={"tokens": [True]}).json()["error"]["param"] == "tokens.0"


# ---- handlers read the engine thread's snapshot, never the engine --------------------------------


class WatchedEngine(FakeEngine):
    """Records the thread of every read of the adapters once ``watching`` is set."""

    watching = False

    def __init__(self):
        super().__init__()
        self.readers: list[str] = []

    @property
    def loras(self) -> dict:
        import threading

        if self.watching:
            self.readers.append(threading.current_thread().name)
        return {}


def test_handlers_read_the_published_snapshot_not_the_engine():
    # /v1/models and every request's model check read LLMEngine.loras from the event loop
    eng = WatchedEngine()
    with TestClient(_app(eng), raise_server_exceptions=False) as c:
        eng.watching = True
        assert c.get("/v1/models").json()["data"][0]["id"] == "fake"
        assert c.get("/v1/models/lora-x").status_code == 404
        c.post("/v1/chat/completions", json=BODY)
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        c.post("/tokenize", json={"prompt": "x"})
    assert eng.readers and set(eng.readers) == {"kvkeeper-engine"}, eng.readers  # republished after each call


def test_the_snapshot_follows_an_adapter_loaded_on_the_engine_thread():
    import asyncio
    from pathlib import Path
    from types import SimpleNamespace

    eng = FakeEngine()
    eng.loras = {}
    aeng = AsyncEngine(eng, FakeSessions(eng))
    aeng.serve_as("served")
    assert aeng.served.name == "served" and aeng.served.adapters == ()
    aeng.start()
    try:
        asyncio.run(aeng.call(lambda e: e.loras.update(a=SimpleNamespace(path=Path("/x"), id="a-123"))))
        assert [(a.name, a.path, a.id) for a in aeng.served.adapters] == [("a", "/x", "a-123")]
        assert aeng.served.adapter("a").id == "a-123" and aeng.served.adapter("served") is None
    finally:
        aeng.stop()


def test_context_policies_are_the_sessions_own():
    from typing import get_args

    from kvkeeper.api.chat.protocol import ChatCompletionRequest
    from kvkeeper.sessions.context import CONTEXT_POLICIES

    assert set(get_args(get_args(ChatCompletionRequest.model_fields["context_policy"].annotation)[0])) == set(CONTEXT_POLICIES)


@pytest.mark.parametrize("headers", [{}, {"X-Session-ID": "s1"}])
def test_rules_the_engine_checks_still_name_their_field(tmp_path, headers):
    # the API's own copies of these checks were removed: the engine's InvalidRequestError names the field
    from tests.utils.tiny_models import tiny_llama_folder

    from kvkeeper.sessions.manager import SessionManager

    eng = make_engine(str(tiny_llama_folder(tmp_path / "tiny")), num_kv_blocks=64, block_size=4)
    vocab = eng.model_config.vocab_size
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    with TestClient(create_app(AsyncEngine(eng, SessionManager(eng)), "m")) as c:
        for path, body, param in (("/v1/chat/completions", {"messages": msgs, "continue_final_message": True},
                                   "continue_final_message"),
                                  ("/v1/completions", {"prompt": [1, vocab], "max_tokens": 2}, "prompt"),
                                  ("/v1/completions", {"prompt": "x", "logit_bias": {str(vocab): 1}}, "logit_bias")):
            r = c.post(path, json=body, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.utils.tiny_models import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-http"))


def test_a_server_first_turn_that_fails_leaves_no_empty_session(folder):
    from fastapi.testclient import TestClient

    from kvkeeper.api.server import build_server

    eng = make_engine(str(folder), num_kv_blocks=16, block_size=4)
    with TestClient(build_server(eng)) as c:
        for i in range(3):
            r = c.post("/v1/completions", json={"prompt": list(range(100, 180)), "max_tokens": 2},
                       headers={"X-Session-ID": f"doomed-{i}"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "request_failed", r.text
        ok = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, headers={"X-Session-ID": "kept"})
        assert ok.status_code == 200
        assert [x["id"] for x in c.get("/v1/sessions").json()["data"]] == ["kept"]
        assert "kvkeeper:sessions_open 1.0" in c.get("/metrics").text


def test_one_server_per_engine(folder):
    from kvkeeper.api.server import build_server

    eng = make_engine(str(folder), num_kv_blocks=16, block_size=4)
    build_server(eng)
    hooks = (len(eng.kv.holders), len(eng.step_hooks), len(eng.first_token_hooks))
    with pytest.raises(ValueError, match="one server per engine"):
        build_server(eng)
    assert (len(eng.kv.holders), len(eng.step_hooks), len(eng.first_token_hooks)) == hooks  # nothing stacked
