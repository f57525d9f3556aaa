"""The OpenAI-compatible endpoints, run as a subprocess and driven by the official ``openai`` client: models and
health, chat streamed and not, completions, n, stop strings, logprobs, sessions and their cached tokens, cache
salts, context overflow, unknown models, disconnects mid-stream, the chat template's tokens, whole characters in
stream deltas, bounded load with hang-ups, the KV compression extension.

One server (the embedded SmolLM2-135M) is shared by the module; every test keeps
its generations short.  Teardown always terminates the server.  Each request field, applied or refused:
``test_request_fields.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from tests.utils.serverproc import running_server
from tests.utils.paths import ROOT

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CTX = 1024  # the server runs with --max-model-len 1024 so that a full-context prompt stays cheap
LONG_PROMPT = ("Here is a long note about the history of cartography, maps, globes and the people who drew them. " * 8
               + "Summarise it in one sentence.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(log_path, "--max-model-len", str(CTX)) as base:
        yield base


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
    assert models[0].model_extra["context_length"] == CTX
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


def test_cache_write_tokens_are_the_prompt_kv_the_request_stored(server, client):
    """``cache_write_tokens`` beside ``cached_tokens`` (chat and completions' ``prompt_tokens_details``, the Responses
    API's ``input_tokens_details``, as the ``openai`` types have it): the prompt tokens the request computed and left
    in the cache.  Without a session: its full prompt blocks newly stored in the prefix cache (none when they were
    already there); in a session: every prompt token it computed (the session keeps its KV, last block included)."""
    bs = 16  # the server's block size
    system = {"role": "system", "content": f"{uuid.uuid4()} You answer in one word."}  # a fresh first block
    msgs = [system, {"role": "user", "content": LONG_PROMPT}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    p, d = first.usage.prompt_tokens, first.usage.prompt_tokens_details
    assert d.cached_tokens == 0 and d.cache_write_tokens == p // bs * bs, first.usage
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    d = again.usage.prompt_tokens_details
    assert d.cached_tokens == (p - 1) // bs * bs and d.cache_write_tokens == 0, again.usage  # all there already

    h = {"X-Session-ID": f"write-{uuid.uuid4().hex[:8]}"}
    t1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, extra_headers=h)
    d = t1.usage.prompt_tokens_details
    assert d.cache_write_tokens == t1.usage.prompt_tokens - d.cached_tokens and d.cached_tokens > 0, t1.usage
    msgs += [{"role": "assistant", "content": t1.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    t2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0, extra_headers=h)
    d = t2.usage.prompt_tokens_details
    assert d.cached_tokens >= t1.usage.prompt_tokens - bs, t2.usage  # the session's KV: turn 1's prompt and reply
    assert d.cache_write_tokens == t2.usage.prompt_tokens - d.cached_tokens > 0, t2.usage
    httpx.delete(f"{server}/v1/sessions/{h['X-Session-ID']}")

    text = client.completions.create(model=MODEL, prompt=f"{uuid.uuid4()} {LONG_PROMPT}", max_tokens=1)
    d = text.usage.prompt_tokens_details
    assert d.cached_tokens == 0 and d.cache_write_tokens == text.usage.prompt_tokens // bs * bs, text.usage
    r = client.responses.create(model=MODEL, instructions=f"{uuid.uuid4()} Be brief.", input=LONG_PROMPT,
                                max_output_tokens=1, temperature=0, store=False)
    d = r.usage.input_tokens_details
    assert d.cached_tokens == 0 and d.cache_write_tokens == r.usage.input_tokens // bs * bs, r.usage


# ---- errors ---------------------------------------------------------------------------


def test_context_overflow_is_400_with_numbers(client):
    with pytest.raises(openai.BadRequestError) as ei:
        _chat(client, "Hello", max_tokens=100_000)
    err = ei.value.body
    msg = err["message"] if "message" in err else err["error"]["message"]
    assert "100000" in msg and str(CTX) in msg
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


# ---- prompts: exactly the chat template's tokens ---------------------------------------

EDGE_CONVERSATIONS = {
    "no system": [{"role": "user", "content": "Hi there"}],
    "empty system": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi there"}],
    "two users in a row": [{"role": "user", "content": "First question."}, {"role": "user", "content": "Second one."}],
    "full turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
}


@pytest.fixture(scope="module")
def ref_tokenizer():
    """transformers' tokenizer read straight from the embedded GGUF file: the reference chat template."""
    from transformers import AutoTokenizer

    from kvkeeper.weights.sources import resolve_model_path

    p = resolve_model_path(MODEL)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


@pytest.mark.parametrize("case", sorted(EDGE_CONVERSATIONS))
def test_prompt_tokens_equal_reference_chat_template(server, client, ref_tokenizer, case):
    msgs = EDGE_CONVERSATIONS[case]
    ref = ref_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = list(ref["input_ids"] if isinstance(ref, dict) else ref)
    got = httpx.post(server + "/tokenize", json={"messages": msgs}).json()
    assert got["tokens"] == ref
    assert got["count"] == len(ref) and got["max_model_len"] == CTX
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(ref)


def test_prompt_of_exactly_the_context_length(server, client):
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 120
    ids = httpx.post(server + "/tokenize", json={"prompt": text}).json()["tokens"][:CTX]
    assert len(ids) == CTX
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert f"{CTX} tokens" in str(ei.value) or str(CTX) in str(ei.value)
    with pytest.raises(openai.BadRequestError):  # omitted max_tokens: no room left either
        client.completions.create(model=MODEL, prompt=ids, temperature=0)
    # one token short of the window: max_tokens omitted means "the rest", which is exactly one token
    r = client.completions.create(model=MODEL, prompt=ids[:-1], temperature=0)
    assert r.usage.prompt_tokens == CTX - 1 and r.usage.completion_tokens == 1
    assert r.choices[0].finish_reason == "length"
    assert _chat(client, "Hello", max_tokens=2).usage.completion_tokens >= 1  # still serving


def test_max_tokens_over_the_room_left_is_clamped_and_said(server, client):
    """A ``max_tokens`` that fits the context window but not the room the prompt leaves (Qwen Code sends 32000 for a
    model it does not know, whatever its prompt) is cut to that room, as llama.cpp's server does and ``/v1/messages``
    does, and ``X-KVKeeper-Max-Tokens-Clamped`` says so; one of the whole window or more is still a 400
    (``test_context_overflow_is_400_with_numbers``)."""
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 120
    ids = httpx.post(server + "/tokenize", json={"prompt": text}).json()["tokens"][: CTX - 6]  # room for 6 tokens
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=ids, max_tokens=CTX - 1, temperature=0,
                                                      extra_body={"ignore_eos": True})
    r = raw.parse()
    assert raw.headers["x-kvkeeper-max-tokens-clamped"] == f"{CTX - 1} -> 6", raw.headers
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length", r.usage
    msgs = [{"role": "user", "content": "Hello."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert "x-kvkeeper-max-tokens-clamped" not in raw.headers  # within the room: as asked


# ---- n > 1: one shared prompt prefix ------------------------------------------------------


def test_n2_is_served_from_one_shared_prefix(server, client):
    salt = f"n2-{uuid.uuid4().hex}"
    before = _metrics(server)
    r = _chat(client, LONG_PROMPT, n=2, max_tokens=4, extra_body={"cache_salt": salt})
    after = _metrics(server)
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy, same prompt KV
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # nothing was cached before this request
    hits = after["kvkeeper:prefix_cache_hits_total"] - before["kvkeeper:prefix_cache_hits_total"]
    assert hits == (r.usage.prompt_tokens - 1) // 16 * 16  # the second choice reused every full prompt block


# ---- streaming text: UTF-8 and stop strings ----------------------------------------------


def _stream_text(client, messages, **kw) -> list[str]:
    chunks = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw)
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def test_stream_deltas_are_whole_characters_for_emoji_and_cjk(client):
    msgs = [{"role": "user", "content": "Translate to Chinese and add emoji: I love 🍎 apples and 🐱 cats. 我爱苹果和猫。"}]
    kw = dict(max_tokens=48, temperature=0)
    full = client.chat.completions.create(model=MODEL, messages=msgs, **kw).choices[0].message.content
    deltas = _stream_text(client, msgs, **kw)
    assert "".join(deltas) == full
    assert any(ord(ch) > 0xFFFF for ch in full) and any("\u4e00" <= ch <= "\u9fff" for ch in full), full
    for d in deltas:
        assert "\ufffd" not in d
        d.encode("utf-8")  # no lone surrogates
    lp = client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, **kw).choices[0].logprobs.content
    # the tokenizer really splits some character across tokens (a token that is not valid UTF-8 alone)
    assert any(_invalid_utf8(bytes(e.bytes)) for e in lp)


