"""Issue 45 item 6, why a request missed the cache: the classifier
(:func:`kvkeeper.api.engine_client.cache_miss.classify` and :class:`MissLog`) on token ids, then the ``openai``
client against a real server (the embedded model): a session whose turn 2 changes a timestamp in the system prompt
gets ``X-KVKeeper-Cache-Miss: reason=content_changed`` at the token where the timestamp differs,
``/admin/cache/misses`` lists it and ``kvkeeper:cache_miss_total`` counts it; an unchanged follow-up turn gets no
header.  Also ``/v1/messages`` with Claude Code's session header."""

from __future__ import annotations

import uuid

import httpx
import pytest
from tests.utils.serverproc import running_server

from kvkeeper.api.engine_client.cache_miss import MissLog, classify

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
NS, OTHER_NS = object(), object()
PREV = list(range(100, 140))  # the predecessor's prompt plus reply: 40 tokens


# ---- the classifier -------------------------------------------------------------------------------------------
def test_a_clean_append_that_read_everything_lost_nothing():
    assert classify(PREV, NS, PREV + [7, 8, 9], NS, cached=40) == ("none", 40)
    assert classify(PREV, NS, PREV[:30], NS, cached=29) == ("none", 30)  # a regenerate: the prompt is a prefix


def test_a_content_change_at_index_i_is_named_there():
    ids = PREV[:12] + [1, 2] + PREV[14:] + [5, 6]
    assert classify(PREV, NS, ids, NS, cached=12) == ("content_changed", 12)
    # block-granular reads (outside a session): 12 shared tokens read as one block of 8 is still all that could be
    assert classify(PREV, NS, ids, NS, cached=8, block_size=8) == ("content_changed", 12)


def test_prompts_that_agree_further_than_was_read_were_evicted():
    assert classify(PREV, NS, PREV + [5], NS, cached=16) == ("evicted", 40)
    assert classify(PREV, NS, PREV + [5], NS, cached=16, block_size=16) == ("evicted", 40)
    ids = PREV[:30] + [1]
    assert classify(PREV, NS, ids, NS, cached=0) == ("evicted", 30)  # changed at 30, but not even 30 read


def test_a_changed_namespace_is_named_before_eviction():
    assert classify(PREV, NS, PREV + [5], OTHER_NS, cached=0) == ("namespace_changed", 40)
    assert classify(PREV, NS, PREV + [5], OTHER_NS, cached=40) == ("none", 40)  # read anyway: nothing lost


def test_the_log_explains_against_the_predecessor_and_stays_bounded():
    log = MissLog(lambda ids: "".join(chr(97 + i % 26) for i in ids), max_keys=2, max_recent=3)
    assert log.observe("k", ("session", "s1"), "r1", PREV[:30], PREV[30:], NS, 0) is None  # no predecessor
    ids = PREV[:5] + [0] + PREV[6:] + [1]
    miss = log.observe("k", ("session", "s1"), "r2", ids, [2, 3], NS, 5)
    assert (miss.reason, miss.at, miss.cached, miss.previous_tokens, miss.prompt_tokens) == \
        ("content_changed", 5, 5, 40, 41)
    assert miss.before.endswith(log.decode(PREV[:5])) and miss.current.startswith("a")
    assert miss.header().startswith("reason=content_changed; at=5; cached=5; previous=") and miss.header().isascii()
    assert log.recent(1)[0]["request_id"] == "r2"
    # the predecessor is now r2's prompt + reply: appending to it, all read, is no miss
    assert log.observe("k", ("session", "s1"), "r3", ids + [2, 3, 9], [], NS, 43) is None
    for k in ("a", "b"):  # two newer keys push "k" out
        log.observe(k, ("cache_key", k), k, [1, 2], [], NS, 0)
    assert "k" not in log._last and len(log._last) == 2


# ---- a real server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache-miss")
    with running_server(d / "server.log", "--max-model-len", "1024") as url:
        yield url


