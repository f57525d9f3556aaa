"""Fixtures of the weight-format tests: the tiny synthetic Q4_K_M GGUF (benchmarks/synth_gguf.py), made once."""

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
from tests.utils.paths import ROOT

_SYNTH = ROOT / "benchmarks" / "synth_gguf.py"


@functools.lru_cache(maxsize=1)
def load_synth():
    """benchmarks/synth_gguf.py as a module (benchmarks/ is not a package), loaded once per process (its cached
    tokenizer fields with it)."""
    spec = importlib.util.spec_from_file_location("synth_gguf", _SYNTH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("synth_gguf", mod)  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def synth():
    return load_synth()


@pytest.fixture(scope="session")
def tiny_gguf(synth, tmp_path_factory) -> Path:
    """A tiny random-weight Q4_K_M llama GGUF (hidden 256, 2 layers, SmolLM2's tokenizer), seed 0."""
    return synth.write_synthetic_gguf(tmp_path_factory.mktemp("synth") / "tiny-q4_k_m.gguf", "tiny", seed=0)
