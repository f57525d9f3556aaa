"""Recall of early facts under each context policy and budget (``kvkeeper eval memory``), one engine for all runs.

Generates the conversations (``kvkeeper eval memory-data``'s generator: seed, count and length below) from
``data/topical_chat/test_freq_conversations.jsonl``, then replays them under each (policy, budget) in RUNS order
and rewrites ``benchmarks/results/context_memory/context_memory-<config>-<date>.json`` (figures per run, no prompts) and ``.md`` (the table)
after each run, so a cut-short run still leaves the runs it finished.  The per-question records (prompts
included) go to ``--records DIR``.

    python benchmarks/kv/context_memory.py [--conversations 20] [--min-tokens 6000] [--only hybrid:2048 last:2048]
        [--harder] [--model gemma-3-270m] [--low-water F] [--top-k K] [--out PATH]
        # --harder: facts said in passing, paraphrases, corrections, distractors; --model: another installed model
        # (the conversations are generated with that model's tokenizer); --low-water: SessionConfig.context_low_water;
        # --top-k: SessionConfig.memory_top_k (sentences in the memory block, default 8)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # common

from kvkeeper import LLMEngine  # noqa: E402
from kvkeeper.eval.memory_recall import LibraryBackend, generate, load_dialogues, run  # noqa: E402

SOURCE = ROOT / "data" / "topical_chat" / "test_freq_conversations.jsonl"
RUNS = ["hybrid:2048", "last:2048", "memory:2048", "summary:2048", "full:0", "hybrid:1024", "last:1024",
        "memory:1024", "summary:1024"]
FIGS = ["turns", "answer_in_prompt", "evidence_in_prompt", "answer_in_reply", "mean_prompt_tokens", "cached_share",
        "cached_share_questions", "memory_ms_per_turn", "summary_ms_per_turn", "seconds"]


def table(results: list[dict], meta: dict) -> str:
    lines = [f"Recall of planted facts ({meta.get('set', 'easy')} set): {meta['conversations']} conversations of >= {meta['min_tokens']} tokens "
             f"(mean {meta['mean_tokens']:.0f}), {meta['questions']} questions, seed {meta['seed']}; "
             f"{meta['model']} ({meta['weights']}), greedy, {meta['max_tokens']} tokens per answer, "
             f"context every {meta['every']}, memory top k {meta.get('top_k', 8)}, low water {meta.get('low_water') or 'the policy default'}, replay "
             f"{meta['replay']}; {meta['machine']}; load average {meta['load_average_start']:.1f} at the start.", "",
             "| policy | budget | answer in prompt | evidence in prompt | answer in reply | mean question prompt "
             "tokens | cached share (all prompts) | cached share (questions) | memory ms/request | summary ms/request | "
             "seconds | load average |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r['budget'] or '-'} | {r['answer_in_prompt']:.2f} | "
                     f"{r['evidence_in_prompt']:.2f} | {r['answer_in_reply']:.2f} | {r['mean_prompt_tokens']:.0f} | "
                     f"{r['cached_share']:.2f} | {r['cached_share_questions']:.2f} | {r['memory_ms_per_turn']:.0f} | "
                     f"{r.get('summary_ms_per_turn', 0.0):.0f} | "
                     f"{r['seconds']:.0f} | {r.get('load_average', float('nan')):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--min-tokens", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--only", nargs="+", default=RUNS, metavar="POLICY:BUDGET")
    from common import result_path

    ap.add_argument("--out", default=str(result_path("context_memory", suffix="")), help="OUT.json and OUT.md")
    ap.add_argument("--records", default=None, metavar="DIR")
    ap.add_argument("--replay", choices=("turns", "questions"), default="turns")
    ap.add_argument("--harder", action="store_true", help="the harder set (`kvkeeper eval memory-data --harder`)")
    ap.add_argument("--model", default=None, help="the model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--low-water", type=float, default=None, metavar="F",
                    help="the sessions' context_low_water (default: the policy's)")
    ap.add_argument("--top-k", type=int, default=8, metavar="K", help="the sessions' memory_top_k (default: 8)")
    args = ap.parse_args()
    eng = LLMEngine(args.model) if args.model else LLMEngine()
    count = lambda t: len(eng.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    convs = generate(load_dialogues(SOURCE), args.conversations, args.min_tokens, count, args.seed,
                     harder=args.harder)
    toks = [len(eng.encode_chat(c["messages"])) for c in convs]
    meta = {"conversations": len(convs), "min_tokens": args.min_tokens, "mean_tokens": sum(toks) / len(toks),
            "min_chat_tokens": min(toks), "questions": sum(len(c["questions"]) for c in convs), "seed": args.seed,
            "model": eng.model_name, "weights": eng.runner.weight_description, "max_tokens": args.max_tokens,
            "every": args.every, "low_water": args.low_water, "top_k": args.top_k, "replay": args.replay,
            "set": "harder" if args.harder else "easy",
            "load_average_start": os.getloadavg()[0], "machine": f"{platform.machine()}, 2 cores shared with other jobs"}
    results = []
    for spec in args.only:
        policy, budget = spec.split(":")
        b = int(budget) or None
        t0 = time.perf_counter()
        backend = LibraryBackend(eng, policy, b or 16, args.max_tokens, context_every=args.every,
                                 context_low_water=args.low_water, memory_top_k=args.top_k)
        r = run(convs, backend, policy, b, replay=args.replay)
        per, turns = r.pop("per_question"), r.pop("per_turn")
        if args.records:
            Path(args.records).mkdir(parents=True, exist_ok=True)
            Path(args.records, f"{policy}_{budget}.json").write_text(json.dumps({**r, "per_question": per, "per_turn": turns}))
        results.append({k: r[k] for k in ("policy", "budget", "questions", *FIGS)} | {"load_average": os.getloadavg()[0]})
        print(f"{spec}: {json.dumps(results[-1])} ({time.perf_counter() - t0:.0f} s)", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
        Path(args.out + ".md").write_text(table(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
