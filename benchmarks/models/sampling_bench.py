"""Batched decode with and without logits processors (penalties, biases, a grammar).

16 greedy requests of 64 tokens decoded together on the embedded model, timed after every
request has its first token (decode steps only), best of 3 runs per mode:

* ``plain``: no processors (the fast path: the sampler never touches these rows);
* ``penalties``: presence, frequency and repetition penalties plus a logit bias on every request;
* ``json``: a JSON schema (an object with one free string) on every request (llguidance token masks);
* ``mixed``: half the requests with penalties and a grammar, half without.

Compare the ``plain`` figure across code versions to see what the processor support costs requests
that use none (run it on each tree: ``PYTHONPATH=OLD/src python benchmarks/models/sampling_bench.py --modes plain``).
Writes ``benchmarks/results/sampling_bench/sampling_bench-<config>-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import cpu_model, result_name, write_report  # noqa: E402

from kvkeeper import LLMEngine, SamplingParams


def _params(mode: str, i: int) -> SamplingParams:
    kw: dict = dict(max_tokens=64, ignore_eos=True)
    pen = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logit_bias={28: -5.0})
    if mode == "penalties" or (mode == "mixed" and i % 2 == 0):
        kw.update(pen)
    if mode == "json" or (mode == "mixed" and i % 2 == 0):
        from kvkeeper.sampling.structured import StructuredOutput

        story = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
        kw.update(ignore_eos=False, structured=StructuredOutput("json_schema", story))  # a long string: 64 tokens
    return SamplingParams(**kw)


def decode_rate(eng: LLMEngine, prompts: list[list[int]], mode: str, repeats: int = 3) -> dict:
    """Best decode throughput (tokens/s over all requests) of ``repeats`` runs."""
    best, tokens = 0.0, 0
    for _ in range(repeats):
        seqs = [eng.add_request(p, _params(mode, i)) for i, p in enumerate(prompts)]
        while any(s.num_output_tokens == 0 and not s.finished for s in seqs):
            eng.step()
        n0, t0 = sum(s.num_output_tokens for s in seqs), time.perf_counter()
        eng.run_until_done(seqs)
        n = sum(s.num_output_tokens for s in seqs) - n0
        best, tokens = max(best, n / (time.perf_counter() - t0)), n
    return {"mode": mode, "decode_tok_per_s": round(best, 1), "decoded_tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=["plain", "penalties", "json", "mixed"])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "sampling_bench")
    args = ap.parse_args()
    eng = LLMEngine(validate_every=0)
    prompts = [eng.encode_chat([{"role": "user", "content": f"Write a story about dragon number {i}."}])
               for i in range(16)]
    eng.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    rows = [decode_rate(eng, prompts, m) for m in args.modes]
    setup = f"weights {eng.runner.weight_format}, KV {eng.runner.kv_format.name}"
    md = (f"Batched decode, 16 requests x 64 tokens, SmolLM2-135M ({setup}), {cpu_model()}, best of 3, "
          f"load average {os.getloadavg()[0]:.2f}\n\n"
          "| mode | decode tok/s | tokens decoded |\n|---|---|---|\n"
          + "".join(f"| {r['mode']} | {r['decode_tok_per_s']} | {r['decoded_tokens']} |\n" for r in rows))
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, result_name("sampling_bench"), {"cpu": cpu_model(), "setup": setup, "loadavg_1m": os.getloadavg()[0],
                                              "runs": rows}, md)


if __name__ == "__main__":
    main()
