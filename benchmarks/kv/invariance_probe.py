"""Where does a token's K/V depend on how the work was split?  (issue 26, step 1)

Runs the embedded model on the default path (GGUF blocks in place, bf16 KV) and computes the KV of one prompt
in differently shaped steps: prefilled whole vs in chunks of 1, 7, 16, 512; prefill vs decode of the later
tokens (fused decode step and layer by layer); alone vs in a batch of 9 mixed rows; 1 vs 2 kernel threads.
Each variant's KV dump (kvkeeper.diagnostics.kvdump) is compared bit for bit with the reference (whole prefill,
512-token chunks, 2 threads): the first layer and token that differ and the largest difference.

    PYTHONPATH=src .venv/bin/python benchmarks/kv/invariance_probe.py [--json benchmarks/results/invariance_probe/invariance_probe-smollm2-135m-DATE.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvkeeper import LLMEngine, SamplingParams
from kvkeeper.diagnostics.kvdump import dump_prompt, dump_sequence

TEXT = ("The translator kept a glossary of every term: the contract's 'force majeure' clause, the party called "
        "the Licensee, and the delivery date. Each chapter used the same words, and the reviewers checked that "
        "no synonym crept in between the first page and the last.")


def engine(chunk: int = 512, fused: bool = True, threads: int = 2) -> LLMEngine:
    return LLMEngine(max_num_batched_tokens=chunk, fused_decode=fused, num_threads=threads, validate_every=0)


def first_diff(ref: dict, got: dict, num_layers: int) -> dict:
    """The first layer (then token) whose K or V differs, and the largest absolute difference overall."""
    worst, first = 0.0, None
    for layer in range(num_layers):
        for name in ("k", "v"):
            a, b = ref[f"layers.{layer}.{name}"].float(), got[f"layers.{layer}.{name}"].float()
            d = (a - b).abs()
            worst = max(worst, float(d.max()))
            if first is None and bool((d > 0).any()):
                tok = int((d.flatten(1).amax(1) > 0).nonzero()[0])
                first = {"layer": layer, "tensor": name, "token": tok, "max": float(d.max())}
    return {"identical": first is None, "first": first, "max_abs": worst}


def decoded(eng: LLMEngine, prompt: list[int], n: int, companions: list[list[int]] = ()) -> tuple[dict, list[int]]:
    """KV of prompt + n greedy tokens (the last n-1 of them computed by decode steps), and the tokens."""
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    seq = eng.add_request(prompt, p, namespace=eng.isolated_namespace())
    seq.kv_holder = lambda s: None
    others = [eng.add_request(c, SamplingParams(max_tokens=n + 3, temperature=0.0, ignore_eos=True),
                              namespace=eng.isolated_namespace()) for c in companions]
    eng.run_until_done([seq, *others])
    tensors, _ = dump_sequence(eng, seq)
    ids = list(seq.token_ids[: seq.num_computed])
    eng.kv.free(seq)
    return tensors, ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode-tokens", type=int, default=24)
    args = ap.parse_args()
    ref_eng = engine()
    L = ref_eng.model_config.num_layers
    prompt = ref_eng.encode_chat([{"role": "user", "content": TEXT}])
    others = [ref_eng.encode_chat([{"role": "user", "content": TEXT[i * 17:] + str(i)}]) for i in range(8)]
    res = {"prompt_tokens": len(prompt), "weight_format": ref_eng.runner.weight_format,
           "kv_dtype": ref_eng.runner.kv_format.name, "cases": {}}
    ref, _ = dump_prompt(ref_eng, prompt, namespace=ref_eng.isolated_namespace())
    for chunk in (1, 7, 16):
        e = engine(chunk)
        got, _ = dump_prompt(e, prompt, namespace=e.isolated_namespace())
        res["cases"][f"prefill chunks of {chunk} vs 512"] = first_diff(ref, got, L)
        del e
    torch.set_num_threads(1)
    got, _ = dump_prompt(ref_eng, prompt, namespace=ref_eng.isolated_namespace())
    res["cases"]["prefill 1 thread vs 2"] = first_diff(ref, got, L)
    torch.set_num_threads(2)
    # decode vs prefill: the decode tokens' KV against the same ids prefilled whole
    dec, ids = decoded(ref_eng, prompt, args.decode_tokens)
    pre, _ = dump_prompt(ref_eng, ids, namespace=ref_eng.isolated_namespace())
    res["cases"]["fused decode vs prefill"] = first_diff(pre, dec, L)
    lbl = engine(fused=False)
    dec_l, ids_l = decoded(lbl, prompt, args.decode_tokens)
    res["cases"]["layer-by-layer decode vs prefill"] = first_diff(pre, dec_l, L) if ids_l == ids else {
        "identical": False, "first": "different tokens"}
    res["cases"]["fused vs layer-by-layer decode"] = first_diff(dec, dec_l, L) if ids_l == ids else {
        "identical": False, "first": "different tokens"}
    dec_b, ids_b = decoded(ref_eng, prompt, args.decode_tokens, others)
    res["cases"]["decode in a batch of 9 vs alone"] = first_diff(dec, dec_b, L) if ids_b == ids else {
        "identical": False, "first": "different tokens"}
    torch.set_num_threads(1)
    dec_1, ids_1 = decoded(ref_eng, prompt, args.decode_tokens)
    torch.set_num_threads(2)
    res["cases"]["decode 1 thread vs 2"] = first_diff(dec, dec_1, L) if ids_1 == ids else {
        "identical": False, "first": "different tokens"}
    res["load_average"] = os.getloadavg()
    for k, v in res["cases"].items():
        print(f"{k:40s} {json.dumps(v)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
