"""Fixtures of the weight-format tests: the tiny synthetic Q4_K_M GGUF (kvkeeper.weights.synth_gguf), made once."""

from pathlib import Path

import pytest

from kvkeeper.weights import synth_gguf


@pytest.fixture(scope="session")
def synth():
    return synth_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random-weight Q4_K_M llama GGUF (hidden 256, 2 layers, SmolLM2's tokenizer), seed 0."""
    return synth_gguf.write_synthetic_gguf(tmp_path_factory.mktemp("synth") / "tiny-q4_k_m.gguf", "tiny", seed=0)
