"""A server killed (SIGKILL) while it writes a session's offload to disk loses no saved session: after a restart the
session saved before is listed and continues exactly, the one cut short is not visible and leaves no temporary
file (moved from tests/unit/sessions/test_offload.py: it starts two server processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from kvkeeper.sessions.disk import MANIFEST
from tests.utils.serverproc import server_process

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


def _chat(base, sid, msgs, salt=None, max_tokens=10):
    h = {"X-Session-ID": sid}
    if salt:
        h["X-Cache-Salt"] = salt
    r = httpx.post(base + "/v1/chat/completions", headers=h, timeout=120,
                   json={"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                         "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], [e["token"] for e in body["choices"][0]["logprobs"]["content"]], \
        body["usage"]


def test_sigkill_during_offload_write_loses_no_saved_session(tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "KVKEEPER_TEST_OFFLOAD_DELAY": "1.5"}
    # the default path (GGUF blocks in place, bf16 KV; named so that a $KVKEEPER_QUANTIZATION of the caller's does not
    # change it): each start loads a third of the fp32 path's memory; a reply continued from disk equals the reference
    # there as well (reuse equals recompute bit for bit on it, tests/unit/engine/test_invariance.py)
    args = ("--kv-blocks", "128", "--data-dir", str(data), "--quantization", "gguf")
    m1 = [{"role": "user", "content": "Name three colours."}]
    a, b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    with server_process(tmp_path / "s1.log", *args, env=env) as (base, proc):
        reply_a, _, _ = _chat(base, a, m1)
        # the reference: the same conversation under another tenant salt (its own KV), never offloaded
        reply_r, _, _ = _chat(base, "ref", m1, salt="ref")
        assert reply_r == reply_a
        m2 = m1 + [{"role": "assistant", "content": reply_a}, {"role": "user", "content": "And three animals?"}]
        _, ref_tokens, ref_usage = _chat(base, "ref", m2, salt="ref")
        r = httpx.post(f"{base}/v1/sessions/{a}/offload", params={"tier": "disk"}, timeout=60)
        assert r.status_code == 200 and r.json()["tier"] == "disk", r.text
        _chat(base, b, [{"role": "user", "content": "Count to five."}])
        def offload_b():
            with contextlib.suppress(httpx.HTTPError):  # the server dies under it
                httpx.post(f"{base}/v1/sessions/{b}/offload", params={"tier": "disk"}, timeout=60)

        t = threading.Thread(target=offload_b, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while not list((data / "sessions" / b).glob(".kv-*.tmp-*")):  # B's tensor file is being written
            assert time.monotonic() < deadline, "the offload of B never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    with server_process(tmp_path / "s2.log", *args) as (base, proc):
        listed = {s["id"]: s for s in httpx.get(base + "/v1/sessions").json()["data"]}
        assert listed[a]["tier"] == "disk" and listed[a]["tokens"] > 0
        assert b not in listed  # cut short before its manifest: never visible
        assert not list(data.rglob("*.tmp-*")) and not (data / "sessions" / b).exists()
        _, tokens, usage = _chat(base, a, m2)
        assert tokens == ref_tokens
        assert usage["prompt_tokens_details"]["cached_tokens"] == ref_usage["prompt_tokens_details"]["cached_tokens"]
        listed = {s["id"]: s for s in httpx.get(base + "/v1/sessions").json()["data"]}
        assert listed[a]["tier"] == "pool"
        metrics = httpx.get(base + "/metrics").text
        assert 'kvkeeper:kv_restore_total{tier="disk"} 1.0' in metrics
        r = httpx.post(f"{base}/v1/sessions/nope/offload")
        assert r.status_code == 404
        r = httpx.post(f"{base}/v1/sessions/{a}/offload", params={"tier": "tape"})
        assert r.status_code == 400 and "unknown offload tier" in r.json()["error"]["message"]
    log = (tmp_path / "s2.log").read_text()
    assert "Traceback" not in log and "saved 1 sessions" in log  # a graceful stop saves the open session
    assert (data / "sessions" / a / MANIFEST).exists()
