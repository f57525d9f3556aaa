"""Issue 30 at the door: ``--speculative-config``, OpenAI's Predicted Outputs (``prediction``) with its usage
counts, the per-request opt-out (``speculative_decoding: false``), the spec-decode metrics and the load line, with
the official ``openai`` client against a real server on the default (invariant, GGUF) path, where the output with
drafts must be the output without.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils.serverproc import running_server

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
# adaptive false: every draft is 8 tokens long whatever the step timings (the adaptive length follows the machine's
# load through the cost model), so the prediction counts below are a function of the tokens only
SPEC = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "adaptive": false}'
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick "
        "daft zebras jump.")
ASK = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("spec") / "server.log"


@pytest.fixture(scope="module")
def server(server_log):
    with running_server(server_log, "--max-model-len", "1024", "--quantization", "gguf",
                        "--speculative-config", SPEC) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    # a generous bound: on a loaded 2-core machine one 40-token reply has taken over 120 s
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=900)


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, **kw)


def test_prediction_is_used_and_counted_and_changes_nothing(client, server_log):
    plain = _chat(client, extra_body={"speculative_decoding": False})
    assert plain.usage.completion_tokens_details is None  # no prediction: no prediction counts
    edited = plain.choices[0].message.content.replace("fox", "cat")
    got = _chat(client, prediction={"type": "content", "content": edited})
    assert got.choices[0].message.content == plain.choices[0].message.content
    d = got.usage.completion_tokens_details
    assert d.accepted_prediction_tokens > 10 and d.rejected_prediction_tokens > 0
    parts = _chat(client, prediction={"type": "content", "content": [{"type": "text", "text": edited[:20]},
                                                                     {"type": "text", "text": edited[20:]}]})
    assert parts.choices[0].message.content == plain.choices[0].message.content
    streamed = list(_chat(client, prediction={"type": "content", "content": edited}, stream=True,
                          stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.choices[0].message.content
    assert streamed[-1].usage.completion_tokens_details.accepted_prediction_tokens > 10
    assert "ngram speculation (up to 8 draft tokens" in server_log.read_text()  # the load line says what runs


def test_spec_decode_metrics(server, client):
    _chat(client)  # the prompt's own text: n-gram drafts
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server + "/metrics").text)}
    value = lambda name: sum(s.value for s in fams[name].samples if s.name.endswith("_total"))  # noqa: E731
    drafted = value("kvkeeper:spec_decode_num_draft_tokens")
    accepted = value("kvkeeper:spec_decode_num_accepted_tokens")
    assert drafted > 0 and 0 < accepted <= drafted and value("kvkeeper:spec_decode_num_drafts") > 0
    per_pos = {s.labels["position"]: s.value for s in fams["kvkeeper:spec_decode_num_accepted_tokens_per_pos"].samples
               if s.name.endswith("_total")}
    assert per_pos["0"] >= per_pos["1"] and sum(per_pos.values()) == accepted


@pytest.mark.parametrize("body,param", [
    ({"prediction": {"type": "content", "content": [{"type": "image_url", "text": None}]}}, "prediction.content.0"),
    ({"prediction": {"type": "content", "content": "x"}, "speculative_decoding": False}, "prediction"),
    ({"prediction": {"type": "file", "content": "x"}}, "prediction.type"),
    ({"prediction": {"type": "content", "content": "x", "extra": 1}}, "prediction.extra"),
])
def test_bad_predictions_are_400_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_cli_refuses_an_unknown_speculative_field_by_name():
    p = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "serve", "--speculative-config",
                        '{"method": "ngram", "draft_model": "x"}'], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown field(s) draft_model" in p.stderr, p.stderr
