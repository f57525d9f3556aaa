#!/usr/bin/env python
"""One engine on one GGUF file in its own process, for the files section (``benchmarks/models/files_bench.py``).

Reads a JSON job on stdin: ``engine`` ("kvkeeper" or "llama_cpp"), ``model`` (GGUF path), ``threads``,
``kv_tokens`` (KV size in tokens, the same for both engines), ``tasks`` (a list of "decode", "prefill",
"turns"), the token ids of each task (computed once by the driver with kvkeeper's tokenizer, so both engines
see the same input): ``chat_ids`` (a short chat prompt), ``long_ids`` (the long prefill), ``turn_ids`` (the
prompt of each turn of the conversation, each a prefix of the next), and the counts ``decode_tokens``,
``after_long_tokens``; ``cache_dir`` (kvkeeper's cache folder).  Writes one JSON object on stdout:

* ``load_s``: the engine's constructor (seconds); ``ready_wall``: ``time.time()`` when it returned (the
  driver subtracts its own spawn time: process start to ready, imports included);
* ``rss_after_load_mb``, ``peak_rss_mb`` (``VmHWM`` at the end of all tasks), MB = 1e6 bytes;
* ``decode_tok_s``: greedy decode after ``chat_ids`` ((n - 1) tokens over the time from the first to the last
  token, end-of-sequence ignored); ``prefill_tok_s`` / ``prefill_s`` on ``long_ids`` (time to the first token
  from an empty cache) and ``decode_after_long_tok_s``; ``turn_ttft_s``: the time to the first token of each turn,
  each engine reusing its own cache of the previous turn's prompt (kvkeeper: prefix cache; llama.cpp: the common
  prefix with its last evaluated tokens).
"""

from __future__ import annotations

import json
import sys
import time


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def _peak_mb() -> float:
    """The process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited across exec), MB."""
    return _status_mb("VmHWM")


def _rss_mb() -> float:
    return _status_mb("VmRSS")


class KvkeeperRun:
    def __init__(self, job: dict):
        import torch

        torch.set_num_threads(job["threads"])
        from kvkeeper import LLMEngine, SamplingParams

        self.SP = SamplingParams
        t0 = time.perf_counter()
        self.engine = LLMEngine(job["model"], max_model_len=job["kv_tokens"], cache_dir=job.get("cache_dir"),
                                num_kv_blocks=-(-job["kv_tokens"] // 16), num_threads=job["threads"])
        self.load_s = time.perf_counter() - t0
        self.describe = self.engine.runner.weight_description

    def _gen(self, ids, n, ns=None):
        kw = {} if ns is None else {"namespace": ns}
        return self.engine.generate([list(ids)], self.SP(max_tokens=n, temperature=0.0, ignore_eos=True), **kw)[0]

    def fresh(self, tag):
        return self.engine.isolated_namespace(tag)

    def stream(self, ids, n, tag) -> tuple[float, float | None]:
        """(time to first token, decode tok/s) from an empty cache."""
        out = self._gen(ids, n, self.fresh(tag))
        return out.ttft_s, out.decode_tok_per_s

    def turn(self, ids, ns) -> float:
        return self._gen(ids, 1, ns).ttft_s


class LlamaCppRun:
    def __init__(self, job: dict):
        import llama_cpp
        from llama_cpp import Llama

        t0 = time.perf_counter()
        self.llm = Llama(model_path=job["model"], n_ctx=job["kv_tokens"], n_threads=job["threads"],
                         n_threads_batch=job["threads"], verbose=False)
        self.load_s = time.perf_counter() - t0
        self.describe = f"llama-cpp-python {llama_cpp.__version__}, n_ctx {job['kv_tokens']}, n_batch {self.llm.n_batch}"

    def stream(self, ids, n, tag) -> tuple[float, float | None]:
        self.llm.reset()
        ts = []
        t0 = time.perf_counter()
        for _tok in self.llm.generate(list(ids), temp=0.0, top_k=1, reset=True):  # no stop at end-of-sequence
            ts.append(time.perf_counter())
            if len(ts) >= n:
                break
        dec = (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 else None
        return ts[0] - t0, dec

    def turn(self, ids, ns) -> float:
        t0 = time.perf_counter()
        # reset=True is what reuses: generate() keeps the longest common prefix of its evaluated tokens
        for _tok in self.llm.generate(list(ids), temp=0.0, top_k=1, reset=True):
            break
        return time.perf_counter() - t0


def main() -> int:
    job = json.loads(sys.stdin.read())
    run = (KvkeeperRun if job["engine"] == "kvkeeper" else LlamaCppRun)(job)
    res = {"engine": job["engine"], "load_s": run.load_s, "ready_wall": time.time(), "weights": run.describe,
           "rss_after_load_mb": _rss_mb()}
    tasks = job.get("tasks", [])
    if "decode" in tasks:
        run.stream(job["chat_ids"], 4, "warm")  # warm-up
        ttft, dec = run.stream(job["chat_ids"], job["decode_tokens"], "decode")
        res.update(chat_ttft_s=ttft, decode_tok_s=dec)
    if "prefill" in tasks:
        ids = job["long_ids"]
        ttft, dec = run.stream(ids, job["after_long_tokens"], "long")
        res.update(prefill_tokens=len(ids), prefill_s=ttft, prefill_tok_s=len(ids) / ttft, decode_after_long_tok_s=dec)
    if "turns" in tasks:
        ns = run.fresh("turns") if job["engine"] == "kvkeeper" else None
        if job["engine"] != "kvkeeper":
            run.llm.reset()
        res["turn_ttft_s"] = [run.turn(ids, ns) for ids in job["turn_ids"]]
        res["turn_prompt_tokens"] = [len(ids) for ids in job["turn_ids"]]
    res["peak_rss_mb"] = _peak_mb()
    res["rss_end_mb"] = _rss_mb()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
