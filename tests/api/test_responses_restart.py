"""Stored responses and conversations survive a restart (issue 25): a response stored on one server process is
continued by the next process on the same ``--data-dir`` with its KV restored from the disk tier (the whole previous
turn cached) and the same reply as continuing on the first process; so is a conversation (its reply equal to the
full-history chat).  With ``--session-ttl`` idle sessions, stored responses and conversations expire and are
counted.  Driven by the official ``openai`` client.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from tests.utils.serverproc import server_process

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)


def test_a_stored_response_continues_after_a_restart(tmp_path):
    args = ("--max-model-len", "1024", "--data-dir", str(tmp_path / "data"))
    ask = dict(model=MODEL, temperature=0, max_output_tokens=12)
    with server_process(tmp_path / "first.log", *args) as (base, proc):
        c = _client(base)
        r1 = c.responses.create(input="My favourite number is 42. Say ok.", **ask)
        conv = c.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
        c1 = c.responses.create(input="Say hello to me.", conversation=conv.id, store=False, **ask)
        expect = c.responses.create(input="What is my favourite number?", previous_response_id=r1.id, store=False,
                                    **ask)
        proc.terminate()  # a graceful stop: the sessions' KV is saved to the disk tier
        proc.wait(timeout=60)  # uvicorn exits by the signal once the lifespan has ended
    assert "saved 2 sessions" in (tmp_path / "first.log").read_text()
    with server_process(tmp_path / "second.log", *args) as (base, _):
        c = _client(base)
        assert c.responses.retrieve(r1.id).output_text == r1.output_text
        again = c.responses.create(input="What is my favourite number?", previous_response_id=r1.id, store=False,
                                   **ask)
        assert again.output_text == expect.output_text
        cached = again.usage.input_tokens_details.cached_tokens
        assert cached == expect.usage.input_tokens_details.cached_tokens == (
            r1.usage.input_tokens + r1.usage.output_tokens - 1)
        c2 = c.responses.create(input="What is my name?", conversation=conv.id, **ask)
        assert c2.usage.input_tokens_details.cached_tokens == c1.usage.input_tokens + c1.usage.output_tokens - 1
        chat = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
            {"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "Say hello to me."},
            {"role": "assistant", "content": c1.output_text}, {"role": "user", "content": "What is my name?"}])
        assert c2.output_text == chat.choices[0].message.content
    assert "Traceback" not in (tmp_path / "second.log").read_text()


def test_idle_sessions_responses_and_conversations_expire_and_are_counted(tmp_path):
    data = tmp_path / "data"
    with server_process(tmp_path / "ttl.log", "--max-model-len", "1024", "--data-dir", str(data),
                        "--session-ttl", "2") as (base, _):
        c = _client(base)
        r = c.responses.create(model=MODEL, input="Say ok.", temperature=0, max_output_tokens=4)
        conv = c.conversations.create(items=[{"role": "user", "content": "Hi."}])
        c.responses.create(model=MODEL, input="Say ok.", conversation=conv.id, temperature=0, max_output_tokens=4,
                           store=False)
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=4,
                                  extra_headers={"X-Session-ID": "s-ttl"})
        deadline = time.monotonic() + 60
        while True:  # bounded poll: the engine thread expires idle sessions about once a second
            m = re.search(r"^kvkeeper:sessions_expired_total (\S+)$", httpx.get(base + "/metrics").text, re.M)
            if m and float(m.group(1)) >= 3:
                break
            assert time.monotonic() < deadline, "the sessions never expired"
            time.sleep(0.2)
        assert httpx.get(base + "/v1/sessions").json()["data"] == []
        for call in (lambda: c.responses.retrieve(r.id), lambda: c.conversations.retrieve(conv.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert not list((data / "responses").glob("*.json")) and not list((data / "conversations").glob("*.json"))
