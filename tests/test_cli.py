"""The command-line interface, run as a subprocess (``python -m kvkeeper.cli``).

Every model-using call loads the embedded SmolLM2-135M (~10 s), so those are few,
shared through module-scoped fixtures and marked slow.  The error-path tests fail
before any model is loaded and are fast.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

MT_BENCH = [
    {"question_id": 901, "category": "writing", "turns": ["Name three colours of the rainbow.", "Now name two more."]},
    {"question_id": 902, "category": "math", "turns": ["What is 2 + 2?", "And what is that times three?"]},
]
TOPICAL = {"id": "t_test", "num_turns": 2, "turns": [
    {"speaker": "agent_1", "text": "Did you know the Eiffel Tower grows in summer?"},
    {"speaker": "agent_2", "text": "Really? Why would a tower grow?"},
]}
RECORD_KEYS = {"id", "turn", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "decode_tok_per_s",
               "text", "token_ids"}


def run_cli(*args: str, stdin: str | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvkeeper.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


# ---- model-using (slow) -------------------------------------------------------


@pytest.fixture(scope="module")
def generated():
    p = run_cli("generate", "--chat", "--prompt", MT_BENCH[0]["turns"][0], "--max-tokens", "16",
                "--temperature", "0", "--json", "--threads", "2")
    assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def conversed(tmp_path_factory):
    d = tmp_path_factory.mktemp("converse")
    src, out = d / "convs.jsonl", d / "turns.json"
    src.write_text("".join(json.dumps(o) + "\n" for o in [*MT_BENCH, TOPICAL]), encoding="utf-8")
    p = run_cli("converse", str(src), "--max-tokens", "16", "--json", str(out), "--threads", "2")
    assert p.returncode == 0, p.stderr
    return p, json.loads(out.read_text(encoding="utf-8"))


@pytest.mark.slow
def test_generate_json(generated):
    assert "Traceback" not in generated.stderr
    rec = json.loads(generated.stdout)  # stdout is exactly one JSON object
    for k in ("text", "token_ids", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
              "ttft_s", "decode_tok_per_s"):
        assert k in rec, k
    assert isinstance(rec["text"], str) and rec["text"]
    assert rec["completion_tokens"] == len(rec["token_ids"]) >= 1
    assert 1 <= rec["completion_tokens"] <= 16
    assert rec["prompt_tokens"] > 0 and 0 <= rec["cached_tokens"] < rec["prompt_tokens"]
    assert rec["finish_reason"] in ("stop", "length")
    assert rec["ttft_s"] is not None and rec["ttft_s"] > 0


@pytest.mark.slow
def test_converse_records_and_reuse(conversed):
    p, recs = conversed
    assert "Traceback" not in p.stderr
    assert [(r["id"], r["turn"]) for r in recs] == [(901, 1), (901, 2), (902, 1), (902, 2), ("t_test", 1), ("t_test", 2)]
    for r in recs:
        assert RECORD_KEYS <= set(r), r.keys()
        assert r["completion_tokens"] == len(r["token_ids"])
        assert 1 <= r["completion_tokens"] <= 16
    for r in recs:
        if r["turn"] == 2:  # the earlier turns' KV is reused
            assert 0 < r["cached_tokens"] < r["prompt_tokens"], r
    # the table and the summary go to stdout
    assert "cached tok" in p.stdout and "mean TTFT" in p.stdout


@pytest.mark.slow
def test_greedy_is_deterministic_across_processes(generated, conversed):
    # Conversation 901's first turn is the same chat prompt as the generate call, sent to a fresh
    # engine in another process with nothing cached: greedy decoding must give the same tokens.
    gen = json.loads(generated.stdout)
    first = conversed[1][0]
    assert first["cached_tokens"] == 0
    assert first["prompt_tokens"] == gen["prompt_tokens"]
    assert first["token_ids"] == gen["token_ids"]
    assert first["text"] == gen["text"]


@pytest.mark.slow
def test_chat_piped_stdin():
    p = run_cli("chat", "--max-tokens", "8", "--temperature", "0", "--threads", "2",
                stdin="Hello, who are you?\nTell me a joke.\n")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    stats = [ln for ln in p.stderr.splitlines() if ln.startswith("[turn ")]
    assert len(stats) == 2, p.stderr
    pat = re.compile(r"\[turn (\d)\] prompt (\d+) tok, cached (\d+) tok, completion (\d+) tok, TTFT [\d.]+ s, "
                     r"(?:[\d.]+|n/a) tok/s")
    m1, m2 = (pat.fullmatch(s) for s in stats)
    assert m1 and m2, stats
    assert (m1[1], m2[1]) == ("1", "2")
    assert 0 < int(m2[3]) < int(m2[2])  # turn 2 reuses turn 1's KV
    assert p.stdout.strip()  # the replies


# ---- errors (fast: they fail before the model loads) -----------------------------


def _assert_clean_error(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("error: "), p.stderr
    assert p.stdout == ""


def test_unknown_model_lists_known_ids():
    p = run_cli("generate", "--model", "no-such-model", "--prompt", "hi")
    _assert_clean_error(p)
    assert "no-such-model" in p.stderr and "smollm2-135m-instruct" in p.stderr


def test_bad_input_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(MT_BENCH[0]) + "\n" + '{"turns": []}\n', encoding="utf-8")
    p = run_cli("converse", str(empty))
    _assert_clean_error(p)
    assert "line 2" in p.stderr and "turns" in p.stderr

    p = run_cli("converse", str(tmp_path / "missing.jsonl"))
    _assert_clean_error(p)
    assert "missing.jsonl" in p.stderr

    p = run_cli("generate", "--prompt", "")
    _assert_clean_error(p)
    assert "empty" in p.stderr
