import json
import os
from pathlib import Path

# KV integrity validators before every engine step in every test (and in servers the tests start)
os.environ.setdefault("KVKEEPER_VALIDATE", "1")
# float32 weights (the exact path, the parity reference) for every engine, server and CLI run that does not name a
# --quantization; tests of the quantized formats pass theirs (tests/test_quant_engine.py)
os.environ.setdefault("KVKEEPER_QUANTIZATION", "none")

import pytest

DATA = Path(__file__).resolve().parent.parent / "data"


@pytest.fixture(scope="session")
def mt_bench():
    """MT-Bench questions (data/mt_bench/question.jsonl, Apache-2.0, lm-sys/FastChat)."""
    return [json.loads(line) for line in (DATA / "mt_bench" / "question.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def engine():
    """The embedded SmolLM2-135M-Instruct, float32 weights (the exact path, the parity reference), on a 1 GiB
    fp32 paged KV cache."""
    from kvkeeper import LLMEngine

    return LLMEngine(quantization="none")


@pytest.fixture(scope="session")
def hf_reference(engine):
    """transformers' own model for the same GGUF file (its own dequantisation), fp32: the reference."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    p = engine.model_path
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
