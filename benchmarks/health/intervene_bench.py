"""The published cache "hotfixes" measured (issue 26): ``kvkeeper eval intervene`` on one model, the table of the
README's "Cache hotfixes" and docs/evaluation.md.

One ``kvkeeper eval intervene`` run (its own process, ``--out results/intervene_bench/intervene_bench-<config>-<date>.json``) with the
baseline and every policy; the markdown table is built from that JSON.  ``--collect`` only rebuilds the table.

Usage: python benchmarks/health/intervene_bench.py [--model smollm2-135m-instruct] [--config smollm2-135m]
    [--docs DOC ...] [--max-segments 6] [--max-tokens 48] [--context 2048] [--layers 3] [--collect]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import cpu_model, result_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["CMU_1", "PubMed_9", "Wikinews_2", "Wikipedia_handpicked_5", "Wikivoyage_1", "wiki_13"]


def table(r: dict) -> str:
    s = r["settings"]
    head = ("| policy | ppl | ppl change | resets (ppl) | reset ms (ppl) | term acc % | consistency % | "
            "turns as baseline | policy ms (terms) | turn s (terms) |")
    lines = [head, "|---" * 10 + "|"]
    for name, row in r["rows"].items():
        p, t = row.get("perplexity"), row.get("terms")
        cells = [name]
        cells += ([f"{p['ppl']:.4f}", f"{p['ppl_change']:+.4f}", str(p["interventions"]), f"{p['intervention_ms']:.0f}"]
                  if p else ["n/a"] * 4)
        if t:
            sc = t["scores"]
            cons = "n/a" if sc["consistency"] is None else f"{sc['consistency'] * 100:.1f}"
            cells += [f"{sc['term_accuracy'] * 100:.1f}", cons, f"{t['identical_turns'][0]} / {t['identical_turns'][1]}",
                      f"{t['intervention_ms']:.0f}", f"{t['seconds']:.1f}"]
        else:
            cells += ["n/a"] * 5
        lines.append("| " + " | ".join(cells) + " |")
    docs = s.get("documents", {})
    note = (f"\n* model {s['model']}, weights {s['weights']}, KV {s['kv_dtype']}, layers {s['layers']}, gate "
            f"{s['gate']}; text {Path(s['text']).name if s.get('text') else 'n/a'} ({s.get('context')} tokens after "
            f"{s.get('skip_tokens')}); terms: {len(docs)} documents, {sum(docs.values())} segments, "
            f"{s.get('max_tokens')} tokens per reply\n")
    extra = r.get("bench", {})
    if extra:
        note += (f"* load average before / after: {extra['load_before']} / {extra['load_after']}; {extra['cpu']}; "
                 f"wall {extra['wall_s']:.0f} s\n")
    return "\n".join(lines) + "\n" + note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--config", default="smollm2-135m", help="the result's config name")
    ap.add_argument("--docs", nargs="+", default=DOCS)
    ap.add_argument("--max-segments", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", nargs="+", default=["3"])
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more kvkeeper eval intervene arguments")
    ap.add_argument("--collect", action="store_true", help="only rebuild the table from the existing JSON")
    args = ap.parse_args()
    out = result_path("intervene_bench", args.config)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.collect:
        import time

        load0, t0 = os.getloadavg(), time.time()
        cmd = [sys.executable, "-m", "kvkeeper.cli", "eval", "intervene", "--model", args.model, "--docs", *args.docs,
               "--max-segments", str(args.max_segments), "--max-tokens", str(args.max_tokens), "--context",
               str(args.context), "--layers", *args.layers, "--out", str(out), *args.extra]
        subprocess.run(cmd, check=True, cwd=ROOT)
        r = json.loads(out.read_text())
        r["bench"] = {"command": " ".join(cmd[1:]), "load_before": [round(x, 2) for x in load0],
                      "load_after": [round(x, 2) for x in os.getloadavg()], "cpu": cpu_model(),
                      "wall_s": time.time() - t0}
        out.write_text(json.dumps(r, indent=1))
    md = table(json.loads(out.read_text()))
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
