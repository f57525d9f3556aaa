"""The command line as its own process (``python -m kvkeeper.cli`` / ``python -m kvkeeper``): the eval commands'
JSON and exit codes, and bad settings refused with status 2 and a message before anything loads (moved from
tests/unit/: the unit tests start no subprocess)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.utils.paths import DATA

BOOK = DATA / "gutenberg_pride_and_prejudice" / "1342-0.txt"


@pytest.mark.slow
def test_eval_perplexity_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "perplexity", "--text", str(BOOK),
                          "--context", "256", "--kv-dtype", "fp8", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["tokens"] == 256 and r["kv_bytes_per_token"] == 11880 and math.isfinite(r["ppl"]) and r["ppl"] > 1
    short = tmp_path / "short.txt"
    short.write_text("Just a few words.", encoding="utf-8")
    bad = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "perplexity", "--text", str(short),
                          "--context", "256"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "fewer than the 256 needed" in bad.stderr


@pytest.mark.slow
def test_eval_perplexity_cli_with_a_policy():
    import json
    import subprocess
    import sys
    from tests.utils.paths import DATA

    book = DATA / "gutenberg_pride_and_prejudice" / "1342-0.txt"
    out = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "perplexity", "--text", str(book),
                          "--context", "300", "--score-tokens", "40", "--policy", "snapkv", "--ratio", "0.5",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["policy"] == "snapkv" and r["kv_tokens"] == 150 and r["scored_tokens"] == 40 and r["tokens"] == 340


@pytest.mark.slow
def test_eval_passkey_cli():
    out = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "passkey", "--lengths", "300", "--depths",
                          "0", "1", "--trials", "2", "--policy", "snapkv", "--ratio", "0.5", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["trials"] == 4 and r["policy"] == "snapkv" and len(r["cells"]) == 2
    assert 0.0 <= r["accuracy"] <= 1.0 and all(c["trials"] == 2 for c in r["cells"])
    bad = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "passkey", "--depths", "1.5"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "depths must be in [0, 1]" in bad.stderr


def test_the_command_line_refuses_a_bad_config_before_loading():
    r = subprocess.run([sys.executable, "-m", "kvkeeper", "serve", "--kv-events-config",
                        '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "argument --kv-events-config: publisher must be one of zmq, null, got 'kafka'" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_command_line_refuses_it_before_starting_ray():
    r = subprocess.run([sys.executable, "-m", "kvkeeper", "serve", "--replicas", "2", "--kv-events-config",
                        '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
                        '"replay_endpoint": "tcp://127.0.0.1:5559"}'], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--kv-events-config: replay_endpoint port 5559" in r.stderr and "give it port 5558" in r.stderr
    assert "Traceback" not in r.stderr
