"""The command-line interface, run as a subprocess (``python -m kvkeeper.cli``).

Every model-using call loads the embedded SmolLM2-135M (~10 s), so those are few,
shared through module-scoped fixtures and marked slow; they run on one CPU thread (``--threads 1``): beside the
other xdist worker, two threads of a subprocess oversubscribe the 2 cores and spin (measured on the 2-core EPYC
under load: ``converse --compare`` took 36-39 s of CPU on 2 threads, 10 s on 1).  The error-path tests fail
before any model is loaded and are fast; those whose subject is the message run the CLI's ``main()`` in this
process (tests/utils/cli.py), one of them (test_unknown_model_lists_known_ids) and the ``serve`` refusals through a
real process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from tests.utils.cli import main_in_process

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
                "--temperature", "0", "--json", "--threads", "1")
    assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def conversed(tmp_path_factory):
    d = tmp_path_factory.mktemp("converse")
    src, out = d / "convs.jsonl", d / "turns.json"
    src.write_text("".join(json.dumps(o) + "\n" for o in [*MT_BENCH, TOPICAL]), encoding="utf-8")
    p = run_cli("converse", str(src), "--max-tokens", "16", "--json", str(out), "--threads", "1")
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
    p = run_cli("chat", "--max-tokens", "8", "--temperature", "0", "--threads", "1",
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


def test_bad_input_files(tmp_path, capfd):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(MT_BENCH[0]) + "\n" + '{"turns": []}\n', encoding="utf-8")
    p = main_in_process(capfd, "converse", str(empty))
    _assert_clean_error(p)
    assert "line 2" in p.stderr and "turns" in p.stderr

    p = main_in_process(capfd, "converse", str(tmp_path / "missing.jsonl"))
    _assert_clean_error(p)
    assert "missing.jsonl" in p.stderr

    p = main_in_process(capfd, "generate", "--prompt", "")
    _assert_clean_error(p)
    assert "empty" in p.stderr


# ---- converse --compare (the `make demo` path) -----------------------------------------

TOPICAL_SHIPPED = "data/topical_chat/test_freq_conversations_first20.jsonl"


@pytest.mark.slow
def test_converse_compare_reuse_vs_reprefill(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    out, png = tmp_path / "cmp.json", tmp_path / "ttft.png"
    p = run_cli("converse", TOPICAL_SHIPPED, "--compare", "--limit", "1", "--turns", "4", "--max-tokens", "8",
                "--json", str(out), "--plot", str(png), "--threads", "1")
    assert p.returncode == 0, p.stderr
    recs = json.loads(out.read_text(encoding="utf-8"))
    assert [r["turn"] for r in recs] == [1, 2, 3, 4]
    hist = [r["history_tokens"] for r in recs]
    assert hist == sorted(hist) and len(set(hist)) == 4  # the history grows every turn
    assert recs[0]["cached_tokens"] == 0
    for prev, r in zip(recs, recs[1:]):
        # the reuse session prefills only the new text: everything up to the previous reply is cached
        assert prev["history_tokens"] <= r["cached_tokens"] < r["history_tokens"]
        assert r["baseline_cached_tokens"] == 0  # the baseline recomputed the whole history
        assert r["ttft_reuse_s"] > 0 and r["ttft_baseline_s"] > 0
        assert r["ratio"] == pytest.approx(r["ttft_baseline_s"] / r["ttft_reuse_s"])
        assert r["kv_bytes_held"] > prev["kv_bytes_held"] > 0
    assert "TTFT re-prefill s" in p.stdout and "turn 4: TTFT" in p.stdout  # < 10 turns: the last turn's ratio
    cached, prompt = sum(r["cached_tokens"] for r in recs), sum(hist)
    assert f"prompt tokens served from the KV cache: {cached} of {prompt}" in p.stdout
    assert f"KV held after the last turn: {recs[-1]['kv_bytes_held']:,} bytes" in p.stdout
    with Image.open(png) as img:
        assert img.format == "PNG" and img.width > 300


def test_converse_compare_flag_errors(tmp_path, capfd):
    p = main_in_process(capfd, "converse", TOPICAL_SHIPPED, "--plot", str(tmp_path / "x.png"))
    _assert_clean_error(p)
    assert "--compare" in p.stderr
    p = main_in_process(capfd, "converse", TOPICAL_SHIPPED, "--compare", "--no-reuse")
    _assert_clean_error(p)
    assert "--no-reuse" in p.stderr
    p = main_in_process(capfd, "converse", TOPICAL_SHIPPED, "--compare", "--plot", str(tmp_path / "no" / "x.png"))
    _assert_clean_error(p)
    assert "does not exist" in p.stderr


def test_compare_summary_uses_turn_ten_and_counts_cache_share():
    from kvkeeper.cli.compare import compare_summary

    recs = [{"id": c, "turn": t, "history_tokens": 100 * t, "cached_tokens": 100 * (t - 1),
             "ratio": float(t) if c == "a" else 2.0 * t, "kv_bytes_held": 1000 * t} for c in "ab" for t in range(1, 12)]
    text = compare_summary(recs)
    assert "turn 10: TTFT 15.0x lower" in text and "mean of 2 conversations" in text
    assert "11000 of 13200 (83.3%)" in text and "22,000 bytes" in text


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvkeeper.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_cli_refuses_bad_environment_and_ports_without_a_traceback(capfd, monkeypatch):
    monkeypatch.setenv("KVKEEPER_VALIDATE", "abc")  # read when main() builds its parser
    r = main_in_process(capfd, "generate", "--prompt", "hi")
    monkeypatch.undo()
    assert r.returncode == 2 and "KVKEEPER_VALIDATE" in r.stderr and "Traceback" not in r.stderr
    # serve stays a subprocess (with a timeout): in this process, a refusal that regressed would serve forever
    r = _cli("serve", "--port", "99999999")
    assert r.returncode == 2 and "1..65535" in r.stderr and "Traceback" not in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _cli("serve", "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr
    r = _cli("serve", "--port", "1", env={"KVKEEPER_TEST_OFFLOAD_DELAY": "abc"})
    assert r.returncode == 2 and "KVKEEPER_TEST_OFFLOAD_DELAY" in r.stderr and "Traceback" not in r.stderr


# A subcommand standing in for `kvkeeper eval memory`: bm25s sets its logger to DEBUG and logs per turn, transformers
# draws its "Loading weights" bar; main() is kvkeeper's own.
_NOISY = '''
import argparse, logging, sys
import kvkeeper.cli as cli

def noisy(args):
    lib = logging.getLogger("bm25s")
    lib.setLevel(logging.DEBUG)
    lib.debug("Building index from IDs objects")
    logging.getLogger("some.library").info("library info line")
    logging.getLogger("some.library").warning("library warning line")
    import transformers.utils.logging as tl
    print("bars", tl.is_progress_bar_enabled())
    return 0

def parser():
    p = argparse.ArgumentParser()
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=noisy)
    return p

cli.build_parser = parser
sys.exit(cli.main(sys.argv[1:]))
'''


def test_library_logging_below_warning_stays_off_the_terminal():
    """Issue 31, item 8: a library's DEBUG / INFO lines and progress bars only with -v; warnings always."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    quiet = subprocess.run([sys.executable, "-c", _NOISY], capture_output=True, text=True, timeout=120, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert "Building index" not in quiet.stderr and "library info line" not in quiet.stderr, quiet.stderr
    assert "library warning line" in quiet.stderr and "bars False" in quiet.stdout
    loud = subprocess.run([sys.executable, "-c", _NOISY, "-v"], capture_output=True, text=True, timeout=120, env=env)
    assert "library info line" in loud.stderr and "bars True" in loud.stdout
    assert "Building index" not in loud.stderr  # -v is INFO: a library's DEBUG stays out even then
