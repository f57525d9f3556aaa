"""The book the perplexity tests read, and its float32 perplexity at 2,048 tokens computed once per test run.

tests/unit/kvcache/test_kv_quant.py (int8 KV) and tests/unit/weights/test_quant_engine.py (GGUF weights) both
compare a perplexity with the float32 engine's on the same 2,048 tokens: the float32 figure is computed by the
first of them that runs and shared with the other, in this process or in the other xdist worker
(tests/utils/run_once.py).
"""

from __future__ import annotations

from tests.utils.paths import DATA
from tests.utils.run_once import json_once

BOOK = DATA / "gutenberg_pride_and_prejudice" / "1342-0.txt"


def book_ids_2k(engine) -> list[int]:
    """2,048 token ids of the book after its first 2,000 tokens (``read_text_tokens``)."""
    from kvkeeper.eval.perplexity import read_text_tokens

    return read_text_tokens(engine, BOOK, 2048, skip_tokens=2000)


def float32_perplexity_2k(engine, tmp_path_factory) -> dict:
    """``perplexity(engine, book_ids_2k(engine))`` of the suite's float32 ``engine`` fixture (its result dict), once
    per run: every worker's ``engine`` fixture is the same model, weights and KV format."""
    from kvkeeper.eval.perplexity import perplexity

    assert engine.runner.weight_format == "none" and engine.kv.store.format.name == "float32"
    return json_once(tmp_path_factory, "float32_perplexity_2k", lambda: perplexity(engine, book_ids_2k(engine)))
