"""Terminology and consistency of the embedded model on the WMT21 EN-FR dev documents, under glossary
conditions and cache settings: the table of the README's "Terminology consistency across turns".

Each row is one ``kvkeeper eval terms generate`` run (its own process, ``--out RUNS/<name>``); the table is
built from their ``scores.json``.  ``--collect`` only rebuilds the table from runs already there.

Usage: python benchmarks/eval/terms_bench.py [--runs DIR] [--max-segments 10] [--max-tokens 64] [--collect]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # common
RUNS = {  # name: (extra arguments, conditions shown)
    "reuse": (["--conditions", "none", "glossary", "random"], ["none", "glossary", "random"]),
    "noreuse": (["--conditions", "glossary", "--no-reuse"], ["glossary"]),
    "int8": (["--conditions", "glossary", "--kv-dtype", "int8"], ["glossary"]),
    "snapkv": (["--conditions", "glossary", "--policy", "snapkv", "--ratio", "0.5"], ["glossary"]),
    "exact_reuse": (["--conditions", "glossary", "--quantization", "none", "--kv-dtype", "fp32"], ["glossary"]),
    "exact_noreuse": (["--conditions", "glossary", "--quantization", "none", "--kv-dtype", "fp32", "--no-reuse"],
                      ["glossary"]),
}
LABELS = {"reuse": "reuse on", "noreuse": "reuse off", "int8": "int8 KV, reuse on", "snapkv": "snapkv 0.5, reuse on",
          "exact_reuse": "exact path (fp32), reuse on", "exact_noreuse": "exact path (fp32), reuse off"}
COLS = (("term_accuracy", 100), ("window_overlap_2", 100), ("window_overlap_3", 100), ("one_minus_term", 100),
        ("bleu", 1), ("chrf", 1), ("consistency", 100))


def run(runs: Path, max_segments: int, max_tokens: int) -> None:
    for name, (extra, _) in RUNS.items():
        cmd = [sys.executable, "-m", "kvkeeper.cli", "eval", "terms", "generate", "--max-segments", str(max_segments),
               "--max-tokens", str(max_tokens), "--out", str(runs / name), *extra]
        subprocess.run(cmd, check=True, cwd=ROOT)


def same_tokens(a: Path, b: Path) -> tuple[int, int]:
    """(turns whose token ids are identical, turns) between two runs' glossary turns."""
    ta = [json.loads(x) for x in (a / "turns.glossary.jsonl").read_text().splitlines()]
    tb = [json.loads(x) for x in (b / "turns.glossary.jsonl").read_text().splitlines()]
    return sum(x["token_ids"] == y["token_ids"] for x, y in zip(ta, tb)), len(ta)


def table(runs: Path) -> tuple[str, dict]:
    head = "| run | condition | term acc % | WO-2 % | WO-3 % | 1-TERm % | BLEU | chrF | consistency % | cached / prompt tokens | s |"
    lines = [head, "|---" * 11 + "|"]
    data = {}
    for name, (_, conds) in RUNS.items():
        p = runs / name / "scores.json"
        if not p.exists():
            continue
        r = json.loads(p.read_text())
        data[name] = r
        for c in conds:
            if c not in r["conditions"]:  # a run of fewer conditions (e.g. the glossary only)
                continue
            o, cache = r["conditions"][c]["overall"], r["conditions"][c]["cache"]
            cells = ["n/a" if o[k] is None else f"{o[k] * f:.1f}" for k, f in COLS]
            lines.append(f"| {LABELS[name]} | {c} | " + " | ".join(cells)
                         + f" | {cache['cached_tokens']:,} / {cache['prompt_tokens']:,} | {cache['seconds']:.0f} |")
    notes = []
    for a, b in (("reuse", "noreuse"), ("reuse", "int8"), ("reuse", "snapkv"), ("exact_reuse", "exact_noreuse")):
        if a in data and b in data:
            same, n = same_tokens(runs / a, runs / b)
            notes.append(f"{LABELS[b]} vs {LABELS[a]}: {same} of {n} glossary turns token-identical")
            data.setdefault("identical_turns", {})[f"{b}_vs_{a}"] = [same, n]
    return "\n".join(lines) + "\n\n" + "\n".join(f"* {x}" for x in notes) + "\n", data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from common import result_path

    ap.add_argument("--runs", type=Path, default=result_path("terms_bench", suffix="-runs"),
                    help="one folder per run (default: results/terms_bench/terms_bench-<config>-<date>-runs)")
    ap.add_argument("--max-segments", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--collect", action="store_true", help="only build the table from existing runs")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "terms_bench")
    args = ap.parse_args()
    if not args.collect:
        run(args.runs, args.max_segments, args.max_tokens)
    md, data = table(args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    result_path("terms_bench", suffix=".md", out=args.out).write_text(md)
    result_path("terms_bench", out=args.out).write_text(json.dumps(data, indent=1))
    print(md)


if __name__ == "__main__":
    main()