def _invalid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_stop_strings_inside_and_across_tokens_are_never_partly_emitted(client):
    msgs = [{"role": "user", "content": "Describe the city of Paris in two sentences."}]
    kw = dict(max_tokens=32, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, **kw)
    full = r.choices[0].message.content
    toks = [e.token for e in r.choices[0].logprobs.content]
    starts, pos = [], 0
    for t in toks:
        starts.append(pos)
        pos += len(t)
    inside = across = None
    for i, t in enumerate(toks[:-1]):
        word = t.lstrip()
        cand = word[1:4]  # three characters strictly inside one token
        if inside is None and len(word) >= 5 and full.find(cand) == starts[i] + len(t) - len(word) + 1:
            inside = cand
        cand = t[-2:] + toks[i + 1][:2]  # two characters on each side of a token boundary
        if across is None and len(t) >= 2 and len(toks[i + 1]) >= 2 and full.find(cand) == starts[i] + len(t) - 2:
            across = cand
    assert inside and across, toks
    for stop in (inside, across):
        cut = full[: full.index(stop)]
        deltas = _stream_text(client, msgs, stop=[stop], **kw)
        assert "".join(deltas) == cut, (stop, deltas)
        non_stream = client.chat.completions.create(model=MODEL, messages=msgs, stop=[stop], **kw)
        assert non_stream.choices[0].message.content == cut and non_stream.choices[0].finish_reason == "stop"


