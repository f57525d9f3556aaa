import json
import os
from collections import Counter

# The suite's default, read at their edge by the servers and CLI runs the tests start, and by
# tests/utils/engines.py's make_engine for the engines the tests build in process: KV integrity validators before
# every engine step (a test may set validate_every itself).  The weight format is the library's own default (a GGUF
# file's blocks in place, bf16 KV); the tests that compare with float32 values (transformers' logits, fp32 KV dumps)
# name quantization "none", as the session-scoped ``engine`` fixture below does.
os.environ.setdefault("KVKEEPER_VALIDATE", "1")
# Triton's interpreter for the Triton kernels' CPU tests (tests/kernels/test_triton_kernels.py,
# tests/unit/worker/test_gpu_path.py): it must be set before anything imports triton, whichever test file pytest
# collects first (the NVIDIA compile test, tests/kernels/test_triton_compile.py, removes it for its subprocess).
os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP threads that wait for work sleep instead of spinning, in the workers and in every process they start: the
# suite always runs beside other busy processes (its other worker, servers), and a spinning thread burns the time
# slice another process needed.  Measured on the 2-core AMD EPYC (2026-12-07, a 2-thread engine, three 24-token
# generations of a 400-token prompt): beside one busy loop, 14.5 s wall and 17.0 s CPU spinning, 10.0 s and 10.3 s
# passive; alone, 7.7 s and 11.2 s spinning, 8.9 s and 12.0 s passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The servers, CLI runs and Ray workers the tests start each import kvkeeper, torch and the rest;
# where the environment says PYTHONDONTWRITEBYTECODE (this machine's does), each recompiled every module it
# imported that had no bytecode yet: ~0.8 s of CPU a process on the 2-core AMD EPYC (`import kvkeeper.api.app`:
# 3.2 s user without bytecode, 2.4 s with).  Their bytecode goes to a folder of the suite's own instead, never
# into the source tree.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    import tempfile

    _pycache = os.path.join(tempfile.gettempdir(), f"kvkeeper-tests-pycache-{os.getuid()}")
    os.environ.setdefault("PYTHONPYCACHEPREFIX", _pycache)

import gc  # noqa: E402

import pytest  # noqa: E402

