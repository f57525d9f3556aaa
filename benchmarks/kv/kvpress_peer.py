#!/usr/bin/env python
"""NVIDIA kvpress as a peer: its presses on the same model, token ids and ratios as kvkeeper's policies.

Runs in its own virtual environment (kvpress 0.5.5 needs transformers < 5.3; kvkeeper uses a newer
one), started by ``benchmarks/kv/kv_bench.py --kvpress-python PY``:

    PY benchmarks/kv/kvpress_peer.py JOB.json OUT.json

JOB.json: ``{"model": HF folder, "presses": [[policy, ratio], ...], "ppl": {"ids": [...], "score_tokens": M},
"passkey": [{"ids": [...], "key": N, "length": L, "depth": d}], "max_tokens": 8}``.  The prompts are
kvkeeper's token ids, so both sides see exactly the same input.  Protocols mirror kvkeeper's:

* perplexity: the context (all but the last M tokens) is prefilled under the press, which compresses
  the cache; the M continuation tokens are then scored over the compressed cache, the first of them
  from the context's last position;
* passkey: the whole prompt is prefilled under the press, then greedy decoding continues outside it
  over the compressed cache with the original positions.

Press names: streaming_llm -> StreamingLLMPress(n_sink=4); snapkv -> SnapKVPress(window_size=64,
kernel_size=5); knorm -> KnormPress; h2o -> ObservedAttentionPress (kvpress has no press named H2O; this
one scores keys by the attention they received during prefill, without H2O's recent window; it needs
eager attention).
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch


def make_press(kvpress, policy: str, ratio: float):
    if policy == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4)
    if policy == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5)
    if policy == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if policy == "h2o":
        return kvpress.ObservedAttentionPress(compression_ratio=ratio)
    raise ValueError(policy)


@torch.inference_mode()
def prefill(model, ids: list[int], press):
    from transformers import DynamicCache

    cache = DynamicCache()
    x = torch.tensor([ids])
    if press is None:
        out = model(x, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            out = model(x, past_key_values=cache, use_cache=True, output_attentions=press.__class__.__name__ == "ObservedAttentionPress")
    return out.logits[0, -1].float(), cache


@torch.inference_mode()
def continuation_nll(model, ids: list[int], score_tokens: int, press) -> tuple[float, int]:
    ctx = len(ids) - score_tokens
    last, cache = prefill(model, ids[:ctx], press)
    kept = cache.get_seq_length()
    nll = -torch.log_softmax(last, -1)[ids[ctx]].item()
    x = torch.tensor([ids[ctx:-1]])
    n = x.shape[1]
    out = model(x, past_key_values=cache, use_cache=True, position_ids=torch.arange(ctx, ctx + n)[None],
                cache_position=torch.arange(kept, kept + n),
                attention_mask=torch.ones(1, kept + n, dtype=torch.long))
    lp = torch.log_softmax(out.logits[0].float(), -1)
    nll -= lp.gather(1, torch.tensor(ids[ctx + 1:])[:, None]).sum().item()
    return nll / score_tokens, kept


@torch.inference_mode()
def greedy(model, ids: list[int], press, max_tokens: int) -> list[int]:
    last, cache = prefill(model, ids, press)
    kept = cache.get_seq_length()
    toks = [int(last.argmax())]
    for step in range(max_tokens - 1):
        out = model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[len(ids) + step]]), cache_position=torch.tensor([kept + step]),
                    attention_mask=torch.ones(1, kept + step + 1, dtype=torch.long))
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


def main() -> int:
    job = json.load(open(sys.argv[1]))
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(job.get("threads", 2))
    tok = AutoTokenizer.from_pretrained(job["model"])
    models = {}

    def model_for(policy):
        impl = "eager" if policy == "h2o" else "sdpa"
        if impl not in models:
            models[impl] = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                                attn_implementation=impl).eval()
        return models[impl]

    results = []
    for policy, ratio in job["presses"]:
        press = make_press(kvpress, policy, ratio) if ratio > 0 else None
        m = model_for(policy)
        from importlib.metadata import version

        r = {"policy": policy, "ratio": ratio, "kvpress_version": version("kvpress")}
        t0 = time.perf_counter()
        if job.get("ppl"):
            nll, kept = continuation_nll(m, job["ppl"]["ids"], job["ppl"]["score_tokens"], press)
            r.update(ppl=math.exp(nll), nll_mean=nll, kv_tokens=kept)
        if job.get("passkey"):
            solved = 0
            for p in job["passkey"]:
                text = tok.decode(greedy(m, p["ids"], press, job.get("max_tokens", 8)))
                digits = "".join(ch for ch in text.split(".")[0] if ch.isdigit())[:5]
                solved += int(digits == str(p["key"]))
            r.update(passkey_accuracy=solved / len(job["passkey"]), passkey_trials=len(job["passkey"]))
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        print(json.dumps(r), flush=True)
    json.dump(results, open(sys.argv[2], "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
