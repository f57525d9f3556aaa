"""The namespace-framing probe of issue 44 item 3 against a real server (the embedded SmolLM2-135M): a request
whose ``cache_salt`` is the string ``["prompt_cache_key", null, "K"]`` (what the key's namespace used to be
built from) never hits the cache of ``prompt_cache_key: "K"``; the key's own requests still do."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.utils.serverproc import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPT = ("A long note on lighthouses, their keepers, lenses and the ships they guided along the rocky coast. " * 16
          + "Summarise it.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("framing")
    with running_server(d / "server.log") as base:
        yield base


def _cached(server, **fields) -> tuple[int, int]:
    r = httpx.post(server + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_a_salt_spelling_the_key_framing_misses_the_keys_cache(server):
    n, _ = _cached(server, prompt_cache_key="K")
    assert n > 300
    _, hit = _cached(server, prompt_cache_key="K")
    assert hit >= n - 16  # the key's own requests share its cache
    _, probe = _cached(server, cache_salt=json.dumps(["prompt_cache_key", None, "K"]))
    assert probe == 0
