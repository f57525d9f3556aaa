"""The OpenAI-compatible server, run as a subprocess and driven by the official ``openai`` client.

One server (the embedded SmolLM2-135M) is shared by the module; every test keeps
its generations short.  Teardown always terminates the server.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LONG_PROMPT = ("Here is a long note about the history of cartography, maps, globes and the people who drew them. " * 8
               + "Summarise it in one sentence.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log_file = open(log_path, "w")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--threads", "2"], stdout=log_file, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()
        out = log_path.read_text()
        assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(kvkeeper:[a-z0-9_:]+)(\{[^}]*\})? ([-+0-9.eE]+)$", line)
        if m and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def _chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# ---- basics ---------------------------------------------------------------------------


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["context_length"] == 8192
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_chat_stream_equals_non_stream(client):
    full = _chat(client, "Name three colours.", seed=7)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    u = full.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(_chat(client, "Name three colours.", seed=7, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert chunks[-1].usage.prompt_tokens == u.prompt_tokens


def test_content_parts_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, max_completion_tokens=3, temperature=0, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    assert r.usage.completion_tokens <= 3


def test_n2_seeded(client):
    r = _chat(client, "Write a word.", n=2, temperature=1.0, seed=3, max_tokens=8)
    assert len(r.choices) == 2 and [c.index for c in r.choices] == [0, 1]
    r2 = _chat(client, "Write a word.", n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [c.message.content for c in r.choices] == [c.message.content for c in r2.choices]
    single = _chat(client, "Write a word.", n=1, temperature=1.0, seed=3, max_tokens=8)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once


def test_stop(client):
    full = _chat(client, "Count from 1 to 10, separated by commas.", max_tokens=24)
    text = full.choices[0].message.content
    assert "," in text, text
    cut = _chat(client, "Count from 1 to 10, separated by commas.", max_tokens=24, stop=[","])
    assert cut.choices[0].message.content == text.split(",")[0]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = _chat(client, "Name a fruit.", logprobs=True, top_logprobs=3, max_tokens=6)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and isinstance(e.bytes, list) and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.token == e.top_logprobs[0].token  # greedy picks the most likely token
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2)
    assert r.choices[0].text.strip() and r.usage.completion_tokens == 6
    assert len(r.choices[0].logprobs.tokens) == 6
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 5
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


# ---- KV reuse -------------------------------------------------------------------------


def test_two_turn_session_reports_cached_tokens(server, client):
    sid = f"conv-{uuid.uuid4().hex[:8]}"
    h = {"X-Session-ID": sid}
    msgs = [{"role": "user", "content": "Tell me about the moon in two sentences."}]
    r1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, extra_headers=h)
    listed = {s["id"]: s for s in httpx.get(server + "/v1/sessions").json()["data"]}
    assert listed[sid]["tokens"] == r1.usage.total_tokens and listed[sid]["blocks"] > 0
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And about the sun?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, extra_headers=h)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 16
    assert httpx.delete(f"{server}/v1/sessions/{sid}").status_code == 200
    r = httpx.delete(f"{server}/v1/sessions/{sid}")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert _metrics(server)["kvkeeper:pinned_blocks"] == 0


def test_cache_salt_isolation(client):
    a, b = f"tenant-a-{uuid.uuid4().hex}", f"tenant-b-{uuid.uuid4().hex}"
    first = _chat(client, LONG_PROMPT, max_tokens=2, extra_body={"cache_salt": a})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = _chat(client, LONG_PROMPT, max_tokens=2, extra_body={"cache_salt": a})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    other = _chat(client, LONG_PROMPT, max_tokens=2, extra_body={"cache_salt": b})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    via_header = _chat(client, LONG_PROMPT, max_tokens=2, extra_headers={"X-Cache-Salt": b})
    assert via_header.usage.prompt_tokens_details.cached_tokens > 0  # same tenant b: its own prefix


# ---- errors ---------------------------------------------------------------------------


def test_context_overflow_is_400_with_numbers(client):
    with pytest.raises(openai.BadRequestError) as ei:
        _chat(client, "Hello", max_tokens=100_000)
    err = ei.value.body
    msg = err["message"] if "message" in err else err["error"]["message"]
    assert "100000" in msg and "8192" in msg
    assert _chat(client, "Hello", max_tokens=2).usage.completion_tokens >= 1  # still serving


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_invalid_params_400(server, client):
    with pytest.raises(openai.BadRequestError) as ei:
        _chat(client, "x", temperature=5)
    assert "temperature" in str(ei.value)
    r = httpx.post(server + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(server + "/v1/completions", content=b"x" * (5 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_disconnect_mid_stream_frees_blocks(server):
    base = _metrics(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    got += 1
                if got >= 4:
                    break
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(server)
        if m["kvkeeper:num_requests_running"] == 0 and m["kvkeeper:kv_cache_usage_perc"] == base[
                "kvkeeper:kv_cache_usage_perc"]:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    # e2e histogram saw the aborted request finish well before its 400 tokens
    assert m["kvkeeper:e2e_request_latency_seconds_count"] > base["kvkeeper:e2e_request_latency_seconds_count"]
    assert m["kvkeeper:num_requests_waiting"] == 0
