"""The command line as its own process (``python -m kvkeeper.cli`` / ``python -m kvkeeper``): the eval commands'
JSON and exit codes, and bad settings refused with status 2 and a message before anything loads (moved from
tests/unit/: the unit tests start no subprocess).  The model-using runs take ``--threads 1`` (two threads beside the
other xdist worker oversubscribe the 2 cores and spin); a refusal that comes before any model loads, beside a test's
run of the process, goes through the CLI's ``main()`` in this process (tests/utils/cli.py: no 2.8 s interpreter and
torch import for it)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.unit.worker.test_gpu_path import TINY
from tests.utils.cli import main_in_process
from tests.utils.kernels import kernels_or_skip
from tests.utils.paths import DATA, ROOT

BOOK = DATA / "gutenberg_pride_and_prejudice" / "1342-0.txt"


@pytest.fixture(scope="module")
def kernels():
    return kernels_or_skip()


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """A tiny Llama config (tests/unit/worker/test_gpu_path.py's) for ``--load-format dummy``."""
    p = tmp_path_factory.mktemp("tiny") / "config.json"
    p.write_text(json.dumps(TINY))
    return str(p)


@pytest.mark.slow
def test_eval_perplexity_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "perplexity", "--text", str(BOOK),
                          "--context", "256", "--kv-dtype", "fp8", "--json", "--threads", "1"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["tokens"] == 256 and r["kv_bytes_per_token"] == 11880 and math.isfinite(r["ppl"]) and r["ppl"] > 1
    short = tmp_path / "short.txt"
    short.write_text("Just a few words.", encoding="utf-8")
    bad = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "perplexity", "--text", str(short),
                          "--context", "256", "--threads", "1"], capture_output=True, text=True, timeout=300)
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
                          "--json", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["policy"] == "snapkv" and r["kv_tokens"] == 150 and r["scored_tokens"] == 40 and r["tokens"] == 340


@pytest.mark.slow
def test_eval_passkey_cli(capfd):
    out = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "passkey", "--lengths", "300", "--depths",
                          "0", "1", "--trials", "2", "--policy", "snapkv", "--ratio", "0.5", "--json", "--threads",
                          "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["trials"] == 4 and r["policy"] == "snapkv" and len(r["cells"]) == 2
    assert 0.0 <= r["accuracy"] <= 1.0 and all(c["trials"] == 2 for c in r["cells"])
    bad = main_in_process(capfd, "eval", "passkey", "--depths", "1.5")  # refused before the model loads
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


def _cli(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvkeeper.cli", *args], capture_output=True, text=True,
                          timeout=300, env=e)


@pytest.mark.slow
def test_cli_load_line_and_bad_value(kernels):
    r = _cli("generate", "--prompt", "The capital of France is", "--max-tokens", "3", "--quantization", "gguf",
             "--json", "--kv-blocks", "16", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "weights gguf: 120 Q4_1, 1 Q8_0 matrices in place" in r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 3
    bad = _cli("generate", "--prompt", "hi", "--quantization", "q2", "--kv-blocks", "16", "--threads", "1")
    assert bad.returncode == 2
    assert "error: unknown --quantization 'q2'; this model file supports none, gguf, int8, int4" in bad.stderr


@pytest.mark.slow
def test_without_kernels_the_engine_runs_float32_and_says_why(tmp_path):
    r = _cli("generate", "--prompt", "Hello", "--max-tokens", "2", "--quantization", "gguf", "--kv-blocks", "16",
             "--threads", "1", env={"KVKEEPER_CPU_KERNELS": "0"})
    assert r.returncode == 0, r.stderr
    assert "CPU kernels unavailable (ImportError: disabled by KVKEEPER_CPU_KERNELS=0)" in r.stderr
    assert "running --quantization none instead" in r.stderr and "weights float32 weights" in r.stderr


def test_cli_generate_with_dummy_weights(tiny_config, capfd):
    r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "generate", "--load-format", "dummy", "--model",
                        tiny_config, "--device", "cpu", "--prompt", "hello", "--max-tokens", "3", "--json",
                        "--kv-blocks", "64", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == 5 and out["completion_tokens"] == 3  # bytes of "hello"; the tiny config has no EOS
    assert "float32 on cpu" in r.stderr
    r = main_in_process(capfd, "generate", "--load-format", "dummy", "--model", "nope", "--prompt", "x")
    assert r.returncode == 2 and "llama-3.1-8b" in r.stderr


def test_kv_dump_errors_are_messages_under_python_m_kvkeeper_cli(tmp_path):
    # `python -m kvkeeper.cli` runs the module as __main__; the kv subcommands raise kvkeeper.cli.CLIError,
    # which must still be caught (it printed a traceback and exited 1)
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "kv", "dump", "--session", "s1",
                        "-o", str(tmp_path / "x.safetensors")], capture_output=True, text=True, timeout=120,
                       env=os.environ.copy())
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "error: --session needs --server URL" in r.stderr


def test_cuda_refused_clearly_without_cuda_by_the_cli_and_the_gpu_benchmark(capfd):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = main_in_process(capfd, "generate", "--prompt", "hi", "--device", "cuda", "--load-format", "dummy",
                        "--model", "llama-3-8b")
    assert r.returncode == 2 and "no CUDA device" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "models" / "gpu.py"), "--out", "/nonexistent"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a CUDA device" in r.stderr
