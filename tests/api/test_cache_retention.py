"""Issue 45's must-show "the cache_control breakpoint survives pressure", with the official ``anthropic`` client
against a real server (the embedded SmolLM2-135M) whose KV pool is small (``--kv-blocks 48``: 768 tokens): a
request with a breakpoint on a long system prompt and no session header, then unrelated requests that fill the
pool three times over, then the same system prompt again.  With retention holds (the default ``--kv-hold-share``)
the second request reads the breakpoint's prefix from the cache; with holds off (``--kv-hold-share 0``, today's
LRU) the same traffic evicts it and the read is short of it.  Also OpenAI's ``prompt_cache_retention: "24h"``
through the ``openai`` client on chat completions, and an unknown retention refused by name.

One server per configuration (module-scoped, one at a time); replies are a single greedy token.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from tests.utils.serverproc import running_server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
NUM_BLOCKS, BLOCK = 48, 16  # the pool: 768 tokens of KV
SYSTEM = ("You are a coding agent working in a large repository. Read the files you are given, run the tests, "
          "and answer in one short sentence. Never invent a file name; say when you do not know. " * 3).strip()


@pytest.fixture(scope="module", params=["holds", "no-holds"])
def server(request, tmp_path_factory):
    """(base URL, whether holds are on): the default share, then ``--kv-hold-share 0``."""
    d = tmp_path_factory.mktemp(f"retention-{request.param}")
    share = [] if request.param == "holds" else ["--kv-hold-share", "0"]
    with running_server(d / "server.log", "--kv-blocks", str(NUM_BLOCKS), "--max-model-len", "1024",
                        *share) as base:
        yield base, request.param == "holds"


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _fill(client, rounds: int) -> int:
    """Unrelated requests (no breakpoint, no session) of ~350 prompt tokens each; returns their prompt tokens."""
    total = 0
    for i in range(rounds):
        words = " ".join(f"item{i}x{j}" for j in range(65))
        r = client.messages.create(model=MODEL, max_tokens=1, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": f"Count these: {words}"}])
        total += r.usage.input_tokens + r.usage.cache_read_input_tokens + r.usage.cache_creation_input_tokens
    return total


def test_the_breakpoint_prefix_survives_pressure_only_with_holds(server):
    base, holds = server
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=600)
    system = [{"type": "text", "text": f"{uuid.uuid4()} {SYSTEM}", "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model=MODEL, max_tokens=1, extra_body={"temperature": 0}, system=system,
                                   messages=[{"role": "user", "content": "Which file holds the tests?"}])
    breakpoint_end = first.usage.cache_creation_input_tokens  # nothing was cached before: all of it written
    held = breakpoint_end // BLOCK * BLOCK  # the full blocks up to the breakpoint
    assert first.usage.cache_read_input_tokens == 0 and held >= 8 * BLOCK, first.usage
    assert held <= NUM_BLOCKS * BLOCK // 4  # within the default share (25% of the pool)

    filled = _fill(client, 7)
    assert filled >= 3 * NUM_BLOCKS * BLOCK, filled  # the pool's worth of KV three times over

    again = client.messages.create(model=MODEL, max_tokens=1, extra_body={"temperature": 0}, system=system,
                                   messages=[{"role": "user", "content": "Where is the README?"}])
    read = again.usage.cache_read_input_tokens
    if holds:
        assert read >= held, again.usage
        assert _metric(base, "kvkeeper:kv_held_blocks") >= held // BLOCK
        assert _metric(base, "kvkeeper:kv_holds_gave_way_total") == 0
    else:  # today's LRU: the unrelated traffic evicted the prefix
        assert read < held, again.usage
        assert _metric(base, "kvkeeper:kv_held_blocks") == 0


def test_prompt_cache_retention_24h_holds_the_prompt_on_chat(server):
    base, holds = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    msgs = [{"role": "system", "content": f"{uuid.uuid4()} {SYSTEM}"}, {"role": "user", "content": "Hello."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0,
                                       extra_body={"prompt_cache_retention": "24h"})
    full = r.usage.prompt_tokens // BLOCK * BLOCK
    _fill(anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=600), 4)  # the pool's worth twice
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0,
                                           extra_body={"prompt_cache_retention": "in_memory"})
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert (cached >= full - BLOCK) if holds else (cached < full - BLOCK), (cached, full)  # the last block: recomputed
    bad = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": msgs, "max_tokens": 1, "prompt_cache_retention": "7d"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_retention", bad.text
