"""Context policies through the HTTP server: ``X-Context-Policy`` / ``context_policy`` and the budget, the
400 with both numbers, the ``X-KVKeeper-Context`` report and its metrics; the vector memory of a session
retrieves a planted fact, never another session's or tenant's, survives a server restart (the data
directory) and goes with ``DELETE /v1/sessions/{id}``."""

from __future__ import annotations

import uuid

import httpx
import pytest
from tests.utils.serverproc import running_server
from tests.unit.sessions.test_context import DATA, QUESTION, planted_conversation, topical_messages

from kvkeeper.eval.memory_recall import ServerBackend, generate, load_dialogues, run

pytestmark = pytest.mark.slow


def _report(r: httpx.Response) -> dict:
    """The X-KVKeeper-Context header as a dict of strings."""
    return dict(kv.split("=", 1) for kv in r.headers["x-kvkeeper-context"].split("; "))


def _chat(base: str, messages: list[dict], headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0,
                                                           "return_token_ids": True, **body},
                      headers=headers or {}, timeout=300)


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer, read alone (no engine: weights and KV pool) and lazily (``tokenizers``
    decodes; transformers is not imported into the test process for it)."""
    from kvkeeper.text.tokenizer import load_tokenizer
    from kvkeeper.weights.sources import resolve_model_path

    return load_tokenizer(resolve_model_path(None), lazy=True)


def _prompt_text(tokenizer, r: httpx.Response) -> str:
    return tokenizer.decode(r.json()["prompt_token_ids"])


def test_last_policy_header_body_400_and_metrics(tmp_path):
    conv = topical_messages(2) + [{"role": "user", "content": "What did we talk about first?"}]
    with running_server(tmp_path / "server.log", "--max-model-len", "2048") as base:
        sid = f"ctx-{uuid.uuid4().hex[:8]}"
        r = _chat(base, conv, {"X-Session-ID": sid, "X-Context-Policy": "last", "X-Context-Budget": "300"})
        assert r.status_code == 200, r.text
        rep = _report(r)
        assert rep["policy"] == "last" and int(rep["dropped"]) >= 1 and int(rep["prompt_tokens"]) <= 300
        assert r.json()["usage"]["prompt_tokens"] == int(rep["prompt_tokens"])
        # the body field wins over the header; the session keeps the policy for its next turns
        r = _chat(base, conv, {"X-Session-ID": sid, "X-Context-Policy": "full"}, context_policy="last",
                  context_budget=400)
        assert _report(r)["budget"] == "400" and int(_report(r)["dropped"]) >= 1
        # the latest turn alone over the budget: 400 naming both numbers
        big = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "word " * 80}]
        r = _chat(base, big, {"X-Session-ID": sid}, context_policy="last", context_budget=40)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "context_budget", r.text
        assert "40 tokens" in err["message"] and "need" in err["message"]
        # a policy that keeps state needs a session; a bad header is named
        r = _chat(base, conv, {"X-Context-Policy": "memory", "X-Context-Budget": "300"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "context_policy"
        r = _chat(base, conv, {"X-Session-ID": sid, "X-Context-Policy": "everything"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Context-Policy"
        # kvkeeper eval memory --server: the same figures through HTTP (prompts read back with /detokenize)
        convs = generate(load_dialogues(DATA), 1, 600, lambda t: len(t.split()), seed=1, facts=1)
        res = run(convs, ServerBackend(base, "last", 300, 2), "last", 300)
        rec = res["per_question"][0]
        assert res["questions"] == 1 and rec["prompt_tokens"] <= 300 and rec["question"] in rec["prompt"]
        assert rec["context"]["policy"] == "last" and rec["prompt"].startswith("<|im_start|>system")
        metrics = httpx.get(base + "/metrics").text
        line = next(ln for ln in metrics.splitlines()
                    if ln.startswith('kvkeeper:context_turns_total{kind="dropped",policy="last"}'))
        assert float(line.split()[-1]) >= 2


def test_memory_over_http_isolation_restart_and_delete(tmp_path, tokenizer):
    data = tmp_path / "data"
    conv = planted_conversation()
    args = ("--max-model-len", "2048", "--data-dir", str(data), "--context-policy", "memory",
            "--context-budget", "1024")
    sid = "ctx-mem-1"
    with running_server(tmp_path / "a.log", *args) as base:
        r = _chat(base, conv, {"X-Session-ID": sid})
        assert r.status_code == 200, r.text
        assert int(_report(r)["retrieved"]) >= 1 and "Valparaiso" in _prompt_text(tokenizer, r)
        # the same history without the fact in another session
        plain = [conv[0], *topical_messages(), {"role": "user", "content": QUESTION}]
        r = _chat(base, plain, {"X-Session-ID": "ctx-mem-2"})
        assert r.status_code == 200 and "Valparaiso" not in _prompt_text(tokenizer, r)
        assert (data / "memory").is_dir() and any((data / "memory").iterdir())
    with running_server(tmp_path / "b.log", *args) as base:  # a restart: the session and its memory come back
        r = _chat(base, conv, {"X-Session-ID": sid})
        rep = _report(r)
        # nothing left the prompt this turn (the saved state matched): what is retrieved was stored before
        assert rep["policy"] == "memory" and rep["rewritten"] == "0" and int(rep["retrieved"]) >= 1
        assert "Valparaiso" in _prompt_text(tokenizer, r)
        # another tenant on the same session id, with the history minus the fact, never reads it
        r = _chat(base, plain, {"X-Session-ID": sid, "X-Cache-Salt": "tenant-b"})
        assert r.status_code == 200 and _report(r)["policy"] == "memory"
        assert "Valparaiso" not in _prompt_text(tokenizer, r)
        files = {p.name for p in (data / "memory").iterdir()}
        assert any(sid in f for f in files)
        assert httpx.delete(f"{base}/v1/sessions/{sid}").status_code == 200
        assert not any(sid in p.name for p in (data / "memory").iterdir())