# ---- load: 32 streaming clients, a fifth hanging up ---------------------------------------


def test_bounded_load_with_hangups_returns_to_idle(server):
    script = ROOT / "benchmarks" / "serving" / "serve_load.py"
    out = subprocess.run([sys.executable, str(script), "--base-url", server, "--clients", "32", "--max-tokens", "12",
                          "--time-limit", "120"], capture_output=True, text=True, timeout=200)
    summary = json.loads(out.stdout)
    assert out.returncode == 0 and summary["ok"], summary["problems"]
    assert summary["hung_up"] == 6 and summary["hung_up_with_n2"] >= 1
    assert summary["finished_clients"] == 26 and summary["status_codes"] == [200]
    assert summary["running_after"] == 0 and summary["kv_usage_after"] == summary["kv_usage_before"]


# ---- KV compression per request (extension) ------------------------------------------------


def test_kv_compression_extension(server, client):
    salt = {"cache_salt": f"comp-{uuid.uuid4().hex}"}
    full = _chat(client, LONG_PROMPT, max_tokens=12, extra_body=salt)
    comp = _chat(client, LONG_PROMPT, max_tokens=12,
                 extra_body={**salt, "kv_compression": {"policy": "streaming_llm", "ratio": 0.75}})
    assert comp.usage.completion_tokens >= 1
    again = _chat(client, LONG_PROMPT, max_tokens=12, extra_body=salt)  # expects the full cache
    assert again.choices[0].message.content == full.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError):
        _chat(client, "x", extra_body={"kv_compression": {"policy": "random", "ratio": 0.5}})
    with pytest.raises(openai.BadRequestError):
        _chat(client, "x", extra_body={"kv_compression": {"policy": "knorm", "ratio": 1.0}})
