"""The peers: transformers (``generate``, a streamer timing each token) and llama.cpp through llama-cpp-python on
the same GGUF file."""

from __future__ import annotations

import time

import torch

from kvkeeper import LLMEngine

from .base import _err


def load_transformers(engine: LLMEngine):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    p = engine.model_path
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    return model, time.perf_counter() - t0


LLAMA_N_CTX = 8192


def load_llama_cpp(engine: LLMEngine):
    """(Llama or None, status string).  Never installs anything (``make bench-llamacpp`` does)."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError as e:
        return None, f"not installed (llama-cpp-python not importable: {e}; run make bench-llamacpp)"
    try:
        n = torch.get_num_threads()
        llm = Llama(model_path=str(engine.model_path), n_ctx=LLAMA_N_CTX, verbose=False, n_threads=n,
                    n_threads_batch=n)
        return llm, (f"llama-cpp-python {llama_cpp.__version__}, n_ctx {LLAMA_N_CTX}, {n} threads, n_batch "
                     f"{llm.n_batch}, same GGUF file, greedy")
    except Exception as e:  # noqa: BLE001
        return None, f"load failed: {_err(e)}"


def llama_cpp_stream(llm, ids: list[int], n: int) -> dict:
    """One streamed greedy completion from a fresh context (no prefix reuse): first-token time (the prefill)
    and decode tok/s = (n-1) / (t_last - t_first), as kvkeeper's."""
    llm.reset()
    ts = []
    t0 = time.perf_counter()
    for _ in llm.create_completion(prompt=list(ids), max_tokens=n, temperature=0.0, stream=True):
        ts.append(time.perf_counter())
    dec = (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else None
    return {"ttft_s": ts[0] - t0 if ts else None, "decode_tok_per_s": dec, "tokens": len(ts),
            "wall_s": time.perf_counter() - t0}


def hf_generate(model, ids: list[int], max_new: int, min_new: int | None = None, streamer=None):
    x = torch.tensor([ids])
    kw = {"min_new_tokens": min_new} if min_new else {}
    with torch.inference_mode():
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=2, streamer=streamer, **kw)


class TimingStreamer:
    """transformers streamer that timestamps each new token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value):
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(now)
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())

    def end(self):
        pass


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
