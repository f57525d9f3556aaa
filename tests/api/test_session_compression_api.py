"""Session compression through the HTTP layer, in process on the real embedded model: a 2-turn session with
``session_compression`` keeps about half its KV, turn 2 takes the history from the compressed KV (cached tokens =
the tokens it covers), ``usage.session_compression`` says what each layer kept; bad values are 400s naming the
field or header, and a policy without a session is refused."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from tests.utils.sessionutil import sessions_of  # noqa: E402

from kvkeeper.api.app import create_app  # noqa: E402
from kvkeeper.api.engine_client.async_engine import AsyncEngine  # noqa: E402


def test_a_compressed_two_turn_session_and_its_errors(engine):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "My cat is called Miso and she is nine years old. Say hello to her."}]
    body = {"messages": msgs, "max_tokens": 12, "temperature": 0}
    layers = engine.model_config.num_layers
    with TestClient(create_app(AsyncEngine(engine, sessions_of(engine)), "m")) as c:
        try:
            r1 = c.post("/v1/chat/completions", json={**body, "session_compression": "knorm",
                                                       "session_compression_ratio": 0.5},
                        headers={"X-Session-ID": "qa-comp"})
            assert r1.status_code == 200, r1.text
            u1 = r1.json()["usage"]
            rep1 = u1["session_compression"]
            T1 = u1["prompt_tokens"] + u1["completion_tokens"] - 1  # the last output token has no KV yet
            assert rep1["policy"] == "knorm" and rep1["applied"] and rep1["tokens"] == T1
            assert rep1["kept_per_layer"] == [int(T1 * 0.5)] * layers
            reply = r1.json()["choices"][0]["message"]["content"]
            msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "How old is she?"}]
            # turn 2 sets nothing: the session keeps its policy; the header form names another ratio for turn 3
            r2 = c.post("/v1/chat/completions", json={**body, "messages": msgs2}, headers={"X-Session-ID": "qa-comp"})
            assert r2.status_code == 200, r2.text
            u2 = r2.json()["usage"]
            assert u2["prompt_tokens_details"]["cached_tokens"] == T1  # the history, from the compressed KV
            assert u2["session_compression"]["tokens"] == u2["prompt_tokens"] + u2["completion_tokens"] - 1
            listed = {s["id"]: s for s in c.get("/v1/sessions").json()["data"]}
            info = listed["qa-comp"]["compression"]
            assert info["policy"] == "knorm" and info["kv_entries"] == u2["session_compression"]["kept"]
            r3 = c.post("/v1/chat/completions", json={**body, "messages": msgs2},
                        headers={"X-Session-ID": "qa-comp", "X-Session-Compression-Ratio": "0.75"})
            assert r3.status_code == 200 and r3.json()["usage"]["session_compression"]["ratio"] == 0.75
            # errors: each names what was wrong
            bad = c.post("/v1/chat/completions", json={**body, "session_compression": "zip"},
                         headers={"X-Session-ID": "qa-comp"})
            assert bad.status_code == 400 and "session_compression" in bad.text
            bad = c.post("/v1/chat/completions", json=body,
                         headers={"X-Session-ID": "qa-comp", "X-Session-Compression-Ratio": "1.5"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Session-Compression-Ratio"
            bad = c.post("/v1/chat/completions", json=body, headers={"X-Session-Compression": "nope"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Session-Compression"
            bad = c.post("/v1/chat/completions", json={**body, "session_compression": "knorm"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_compression"
            # the headers apply to a text completion's session too (never accepted and ignored)
            text = {"prompt": "Once upon a time there was a small village by the sea, and", "max_tokens": 4,
                    "temperature": 0}
            r = c.post("/v1/completions", json=text,
                       headers={"X-Session-ID": "qa-comp-text", "X-Session-Compression": "streaming_llm"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["session_compression"]["policy"] == "streaming_llm"
            bad = c.post("/v1/completions", json=text, headers={"X-Session-Compression": "knorm"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_compression"
        finally:
            c.delete("/v1/sessions/qa-comp")
            c.delete("/v1/sessions/qa-comp-text")
