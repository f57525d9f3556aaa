"""Issue 44 items 5 and 6 against one real server (the embedded SmolLM2-135M, greedy): the reuse counter of
``/metrics`` agrees with the usage's ``cached_tokens`` over every reuse path (prefix cache, session turns,
``previous_response_id`` forks), and what benchmark clients send is accepted: ``min_tokens`` (vLLM's), the
Responses API's ``stream_options`` (``include_usage``, ``include_obfuscation``), vLLM's multi-turn benchmark's
``conversation_id``, ``HEAD /metrics``, an empty ``prediction``'s zero counts."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.utils.serverproc import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
T = 180  # seconds: bounds, not timings (a loaded CI machine)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    with running_server(d / "server.log", "--max-model-len", "1024",
                        "--data-dir", str(d / "data")) as base:  # a disk tier for the restore test
        yield base


def _counters(base: str) -> dict:
    """{(name, source label or None): value} of the reuse counters on /metrics."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=T).text):
        for s in fam.samples:
            if s.name in ("kvkeeper:prompt_tokens_total", "kvkeeper:prompt_tokens_cached_total"):
                out[(s.name, s.labels.get("source"))] = s.value
    return out


def _chat(base: str, messages: list[dict], headers: dict | None = None, **kw) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **kw}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers=headers or {}, timeout=T)
    assert r.status_code == 200, r.text
    return r.json()


def _sources(after: dict, before: dict) -> dict:
    return {src: after.get(("kvkeeper:prompt_tokens_cached_total", src), 0)
            - before.get(("kvkeeper:prompt_tokens_cached_total", src), 0)
            for (_n, src) in after if src is not None}


# ---- item 5: every reuse path is counted, as the usage reports it ------------------------------------------------

def test_the_reuse_counter_agrees_with_the_usage(server):
    """Three chat turns of one X-Session-ID session, a three-response previous_response_id chain and a repeated
    stateless prompt: the counter's increase, summed over sources, equals the sum of the usages' cached_tokens,
    and its prompt-token total the sum of their prompt tokens; the session's later turns count as ``session``, the
    chain's continuations as ``fork``, first turns and the repeat as ``prefix_cache``."""
    before = _counters(server)
    prompt = cached = 0
    msgs = [{"role": "user", "content": "Name a colour of the sky."}]
    per_source = {"session": 0, "fork": 0, "prefix_cache": 0}
    for turn in range(3):
        out = _chat(server, msgs, {"X-Session-ID": "reuse-metrics"})
        u = out["usage"]
        prompt, cached = prompt + u["prompt_tokens"], cached + u["prompt_tokens_details"]["cached_tokens"]
        per_source["session" if turn else "prefix_cache"] += u["prompt_tokens_details"]["cached_tokens"]
        msgs += [out["choices"][0]["message"], {"role": "user", "content": f"And another one ({turn})?"}]
    prev = None
    for q in ("Say a word.", "Say another word.", "And one more."):
        body = {"model": MODEL, "input": q, "max_output_tokens": 8, "temperature": 0,
                **({"previous_response_id": prev} if prev else {})}
        r = httpx.post(server + "/v1/responses", json=body, timeout=T)
        assert r.status_code == 200, r.text
        prev_before, (prev, u) = prev, (r.json()["id"], r.json()["usage"])
        prompt, cached = prompt + u["input_tokens"], cached + u["input_tokens_details"]["cached_tokens"]
        per_source["fork" if prev_before else "prefix_cache"] += u["input_tokens_details"]["cached_tokens"]
    long = [{"role": "user", "content": "Count slowly from one to forty, one number a line. " * 3}]
    for _ in range(2):
        u = _chat(server, long)["usage"]
        prompt, cached = prompt + u["prompt_tokens"], cached + u["prompt_tokens_details"]["cached_tokens"]
        per_source["prefix_cache"] += u["prompt_tokens_details"]["cached_tokens"]
    after = _counters(server)
    got = _sources(after, before)
    assert per_source["session"] > 0 and per_source["fork"] > 0 and per_source["prefix_cache"] > 0, per_source
    assert after[("kvkeeper:prompt_tokens_total", None)] - before.get(("kvkeeper:prompt_tokens_total", None), 0) \
        == prompt
    assert sum(got.values()) == cached, (got, cached)
    assert {k: got[k] for k in per_source} == per_source, got
    assert set(got) == {"prefix_cache", "session", "fork", "host", "disk", "import"}


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_restored_session_turn_counts_as_its_tier(server, tier):
    """A session offloaded between turns (POST /v1/sessions/{id}/offload): the next turn's reuse is counted under
    the tier it came back from, equal to its usage's cached_tokens."""
    sid, msgs = f"restore-{tier}", [{"role": "user", "content": "Name a large animal."}]
    first = _chat(server, msgs, {"X-Session-ID": sid})
    off = httpx.post(server + f"/v1/sessions/{sid}/offload", params={"tier": tier}, timeout=T)
    assert off.status_code == 200 and off.json()["tier"] == tier, off.text
    before = _counters(server)
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "And a small one?"}]
    reused = _chat(server, msgs, {"X-Session-ID": sid})["usage"]["prompt_tokens_details"]["cached_tokens"]
    got = _sources(_counters(server), before)
    assert reused > 0 and got[tier] == reused and sum(got.values()) == reused, (got, reused)


