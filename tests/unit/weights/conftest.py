"""Fixtures of the weight-format tests: the tiny synthetic Q4_K_M GGUF (kvkeeper.weights.synth_gguf), made once."""

import shutil
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


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny file's tokenizer as kvkeeper's cache keeps it (``tokenizers/<key>``), converted once: transformers'
    conversion of a GGUF tokenizer costs about 8 s of CPU, which every test with a cache of its own paid again."""
    from kvkeeper.text.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer-cache")
    load_tokenizer(tiny_gguf, folder)
    return folder / "tokenizers"


@pytest.fixture
def tiny_cache(tmp_path, tiny_tokenizer) -> Path:
    """A fresh kvkeeper cache folder for one test (no packed or dequantized weights yet) holding the tiny file's
    converted tokenizer."""
    folder = tmp_path / "cache"
    shutil.copytree(tiny_tokenizer, folder / "tokenizers")
    return folder
