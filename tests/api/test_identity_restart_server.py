"""The probe of issue 44 item 2 against real servers: a session saved by one server (the embedded SmolLM2-135M,
float32 weights and bf16 KV) is not continued by a server started on the same data directory with
``--dtype bfloat16``: it is skipped with a warning naming the difference, and the conversation is recomputed
rather than continued from KV of other numerics."""

from __future__ import annotations

import httpx
import pytest

from tests.utils.serverproc import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


def _turn(base: str, content: str) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", headers={"X-Session-ID": "probe"}, timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0})


def test_a_restart_with_another_activation_dtype_skips_the_saved_session(tmp_path):
    data = tmp_path / "data"
    common = ("--data-dir", str(data), "--quantization", "none", "--kv-dtype", "bf16")
    with running_server(tmp_path / "a.log", *common) as base:
        assert _turn(base, "Name three rivers of Europe and say which is the longest.").status_code == 200
    assert (data / "sessions" / "probe").is_dir()  # saved on shutdown
    with running_server(tmp_path / "b.log", *common, "--dtype", "bfloat16") as base:
        assert httpx.get(base + "/v1/sessions", timeout=30).json()["data"] == []
        r = _turn(base, "Name three rivers of Europe and say which is the longest.")
        assert r.status_code == 200 and r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    log = (tmp_path / "b.log").read_text()
    assert "skipping the saved session" in log and "activation_dtype='float32' (this engine: 'bfloat16')" in log, log[-3000:]
