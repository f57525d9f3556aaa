"""The Triton kernels compile for real NVIDIA targets (sm_90: H100/H200; sm_80: A100) without a GPU,
through Triton's NVIDIA backend and its bundled ptxas: catches what the interpreter cannot (tl.dot
shape limits, dtype rules, shared-memory use, fp8 support)."""

import subprocess
import sys

import pytest
from tests.utils.paths import ROOT

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

SCRIPT = ROOT / "tests" / "utils" / "triton_aot.py"


@pytest.mark.parametrize("arch", [90])
def test_kernels_compile_for_nvidia_target(arch, tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # really compile, no cached cubins
    r = subprocess.run([sys.executable, str(SCRIPT), str(arch)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    done = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("ok ")]
    assert len(done) == 14 and {"decode/fp8", "extend/int8", "reduce", "store/fp8-bytes"} <= set(done)
    for line in r.stdout.splitlines():  # every variant fits in sm_90's 227 KB of shared memory per block
        assert int(line.split("shared=")[1]) <= 227 * 1024
