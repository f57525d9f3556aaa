"""The C++ CPU kernels module for the kernel tests: loaded, or the test skips locally and fails under CI (CI=true),
since CI must build them (``make setup``)."""

import os

import pytest

from kvkeeper.kernels import cpu as cpu_kernels


def kernels_or_skip():
    """The loaded module (:func:`kvkeeper.kernels.cpu.load`); pytest.skip / pytest.fail when it is unavailable."""
    mod = cpu_kernels.load()
    if mod is None:
        msg = f"C++ CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"
        if os.environ.get("CI"):
            pytest.fail(msg + " (CI must build them: make setup)")
        pytest.skip(msg)
    return mod
