"""Agreement of ``kvkeeper eval terms score`` with the WMT21 terminology task's reference scorer.

The reference is mahfuzibnalam/terminology_evaluation (``evaluate_term_wmt.py``, MIT).  Its sample
hypothesis ``data/en-fr.dev.txt.truecased.sgm`` (a Fairseq system on the EN-FR dev set) is scored here
by kvkeeper (hypotheses taken as tokenized, ``--tokenize none``, as the reference takes them) and compared
with two sets of reference figures:

* ``published``: the reference's README (run with stanza's French lemmatizer);
* ``run_without_stanza``: the reference script run here, unmodified, in its own venv (beautifulsoup4, lxml,
  sacrebleu) with stanza made unavailable, so its lemma paths are off (stanza would download models).

Then it shows where window overlap differs: a variant of kvkeeper's window overlap that places terms in
the reference as the reference scorer does (the first occurrence of the term's first and last words, and
for a two-word term only its last word, so that its first word becomes left context) and keeps only terms
whose type contains ``tgt_original``.

Usage: python benchmarks/eval/terms_agreement.py --reference-repo DIR [--out benchmarks/results/terms_agreement]
"""

from __future__ import annotations

import argparse
import html
import json
import re
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # common

from kvkeeper.eval import terms as T  # noqa: E402

TERMS = ROOT / "data" / "wmt21_terminology_enfr" / "dev.en-fr.terms.jsonl"
KEYS = ("bleu", "term_accuracy", "window_overlap_2", "window_overlap_3", "one_minus_term")
REFERENCE = {
    # README of mahfuzibnalam/terminology_evaluation (commit 040906f), stanza lemmas on
    "published": {"bleu": 45.33867641150976, "term_accuracy": 0.8590455049944506,
                  "window_overlap_2": 0.29693757867032844, "window_overlap_3": 0.2907071747339513,
                  "one_minus_term": 0.5976316319523398},
    # evaluate_term_wmt.py run on 2026-11-30 without stanza: its exact match then counts every term as
    # correct (a term missed without lemmas lands in the "correct" branch), so that figure is left out
    "run_without_stanza": {"bleu": 45.33867641150976, "term_accuracy": None,
                           "window_overlap_2": 0.28821518480375324, "window_overlap_3": 0.28228515848495267,
                           "one_minus_term": 0.5966058855662661},
}


def read_sgm_segments(path: Path) -> list[tuple[str, str]]:
    segs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.search(r'<seg id="([^"]+)">(.*)</seg>', line)
        if m:
            segs.append((m.group(1), " ".join(html.unescape(m.group(2)).split())))
    return segs


def _ctx(tokens: list[str], lo: int, hi: int, w: int) -> list[str]:
    left = [t for t in reversed(tokens[:lo]) if t not in string.punctuation][:w]
    return left + [t for t in tokens[hi + 1:] if t not in string.punctuation][:w]


def reference_placed_overlap(hyp: list[str], ref: list[str], terms: list[T.Term], w: int) -> float:
    """Window overlap with the reference scorer's placement of terms in the reference (see the docstring)."""
    groups: dict[str, int] = {}
    for t in terms:
        groups[t.ref_surface] = groups.get(t.ref_surface, 0) + 1
    total, pairs = 0.0, 0
    for form, n in groups.items():
        f = form.split()
        s, e = ref.index(f[0]), ref.index(f[-1])
        ids = list(range(s, e - 1)) + [e]
        scores = sorted(((T._overlap(_ctx(ref, min(ids), max(ids), w), _ctx(hyp, o, o + len(f) - 1, w)), j, k)
                         for j in range(n) for k, o in enumerate(T._occurrences(hyp, f))), key=lambda x: -x[0])
        seen_j, seen_k = set(), set()
        for sc, j, k in scores:
            if j not in seen_j and k not in seen_k:
                seen_j.add(j), seen_k.add(k)
                total, pairs = total + sc, pairs + 1
    return total / pairs if pairs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference-repo", required=True, type=Path, help="a checkout of terminology_evaluation")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "terms_agreement")
    args = ap.parse_args()
    segs = T.load_segments(TERMS)
    hyp = read_sgm_segments(args.reference_repo / "data" / "en-fr.dev.txt.truecased.sgm")
    assert [h[0] for h in hyp] == [str(s.seg_id) for s in segs], "the sample file's segments are not the dev set's"
    hyps = [h[1] for h in hyp]
    ours = T.score(segs, hyps, tokenize="none")["overall"]
    ours_no_lemmas = T.score(segs, hyps, tokenize="none", lemmas=False)["overall"]
    placed = {f"window_overlap_{w}": sum(reference_placed_overlap(
        h.split(), s.ref.split(), [t for t in s.terms if "tgt_original" in t.type], w)
        for s, h in zip(segs, hyps)) / len(segs) for w in (2, 3)}
    res = {"kvkeeper": {k: ours[k] for k in KEYS}, "kvkeeper_no_lemmas": {k: ours_no_lemmas[k] for k in KEYS},
           "kvkeeper_reference_placement": placed, "reference": REFERENCE}
    args.out.mkdir(parents=True, exist_ok=True)
    from common import result_path

    result_path("terms_agreement", out=args.out).write_text(json.dumps(res, indent=1))
    lines = ["| metric | kvkeeper | reference (published, stanza) | difference, points | reference run without "
             "stanza | difference, points |", "|---|---|---|---|---|---|"]
    for k in KEYS:
        scale = 1 if k == "bleu" else 100
        cells = [f"{ours[k] * scale:.2f}"]
        for src in ("published", "run_without_stanza"):
            v = REFERENCE[src][k]
            cells += ["n/a", "n/a"] if v is None else [f"{v * scale:.2f}", f"{(ours[k] - v) * scale:+.2f}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("window overlap with the reference's placement of terms and tgt_original terms only: "
                 + ", ".join(f"{k} {v * 100:.4f}" for k, v in placed.items()))
    result_path("terms_agreement", suffix=".md", out=args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
