"""The C++ CPU kernels (``csrc/cpu/*.cpp``, one file per operation): how they are built, found and loaded.

``make setup`` runs ``python -m kvkeeper.kernels.build``, which compiles the sources (every ``csrc/cpu/*.cpp``) with ``torch.utils.cpp_extension`` (g++ and ninja; the kernels
parallelize through their own thread pool, ``csrc/cpu/pool.cpp``, with torch's thread count) into ``src/kvkeeper/kernels/_ext/`` next to a stamp holding one sha256 over every source
and header of ``csrc/cpu``.  :func:`load` imports that
module; when it is missing, stale (a file of csrc/cpu changed since the build), fails to import, or was
:func:`disable`-d (the CLI does so for ``KVKEEPER_CPU_KERNELS=0``), :func:`load` returns None, logs one
warning saying why and how to fix it, and the engine runs the PyTorch paths (weights dequantized to float32, the reference
attention).  Nothing is compiled at run time.

The kernels pick their instruction set at run time (AVX-512 VNNI when the CPU has it, else portable
C++); ``set_isa("generic")`` forces the portable code (tests compare the two).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch  # noqa: F401  (the extension links against libtorch: import torch first)

EXT_NAME = "kvk_cpu"
EXT_DIR = Path(__file__).resolve().parent / "_ext"
SOURCE_DIR = Path(__file__).resolve().parents[3] / "csrc" / "cpu"  # repository checkout (src layout)
STAMP = EXT_DIR / "source.sha256"
# -ffp-contract=off: no multiply-add is fused unless the source says so (_mm512_fmadd_ps), so the decode and prefill
# kernels that must agree bit for bit (csrc/cpu/attention.cpp) round the same way wherever the compiler inlines them
CFLAGS = ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off", "-Wno-unused-function"]

_log = logging.getLogger(__name__)
_module: ModuleType | None = None
_reason: str | None = None
_disabled: str | None = None  # why the kernels must not load (disable())
_tried = False


def sources() -> list[Path]:
    """The C++ files compiled into the module, sorted: every ``csrc/cpu/*.cpp``."""
    return sorted(SOURCE_DIR.glob("*.cpp"))


def _sha() -> str:
    """One sha256 over the names and bytes of every ``.cpp`` and ``.h`` in :data:`SOURCE_DIR`, sorted by name."""
    h = hashlib.sha256()
    for p in sorted([*SOURCE_DIR.glob("*.cpp"), *SOURCE_DIR.glob("*.h")]):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _so_path() -> Path | None:
    for p in sorted(EXT_DIR.glob(f"{EXT_NAME}*.so")):
        return p
    return None


def build(verbose: bool = False) -> Path:
    """Compile :func:`sources` into :data:`EXT_DIR` and write the source stamp; returns the .so path.

    Raises FileNotFoundError when the sources are not there (an installed wheel, not a checkout) and
    RuntimeError (from torch.utils.cpp_extension) when the compiler fails.
    """
    from torch.utils import cpp_extension

    srcs = sources() if SOURCE_DIR.is_dir() else []
    if not srcs:
        raise FileNotFoundError(f"no C++ sources in {SOURCE_DIR}: the kernels build from a kvkeeper checkout "
                                f"(make setup)")
    EXT_DIR.mkdir(parents=True, exist_ok=True)
    # ninja comes with the venv (pip package); cpp_extension looks for it on PATH
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(name=EXT_NAME, sources=[str(p) for p in srcs], build_directory=str(EXT_DIR),
                       extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=verbose)
    STAMP.write_text(_sha() + "\n")
    so = _so_path()
    if so is None:
        raise RuntimeError(f"the build finished but no {EXT_NAME}*.so is in {EXT_DIR}")
    return so


def disable(reason: str) -> None:
    """Never load the kernels in this process (they are process-wide): :func:`load` gives None from now on
    and the engine runs its PyTorch paths.  Call before the first engine is built (``KVKEEPER_CPU_KERNELS=0``
    at the command line does)."""
    global _disabled
    _disabled = reason


def _import() -> ModuleType:
    if _disabled is not None:
        raise ImportError(f"disabled by {_disabled}")
    so = _so_path()
    if so is None:
        raise ImportError(f"not built (no {EXT_NAME}*.so in {EXT_DIR}); run `make setup` "
                          f"(or python -m kvkeeper.kernels.build)")
    if SOURCE_DIR.is_dir():
        built = STAMP.read_text().strip() if STAMP.exists() else ""
        if built != _sha():
            raise ImportError(f"{so.name} is stale (csrc/cpu changed since it was built); run `make setup` "
                              f"(or python -m kvkeeper.kernels.build)")
    loader = importlib.machinery.ExtensionFileLoader(EXT_NAME, str(so))
    spec = importlib.util.spec_from_file_location(EXT_NAME, str(so), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def load() -> ModuleType | None:
    """The kernels module, or None (with one logged warning giving the reason) when it cannot be used."""
    global _module, _reason, _tried
    if not _tried:
        _tried = True
        try:
            _module = _import()
        except Exception as e:  # noqa: BLE001  (ImportError, an undefined symbol after a torch upgrade, ...)
            _reason = f"{type(e).__name__}: {e}"
            _log.warning("kvkeeper CPU kernels unavailable (%s); using the PyTorch paths", _reason)
    return _module


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when the kernels are loaded or not tried yet)."""
    load()
    return _reason


def main(argv=None) -> int:
    """Command line of :mod:`kvkeeper.kernels.build`: build (``--build``) and/or report the kernels."""
    ap = argparse.ArgumentParser(prog="python -m kvkeeper.kernels.build",
                                 description="Build or check kvkeeper's C++ CPU kernels (csrc/cpu/*.cpp).")
    ap.add_argument("--check", action="store_true", help="only report whether the built kernels load")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if not args.check:
        so = build(verbose=args.verbose)
        print(f"built {so}")
    mod = load()
    if mod is None:
        print(f"kvkeeper CPU kernels unavailable: {_reason}", file=sys.stderr)
        return 1
    print(f"kvkeeper CPU kernels: {_so_path()}, ISA {mod.isa()}")
    return 0
