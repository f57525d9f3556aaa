"""Perplexity of a long text through the engine's own paged KV cache.

The first ``context`` tokens of the text are run as one sequence, prefilled in
chunks of ``chunk`` tokens, each chunk attending to every earlier token as the KV
cache holds it (so KV quantization shows in the result).  Every position but the
first is scored: ``ppl = exp(mean over t of -log p(x_t | x_<t))`` over
``context - 1`` predictions, in float32.  Peak activation memory is bounded by
the chunk (logits of ``chunk`` tokens at a time: chunk x vocab x 4 bytes).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..engine.sampling_params import SamplingParams
from ..engine.sequence import Sequence
from ..errors import InvalidRequestError


def read_text_tokens(engine, path: str | Path, context: int, skip_tokens: int = 0) -> list[int]:
    """Token ids ``[skip_tokens, skip_tokens + context)`` of a UTF-8 text file.

    Raises InvalidRequestError when the file is missing, not UTF-8, or too short (the message gives the numbers).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidRequestError(f"text file {p} does not exist") from None
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"text file {p} is not UTF-8 ({e}); convert it first") from None
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < skip_tokens + context:
        raise InvalidRequestError(f"{p} has {len(ids)} tokens, fewer than the {skip_tokens + context} needed "
                                  f"(--skip-tokens {skip_tokens} + --context {context}); use a longer text or a "
                                  "shorter context")
    return ids[skip_tokens: skip_tokens + context]


@torch.inference_mode()
def perplexity(engine, token_ids: list[int], chunk: int = 512) -> dict:
    """Perplexity of ``token_ids`` (one sequence) through ``engine``'s model and KV cache.

    Returns ``{"ppl", "nll_mean", "tokens", "scored_tokens", "kv_bytes_per_token", "kv_dtype", "seconds"}``.
    Raises InvalidRequestError when the text does not fit the context window or the KV pool.
    """
    n = len(token_ids)
    if n < 2:
        raise InvalidRequestError("perplexity needs at least 2 tokens")
    if n > engine.config.context_length:
        raise InvalidRequestError(f"{n} tokens exceed the model's context window of {engine.config.context_length}")
    seq = Sequence("ppl-eval", list(token_ids), SamplingParams(max_tokens=1), engine.isolated_namespace("ppl"))
    if not engine.kv.allocate(seq, n):
        need = -(-n // engine.block_size)
        raise InvalidRequestError(f"{n} tokens need {need} KV blocks but only {engine.pool.num_free} are free; "
                                  "raise --kv-cache-bytes")
    runner = engine.runner
    targets = torch.tensor(token_ids[1:], dtype=torch.int64)
    nll = torch.zeros((), dtype=torch.float64)
    t0 = time.perf_counter()
    try:
        while seq.num_computed < n:
            m = min(chunk, n - seq.num_computed)
            start = seq.num_computed
            input_ids, positions, meta, _, _ = runner.build_batch([(seq, m)])
            hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
            seq.num_computed += m
            rows = min(m, n - 1 - start)  # the last token of the text predicts nothing
            if rows > 0:
                logits = runner.model.compute_logits(hidden[:rows]).float().cpu()
                lp = torch.log_softmax(logits, dim=-1)
                nll -= lp.gather(1, targets[start: start + rows, None]).sum().double()
    finally:
        engine.kv.free(seq)
    mean = float(nll) / (n - 1)
    return {"ppl": math.exp(mean), "nll_mean": mean, "tokens": n, "scored_tokens": n - 1,
            "kv_bytes_per_token": engine.kv_bytes_per_token, "kv_dtype": runner.kv_format.name,
            "seconds": time.perf_counter() - t0}
