"""Admission on a small pool with forked sessions and stored responses (issue 44 item 1), against a real server.

One server (the embedded SmolLM2-135M, ``--kv-blocks 48 --max-model-len 1024``: 768 tokens of KV) is shared by
the module.  Stored responses continuing one another and sessions forked through the API share their prefix
blocks; a request that fits the pool once the idle sessions are offloaded is never refused, and 50 busy sessions
next to 25 idle ones never wedge the server: every request finishes or is told to retry (429 / 503 with
``Retry-After``), none gets a 400.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import uuid

import httpx
import pytest

from tests.utils.serverproc import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WORDS = ("river stone maple copper lantern orchard harbour violet meadow falcon quartz saffron ember tundra "
         "willow cobalt glacier thistle juniper marble canyon").split()


# One client for the module's requests (thread-safe; the hot sessions share its pool): httpx.post builds a client,
# and with it an SSL context that loads the CA bundle (about 50 ms of CPU), on every call.
HTTP = httpx.Client()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("reclaim")
    with running_server(d / "server.log", "--kv-blocks", "48", "--max-model-len", "1024") as base:
        yield base
    HTTP.close()


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _tokens(server, text: str) -> int:
    r = HTTP.post(server + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    r.raise_for_status()
    return r.json()["count"]


def _prompt_of(server, n_tokens: int, seed: int) -> str:
    """The longest text of ``_text(words, seed)`` (words <= n_tokens) of at most ``n_tokens`` tokens.  A shorter
    text is a prefix of a longer one (the same seed draws the same words) and the tokenizer splits at the spaces,
    so its token count grows with ``words``: a bisection finds the text a count-down would (about 9 calls to
    /tokenize instead of one per word dropped, 200 for a 370-token prompt)."""
    lo, hi = 0, n_tokens  # the answer lies in [lo, hi]; _text(0, seed) is the empty prompt
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _tokens(server, _text(mid, seed)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return _text(lo, seed)


def _completion(server, prompt: str) -> httpx.Response:
    return HTTP.post(server + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})


def _cleanup(server):
    for s in HTTP.get(server + "/v1/sessions", timeout=30).json()["data"]:
        HTTP.delete(f"{server}/v1/sessions/{s['id']}", timeout=30)


def test_stored_responses_continuing_one_never_refuse_a_completion_that_fits(server):
    try:
        first = HTTP.post(server + "/v1/responses", timeout=300, json={
            "model": MODEL, "input": _prompt_of(server, 370, 1), "max_output_tokens": 4, "temperature": 0})
        assert first.status_code == 200, first.text
        for k in range(4):
            r = HTTP.post(server + "/v1/responses", timeout=300, json={
                "model": MODEL, "input": f"Say {WORDS[k]}.", "previous_response_id": first.json()["id"],
                "max_output_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        r = _completion(server, _prompt_of(server, 300, 2))
        assert r.status_code == 200, r.text
    finally:
        _cleanup(server)


def test_forks_through_the_api_never_refuse_a_completion_that_fits(server):
    sid = f"probe-{uuid.uuid4().hex[:6]}"
    try:
        r = HTTP.post(server + "/v1/chat/completions", headers={"X-Session-ID": sid}, timeout=300, json={
            "model": MODEL, "messages": [{"role": "user", "content": _prompt_of(server, 540, 3)}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        for k in range(5):
            f = HTTP.post(f"{server}/v1/sessions/{sid}/fork", params={"id": f"{sid}-f{k}"}, timeout=60)
            assert f.status_code == 200, f.text
        for seed in (4, 5, 6):  # the probe was refused three times in a row, one more fork offloaded each time
            r = _completion(server, _prompt_of(server, 300, seed))
            assert r.status_code == 200, r.text
    finally:
        _cleanup(server)


def _turn(server, sid: str, content: str) -> httpx.Response:
    return HTTP.post(server + "/v1/chat/completions", headers={"X-Session-ID": sid}, timeout=600, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0})


def test_fifty_hot_and_twenty_five_cold_sessions_never_wedge_the_server(server):
    try:
        answers = []
        for k in range(25):  # cold: one turn each, then idle
            answers.append(_turn(server, f"cold-{k}", _text(30 + k, 100 + k)))
            if k % 5 == 0 and answers[-1].status_code == 200:  # some have forks sharing their blocks
                f = HTTP.post(f"{server}/v1/sessions/cold-{k}/fork", timeout=60)
                # a fork opens a session: while the circuit breaker degrades (its tiers follow the pool's usage
                # over time, so whether it does at this moment depends on timing) it refuses with a 503 to retry
                assert f.status_code == 200 or (f.status_code == 503 and "retry-after" in f.headers
                                                and f.json()["error"]["code"] == "kv_memory_short"), f.text
        with cf.ThreadPoolExecutor(max_workers=50) as pool:  # hot: 50 sessions' turns at once
            answers += pool.map(lambda k: _turn(server, f"hot-{k}", _text(20 + k, 200 + k)), range(50))
        codes = sorted(r.status_code for r in answers)
        bad = [r.text for r in answers if r.status_code not in (200, 429, 503)]
        assert not bad, (codes, bad[:3])
        assert all("retry-after" in r.headers for r in answers if r.status_code in (429, 503))
        assert codes.count(200) >= 1
        health = HTTP.get(server + "/health", timeout=30)
        assert health.status_code == 200
        r = _completion(server, _prompt_of(server, 300, 7))  # not wedged: a request that fits still runs
        assert r.status_code == 200, r.text
    finally:
        _cleanup(server)