def _misses(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("kvkeeper:cache_miss_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def _system(stamp: str) -> str:
    return f"You are a careful assistant. The current time is {stamp}. Answer in one short sentence."


@pytest.mark.slow
def test_a_changed_timestamp_is_named_and_an_unchanged_turn_is_not(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    sid = f"miss-{uuid.uuid4().hex[:8]}"
    hdr = {"X-Session-ID": sid}

    def turn(system: str, history: list[dict]):
        msgs = [{"role": "system", "content": system}, *history]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, max_tokens=3, temperature=0, extra_headers=hdr,
            extra_body={"return_token_ids": True})
        return raw, raw.parse()

    before = _misses(base)
    assert set(before) == {"content_changed", "namespace_changed", "evicted"}
    user1 = [{"role": "user", "content": "Name a colour."}]
    r1, c1 = turn(_system("2026-12-07 12:00:01"), user1)
    assert r1.headers.get("x-kvkeeper-cache-miss") is None  # no predecessor
    ids1 = c1.model_extra["prompt_token_ids"]
    history = user1 + [{"role": "assistant", "content": c1.choices[0].message.content},
                       {"role": "user", "content": "And another one."}]
    r2, c2 = turn(_system("2026-12-07 12:09:01"), history)
    ids2 = c2.model_extra["prompt_token_ids"]
    at = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)  # where the timestamps part
    miss = r2.headers.get("x-kvkeeper-cache-miss")
    assert miss is not None and miss.startswith(f"reason=content_changed; at={at}; cached="), miss
    assert c2.usage.prompt_tokens_details.cached_tokens <= at
    assert _misses(base)["content_changed"] == before["content_changed"] + 1
    listed = httpx.get(base + "/admin/cache/misses", params={"limit": 5}, timeout=30).json()["data"]
    last = listed[-1]
    assert (last["key"], last["kind"], last["reason"], last["at"]) == (sid, "session", "content_changed", at)
    assert "12:0" in last["before"] and last["previous"] != last["current"]
    assert len(last["before"]) <= 40 and len(last["previous"]) <= 40
    # the same system prompt again, one more turn appended: the whole predecessor is read, no header
    history += [{"role": "assistant", "content": c2.choices[0].message.content},
                {"role": "user", "content": "Thanks."}]
    r3, c3 = turn(_system("2026-12-07 12:09:01"), history)
    assert r3.headers.get("x-kvkeeper-cache-miss") is None, r3.headers.get("x-kvkeeper-cache-miss")
    assert c3.usage.prompt_tokens_details.cached_tokens >= len(ids2)
    assert _misses(base) == {**before, "content_changed": before["content_changed"] + 1}


@pytest.mark.slow
def test_anthropic_messages_with_claude_codes_session_header_name_the_change(base):
    sid = f"cc-{uuid.uuid4().hex[:8]}"

    def turn(stamp: str, messages: list[dict]) -> httpx.Response:
        r = httpx.post(base + "/v1/messages", headers={"X-Claude-Code-Session-Id": sid}, timeout=300,
                       json={"model": MODEL, "max_tokens": 2, "system": _system(stamp), "messages": messages,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        return r

    first = [{"role": "user", "content": "Name a colour."}]
    r1 = turn("2026-12-07 12:00:01", first)
    assert "x-kvkeeper-cache-miss" not in r1.headers
    reply = "".join(b.get("text", "") for b in r1.json()["content"])
    r2 = turn("2026-12-07 12:09:01", first + [{"role": "assistant", "content": reply or "Red."},
                                               {"role": "user", "content": "Another."}])
    assert r2.headers["x-kvkeeper-cache-miss"].startswith("reason=content_changed; at="), r2.headers
    last = httpx.get(base + "/admin/cache/misses", params={"limit": 1}, timeout=30).json()["data"]
    assert [(m["key"], m["reason"]) for m in last] == [(sid, "content_changed")]
