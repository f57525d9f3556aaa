"""The cost of invariant decode attention (issue 26): decode and prefill tok/s with the invariant kernel vs the
previous one (flash-decoding splits), same build, same process, same engine, the two modes interleaved
(``set_invariant_attention`` switches the C++ kernels), plus the exact reuse audit's cost per audited request.

    PYTHONPATH=src .venv/bin/python benchmarks/kv/invariance_cost.py [--rounds 3] [--out benchmarks/results/invariance_cost]

Writes ``invariance_cost-smollm2-135m-<date>.json`` and ``.md`` into benchmarks/results/invariance_cost/ (or --out):
medians over the rounds, the load average at start and end.
Both modes run the same prefill kernel, so prefill should not differ; decode differs by the attention kernel.
Not measured here: the build flag -ffp-contract=off (it applies to both modes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvkeeper import LLMEngine, SamplingParams
from kvkeeper.diagnostics.audit import audit_sequence
from kvkeeper.kernels import cpu as cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import result_path, results_dir  # noqa: E402

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families. ")


def prompt(eng, tokens: int) -> list[int]:
    ids = eng.tokenizer.encode(TEXT * (tokens // 40 + 2))
    return ids[:tokens]


def decode_rate(eng, ids: list[int], new: int, streams: int = 1) -> float:
    """Decode tok/s after the prompt is cached (the prefill of the timed run is a prefix hit but for a block)."""
    p = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    ns = eng.isolated_namespace()
    eng.generate([ids] * streams, SamplingParams(max_tokens=1), namespace=ns)  # warm the prefix cache
    seqs = [eng.add_request(ids, p, namespace=ns) for _ in range(streams)]
    while any(s.num_output_tokens < 1 for s in seqs):  # prefill (and the first token) untimed
        eng.step()
    t0 = time.perf_counter()
    eng.run_until_done(seqs)
    dt = time.perf_counter() - t0
    return sum(s.num_output_tokens - 1 for s in seqs) / dt


def prefill_rate(eng, ids: list[int]) -> float:
    t0 = time.perf_counter()
    eng.generate([ids], SamplingParams(max_tokens=1), namespace=eng.isolated_namespace())
    return len(ids) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(results_dir("invariance_cost")))
    args = ap.parse_args()
    load0 = os.getloadavg()
    eng = LLMEngine(validate_every=0)
    mod = cpu_kernels.load()
    cases = {
        "decode, 1 stream, 128-token context": lambda: decode_rate(eng, prompt(eng, 128), 48),
        "decode, 1 stream, 2048-token context": lambda: decode_rate(eng, prompt(eng, 2048), 32),
        "decode, 8 streams, 512-token context": lambda: decode_rate(eng, prompt(eng, 512), 16, 8),
        "prefill, 1024 tokens": lambda: prefill_rate(eng, prompt(eng, 1024)),
    }
    res = {name: {"invariant": [], "previous": []} for name in cases}
    audit_ms = []
    for r in range(args.rounds):
        for mode in (("invariant", "previous") if r % 2 == 0 else ("previous", "invariant")):
            mod.set_invariant_attention(mode == "invariant")
            for name, f in cases.items():
                res[name][mode].append(f())
        mod.set_invariant_attention(True)
        ids = prompt(eng, 512)
        seq = eng.add_request(ids, SamplingParams(max_tokens=1), namespace=eng.isolated_namespace())
        seq.kv_holder = lambda s: None
        eng.run_until_done([seq])
        rep = audit_sequence(eng, seq)
        eng.kv.free(seq)
        assert rep.ok, rep.summary()
        audit_ms.append(rep.elapsed_ms)
    mod.set_invariant_attention(True)
    rows = []
    for name, v in res.items():
        a, b = statistics.median(v["invariant"]), statistics.median(v["previous"])
        rows.append({"case": name, "invariant_tok_s": a, "previous_tok_s": b, "cost_pct": 100 * (b - a) / b,
                     "invariant_runs": v["invariant"], "previous_runs": v["previous"]})
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "threads": torch.get_num_threads(), "rounds": args.rounds, "load_average_start": load0,
           "load_average_end": os.getloadavg(), "weight_format": eng.runner.weight_format,
           "kv_dtype": str(eng.runner.kv_format.storage), "cases": rows,
           "audit_ms_per_request_512_tokens": statistics.median(audit_ms), "audit_ms_runs": audit_ms}
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    result_path("invariance_cost", out=folder).write_text(json.dumps(out, indent=1))
    md = [f"# Invariant decode attention: cost ({out['date']}, {out['threads']} threads, load average "
          f"{load0[0]:.1f} at start, {out['load_average_end'][0]:.1f} at end; medians of {args.rounds} rounds)", "",
          "| case | invariant tok/s | previous tok/s | cost |", "|---|---:|---:|---:|"]
    md += [f"| {r['case']} | {r['invariant_tok_s']:.1f} | {r['previous_tok_s']:.1f} | {r['cost_pct']:+.1f}% |"
           for r in rows]
    md += ["", f"Exact reuse audit of a 512-token prompt: {out['audit_ms_per_request_512_tokens']:.0f} ms per audited "
           "request (one recompute of the prompt and a bitwise comparison of every layer's K/V and the logits).", ""]
    result_path("invariance_cost", suffix=".md", out=folder).write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
