"""Work done once per test run and shared by the pytest-xdist workers of that run.

An expensive reference (transformers' model loaded from the GGUF file, a float32 perplexity over 2,048 tokens) is
the same in every worker; the first worker that needs it computes it and leaves it in the run's base temp dir, the
others read it back, a file lock in between.  Without xdist the folder is the process's own base temp dir, so two
runs (two helpers, two checkouts) never share anything.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock


def run_dir(tmp_path_factory) -> Path:
    """The folder this run's workers share: the parent of a worker's base temp dir under xdist (the ``popen-gwN``
    folders sit in one ``pytest-N`` folder per run), else the base temp dir itself."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def locked(tmp_path_factory, name: str) -> Iterator[Path]:
    """``run_dir / name``, held under its file lock for the ``with`` block (one worker at a time)."""
    path = run_dir(tmp_path_factory) / name
    with FileLock(str(path) + ".lock"):
        yield path


def json_once(tmp_path_factory, name: str, compute: Callable[[], dict]) -> dict:
    """``compute()`` (a JSON-able dict) the first time any worker of the run asks for ``name``, read back after
    that (floats round-trip exactly through JSON)."""
    with locked(tmp_path_factory, name + ".json") as path:
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())
