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

from ..sampling.params import SamplingParams
from ..engine.sequence import Sequence
from ..errors import InvalidRequestError
from ..progress import track
from ..engine.handle import EngineHandle


def read_text_tokens(engine: EngineHandle, path: str | Path, context: int, skip_tokens: int = 0) -> list[int]:
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


def _chunks(n: int, chunk: int) -> list[int]:
    """Sizes of the prefill chunks of ``n`` tokens, ``chunk`` at most each."""
    return [min(chunk, n - k) for k in range(0, n, chunk)]


def _run_chunks(engine: EngineHandle, seq, upto: int, chunk: int, targets: torch.Tensor, score_from: int) -> tuple[float, int]:
    """Prefill seq's tokens up to index ``upto`` in chunks; sum -log p of targets[t] for positions t >= score_from."""
    nll, scored = 0.0, 0
    hybrid = not engine.kv.store.uniform  # window blocks are taken per chunk and given back past it
    for i, m in enumerate(track(_chunks(upto - seq.num_computed, chunk), "perplexity (prefill chunks)")):
        n = m if hybrid else upto - seq.num_computed
        if (hybrid or i == 0) and not engine.kv.allocate(seq, n):
            raise InvalidRequestError(f"{n} more tokens do not fit the {engine.kv.num_free_blocks} free KV blocks; "
                                      "raise --kv-cache-bytes")
        start = seq.num_computed
        a = max(start, score_from)
        b = min(start + m, len(targets))
        logits = engine.kv.write_outside_scheduler(seq, m, "prompt" if b > a else "none")  # (m, vocab)
        seq.num_computed += m
        if hybrid:
            engine.kv.release_out_of_window(seq)
        if b > a:
            lp = torch.log_softmax(logits[a - start: b - start].float().cpu(), dim=-1)
            nll -= float(lp.gather(1, targets[a:b, None]).sum().double())
            scored += b - a
    return nll, scored


@torch.inference_mode()
def perplexity(engine: EngineHandle, token_ids: list[int], chunk: int = 512, compression=None,
               score_tokens: int | None = None) -> dict:
    """Perplexity of ``token_ids`` (one sequence) through ``engine``'s model and KV cache.

    Without ``score_tokens``: every position but the first is scored (``len - 1`` predictions).
    With ``score_tokens = M``: the first ``len - M`` tokens are the context, prefilled and then
    compressed by ``compression`` (a :class:`~kvkeeper.kvcache.compression.KVCompression`, or None
    for the uncompressed baseline); the last M tokens are scored with that cache, as a continuation
    (the first of them is predicted from the context's last position, before compression).

    Returns ``{"ppl", "nll_mean", "tokens", "scored_tokens", "kv_tokens", "kv_bytes_per_token",
    "kv_dtype", "policy", "ratio", "seconds"}``; ``kv_tokens`` is the context's KV length after compression.
    Raises InvalidRequestError when the text does not fit the context window or the KV pool.
    """
    n = len(token_ids)
    if n < 2:
        raise InvalidRequestError("perplexity needs at least 2 tokens")
    if n > engine.model_config.context_length:
        raise InvalidRequestError(f"{n} tokens exceed the model's context window of {engine.model_config.context_length}")
    if score_tokens is not None and not (1 <= score_tokens < n):
        raise InvalidRequestError(f"score_tokens must be between 1 and {n - 1}, got {score_tokens}")
    if compression is not None and score_tokens is None:
        raise InvalidRequestError("a compression policy needs score_tokens: the tokens scored after the compressed context")
    from ..kvcache.compression import PrefillObserver

    seq = Sequence("ppl-eval", list(token_ids), SamplingParams(max_tokens=1), engine.isolated_namespace("ppl"))
    targets = torch.tensor(token_ids[1:], dtype=torch.int64)
    ctx = n if score_tokens is None else n - score_tokens
    t0 = time.perf_counter()
    try:
        if score_tokens is None:
            nll, scored = _run_chunks(engine, seq, n, chunk, targets, 0)
            kv_tokens = n
        else:
            if compression is not None:
                seq.compression = compression
                mc = engine.model_config
                seq.observer = PrefillObserver(compression, ctx, mc.num_layers, mc.num_kv_heads)
            nll, scored = _run_chunks(engine, seq, ctx, chunk, targets, ctx - 1)
            if compression is not None:
                engine.kv.compress_prompt(seq)
            kv_tokens = ctx - seq.kv_offset
            more, k = _run_chunks(engine, seq, n - 1, chunk, targets, ctx)  # the last token predicts nothing
            nll, scored = nll + more, scored + k
    finally:
        engine.kv.free(seq)
    mean = nll / scored
    return {"ppl": math.exp(mean), "nll_mean": mean, "tokens": n, "scored_tokens": scored, "kv_tokens": kv_tokens,
            "kv_bytes_per_token": engine.kv.bytes_per_token, "kv_dtype": engine.kv.store.format.name,
            "policy": compression.policy if compression is not None else None,
            "ratio": compression.ratio if compression is not None else 0.0, "seconds": time.perf_counter() - t0}