# ---- item 6: what benchmark clients send ------------------------------------------------------------------------

def test_min_tokens_masks_stop_tokens_until_reached(server):
    """vLLM's min_tokens: a stop token id made near certain (logit_bias +100) ends the reply at its first token;
    with min_tokens 5 it cannot be generated before the fifth (chat and completions)."""
    stop = _tok(server, " the")
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]}),
                       ("/v1/completions", {"prompt": "Once upon a time"})):
        body = {"model": MODEL, **base, "max_tokens": 12, "temperature": 0, "logit_bias": {str(stop): 100},
                "stop_token_ids": [stop], "return_token_ids": True}
        plain = httpx.post(server + path, json=body, timeout=T).json()
        assert plain["usage"]["completion_tokens"] == 1, plain
        r = httpx.post(server + path, json={**body, "min_tokens": 5}, timeout=T)
        assert r.status_code == 200, r.text
        got = r.json()
        ids = got["choices"][0]["token_ids"]
        assert len(ids) == 6 and stop not in ids[:5] and ids[5] == stop, ids
        assert got["choices"][0]["finish_reason"] == "stop"
        err = httpx.post(server + path, json={**body, "min_tokens": 13}, timeout=T)
        assert err.status_code == 400 and err.json()["error"]["param"] == "min_tokens", err.text


def _tok(server: str, text: str) -> int:
    r = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}, timeout=T)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_responses_stream_options_are_accepted(server):
    """aiperf's ``{"include_usage": true}``: accepted, the stream ends with the usage in its last event
    (response.completed, or response.incomplete when cut);
    ``include_obfuscation`` true pads each delta event (``obfuscation``, the delta plus padding a multiple of 32
    characters), false or absent does not."""
    body = {"model": MODEL, "input": "Name three fruits.", "max_output_tokens": 8, "temperature": 0, "stream": True,
            "store": False}
    for opts, padded in (({"include_usage": True}, False), ({"include_obfuscation": False}, False),
                         ({"include_usage": True, "include_obfuscation": True}, True)):
        r = httpx.post(server + "/v1/responses", json={**body, "stream_options": opts}, timeout=T)
        assert r.status_code == 200, r.text
        ev = _events(r)
        # the last event holds the usage (response.incomplete when max_output_tokens cut the reply)
        assert ev[-1]["type"] in ("response.completed", "response.incomplete"), ev[-1]["type"]
        assert ev[-1]["response"]["usage"]["output_tokens"] > 0
        deltas = [e for e in ev if e["type"].endswith(".delta")]
        assert deltas and all(("obfuscation" in e) == padded for e in deltas), (opts, deltas[:2])
        if padded:
            assert all(e["obfuscation"] and (len(e["delta"]) + len(e["obfuscation"])) % 32 == 0 for e in deltas)
    r = httpx.post(server + "/v1/responses", json={**body, "stream_options": {"chunk_size": 3}}, timeout=T)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.chunk_size", r.text


def test_conversation_id_is_a_session(server):
    """vLLM's multi-turn benchmark's conversation_id: the turns of one id are a session (the second turn reuses the
    first's KV, counted as ``session``); an id that differs from the session header's is refused by name."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    first = _chat(server, msgs, conversation_id="conv-44")
    before = _counters(server)
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "And of Spain?"}]
    second = _chat(server, msgs, conversation_id="conv-44")
    reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused >= first["usage"]["prompt_tokens"], (first["usage"], second["usage"])
    assert _sources(_counters(server), before)["session"] == reused
    listed = httpx.get(server + "/v1/sessions", timeout=T).json()["data"]
    assert "conv-44" in json.dumps(listed), listed
    r = httpx.post(server + "/v1/chat/completions", headers={"X-Session-ID": "other"}, timeout=T,
                   json={"model": MODEL, "messages": msgs, "max_tokens": 2, "conversation_id": "conv-44"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation_id", r.text


def test_head_metrics_answers_200_without_a_body(server):
    r = httpx.head(server + "/metrics", timeout=T)
    assert r.status_code == 200 and r.content == b"" and r.headers["content-type"].startswith("text/plain")


def test_an_empty_prediction_reports_zero_prediction_tokens(server):
    """OpenAI reports ``accepted_prediction_tokens: 0, rejected_prediction_tokens: 0`` for an empty prediction."""
    out = _chat(server, [{"role": "user", "content": "Say hi."}], prediction={"type": "content", "content": ""})
    assert out["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0,
                                                         "rejected_prediction_tokens": 0}, out["usage"]