from kvkeeper.weights.heap import release_free_heap  # noqa: E402
from tests.utils.engines import make_engine, worker_threads  # noqa: E402
from tests.utils.paths import DATA  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist (``-n N``), each worker's torch threads (which the C++ kernels' pool takes too:
    ``torch.set_num_threads``) are its share of the CPUs, at least 1; a test that needs more sets them itself.

    N workers each running one thread per CPU oversubscribe the CPUs N times, and every parallel region (a matmul,
    a kernel call) then waits for whichever of its threads lost its core.  Measured on the 2-core AMD EPYC at load
    4.6-5 (2026-12-07): four real-model generations of 12 tokens took 12.1 s and 15.4 s on 2 threads, 3.5 s and
    5.0 s on 1.  Engines built in the worker keep the count (``kvkeeper.worker.cpu_threads.choose_threads`` never
    raises a program's own setting); servers the tests start are other processes and choose their own.
    """
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers > 1:
        import torch

        torch.set_num_threads(worker_threads(workers))
    if hasattr(config.option, "loadscopereorder"):  # xdist keeps the order pytest_collection_modifyitems leaves
        config.option.loadscopereorder = False


# The longest test files, longest first (wall seconds in a full run of `make test` on the 2-core AMD EPYC, three
# workers, 2026-12-08: 109 s down to 30 s, 1,795 s of the 2,589 s all files took).  `--dist loadfile` hands files out
# in this order, so that the run ends on short files: in xdist's own order (most tests first) the one-test files of
# the Ray cluster, the soak and the Triton compile came last, and the CPUs were half idle for the run's last 150 s
# (a sampler of /proc/stat beside it).  The order changes how long the run takes, never what a test checks; a file
# missing here (a new one) runs after these.
LONGEST_FILES = (
    "tests/models/test_gemma3.py", "tests/agents/test_agents.py", "tests/models/test_qwen3_parity.py",
    "tests/e2e/test_cluster_serve.py", "tests/unit/engine/test_invariance.py", "tests/unit/engine/test_engine_real.py",
    "tests/api/test_cache_retention.py", "tests/unit/weights/test_quant_engine.py", "tests/api/test_openai_client.py",
    "tests/api/test_context_server.py", "tests/e2e/test_soak.py", "tests/unit/eval/test_eval_memory.py",
    "tests/e2e/test_cluster_exact.py", "tests/api/test_request_fields.py", "tests/e2e/test_cli_processes.py",
    "tests/models/test_lora.py", "tests/api/test_real_clients.py", "tests/unit/kvcache/test_kv_quant.py",
    "tests/unit/sessions/test_context.py", "tests/e2e/test_cli.py", "tests/e2e/test_breaker_server.py",
    "tests/api/test_hostile_input.py", "tests/unit/diagnostics/test_audit.py", "tests/api/test_reclaim_server.py",
    "tests/e2e/test_eval_terms_engine.py", "tests/models/test_phi3_parity.py", "tests/kernels/test_triton_compile.py",
    "tests/api/test_anthropic_messages.py", "tests/unit/engine/test_speculative.py", "tests/e2e/test_fresh_process.py",
    "tests/kernels/test_triton_kernels.py",
)


def pytest_collection_modifyitems(config, items):
    """Test files in the order ``--dist loadfile`` hands them out: LONGEST_FILES, then the others by their number of
    tests, most first (xdist's own order, turned off in pytest_configure); a file's tests keep their order."""
    files = [item.nodeid.split("::")[0] for item in items]
    count = Counter(files)
    first_seen = {f: i for i, f in reversed(list(enumerate(files)))}
    rank = {f: i for i, f in enumerate(LONGEST_FILES)}
    key = {id(item): (rank.get(f, len(LONGEST_FILES)), -count[f], first_seen[f]) for item, f in zip(items, files)}
    items.sort(key=lambda item: key[id(item)])


@pytest.fixture(scope="module", autouse=True)
def _free_the_modules_engines():
    """After each test file: a full garbage collection and the C heap's free pages back to the OS.

    An engine holds reference cycles, so one that a module fixture dropped stays alive (weights, KV cache: about
    1 GB for the embedded model on 256 blocks) until the collector's next full pass, which with the many long-lived
    objects of torch and transformers comes rarely: an xdist worker went on holding the dead engines of earlier
    files (5-7 GB resident).  Measured on one engine: 1,576 MB resident after it was dropped, 549 MB after
    ``gc.collect()``, 264 MB after ``malloc_trim`` (:func:`kvkeeper.weights.heap.release_free_heap`).
    """
    yield
    gc.collect()
    release_free_heap()


@pytest.fixture(scope="session")
def mt_bench():
    """MT-Bench questions (data/mt_bench/question.jsonl, Apache-2.0, lm-sys/FastChat)."""
    return [json.loads(line) for line in (DATA / "mt_bench" / "question.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def engine():
    """The embedded SmolLM2-135M-Instruct, float32 weights (the exact path, the parity reference), on a 1 GiB
    fp32 paged KV cache; the validators run every $KVKEEPER_VALIDATE steps (tests/utils/engines.py)."""
    return make_engine(quantization="none")


@pytest.fixture(scope="session")
def hf_reference(engine, tmp_path_factory):
    """transformers' own model for the same GGUF file (its own dequantisation), fp32: the reference.

    transformers reads a GGUF file slowly (20-35 s of CPU: its reader walks the file's 49,152-token vocabulary and
    merges in Python, twice, and it builds the tensor-name map once per module): under xdist the first worker that
    needs the reference loads it from the GGUF file and pickles the loaded model (transformers will not
    ``save_pretrained`` a model it read from GGUF) into the run's shared temp dir, and the other worker unpickles
    that copy: the same modules and tensors (tests/utils/run_once.py).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from tests.utils.run_once import locked

    transformers.logging.set_verbosity_error()
    p = engine.model_path
    with locked(tmp_path_factory, "hf_reference.pt") as saved:
        if saved.exists():
            return torch.load(saved, weights_only=False).eval()
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
        if os.environ.get("PYTEST_XDIST_WORKER"):  # the other worker may need it too: leave it the copy
            torch.save(model, saved)
        return model
