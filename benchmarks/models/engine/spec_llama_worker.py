#!/usr/bin/env python
"""llama.cpp (llama-cpp-python) on the speculative decoding benchmark's chats, in its own process
(``benchmarks/models/spec_bench.py``).

Reads a JSON job on stdin: ``model`` (GGUF path), ``threads``, ``n_ctx``, ``lookup`` (null: plain decoding, else
``{"num_pred_tokens": K, "max_ngram_size": N}``: llama-cpp-python's ``LlamaPromptLookupDecoding`` draft model, its
prompt lookup decoding), ``eos`` (token ids that end a reply), ``max_tokens`` and ``chats`` (per chat, the prompt
token ids of each turn, computed by the driver with kvkeeper's tokenizer: both engines see the same ids).  Greedy
(temperature 0).  Each turn reuses the common prefix of the previous turn's evaluated tokens (``generate``'s own
prefix match).  Writes one JSON object on stdout: ``turns`` (per turn: ``ttft_s``, ``decode_s`` from the first
to the last token, ``tokens``, ``ids``), ``load_s``.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    job = json.loads(sys.stdin.read())
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = None if job["lookup"] is None else LlamaPromptLookupDecoding(**job["lookup"])
    t0 = time.perf_counter()
    # logits_all with a draft model: llama-cpp-python 0.3.36 turns logits_all on internally for a draft model but
    # sizes its score buffer by the argument (n_batch rows when False), so a verify batch past row 512 of the
    # context failed with "could not broadcast input array" (seen at context position 507 with 9 rows)
    llm = Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                n_threads_batch=job["threads"], draft_model=draft, logits_all=draft is not None, verbose=False)
    res = {"load_s": time.perf_counter() - t0, "version": llama_cpp.__version__, "turns": []}
    eos = set(job["eos"])
    for chat in job["chats"]:
        for ids in chat:
            out, ts = [], []
            t0 = time.perf_counter()
            for tok in llm.generate(list(ids), temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                ts.append(time.perf_counter())
                if tok in eos:
                    break
                out.append(int(tok))
                if len(out) >= job["max_tokens"]:
                    break
            res["turns"].append({"ttft_s": ts[0] - t0, "decode_s": ts[-1] - ts[0], "tokens": len(ts), "ids": out})
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
