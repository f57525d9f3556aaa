import json
import os

# KV integrity validators before every engine step in every test: servers the tests start read this at
# their edge (the CLI); in-process engines get it below unless a test sets validate_every itself.
os.environ.setdefault("KVKEEPER_VALIDATE", "1")
# float32 weights (the exact path, the parity reference) for every engine, server and CLI run that does not name a
# --quantization (servers and the CLI read it at their edge, in-process engines below); tests of the quantized
# formats pass theirs (tests/test_quant_engine.py)
os.environ.setdefault("KVKEEPER_QUANTIZATION", "none")

import pytest

from kvkeeper.engine import llm_engine as _llm_engine
from kvkeeper.engine.config import EngineConfig

_engine_init = _llm_engine.LLMEngine.__init__


def _validating_init(self, *args, **kwargs):
    """As the CLI does at its edge: $KVKEEPER_QUANTIZATION is the default weight format, $KVKEEPER_VALIDATE the
    validators' period, unless the test names its own."""
    if "quantization" not in kwargs and not (args and isinstance(args[0], EngineConfig)):
        kwargs["quantization"] = os.environ.get("KVKEEPER_QUANTIZATION") or None
    _engine_init(self, *args, **kwargs)
    if "validate_every" not in kwargs:
        self.validate_every = int(os.environ["KVKEEPER_VALIDATE"])


_llm_engine.LLMEngine.__init__ = _validating_init

from tests.utils.paths import DATA  # noqa: E402


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
