"""Build and load the standalone kquant extension (csrc/cpu/kquant.cpp) for the tests and the benchmark."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "csrc" / "cpu" / "kquant.cpp", ROOT / "csrc" / "cpu" / "kquant_standalone.cpp"]


def load_kquant(build_dir: str | os.PathLike | None = None, verbose: bool = False):
    from torch.utils import cpp_extension

    if build_dir is None:
        build_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvkeeper" / "kquant_build"
    Path(build_dir).mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="kvk_kquant",
        sources=[str(s) for s in SOURCES],
        extra_cflags=["-O3", "-fopenmp", "-std=c++17"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=verbose,
    )
