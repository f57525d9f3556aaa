"""Terminology metrics of the WMT21 terminology task, plus a document-level consistency score.

Metrics (Alam et al., 2021, "On the Evaluation of Machine Translation for Terminology Consistency",
arXiv:2106.11891; the task's reference scorer is mahfuzibnalam/terminology_evaluation, which this
module follows in its definitions, not its code):

* **term accuracy** (exact match): for every term of a segment, is one of its allowed target forms (the
  glossary's forms plus the form the reference uses) a contiguous run of hypothesis tokens?  Each hypothesis
  start position satisfies one term at most.  When no form is found, a lemma fallback compares the
  lemmas (``simplemma``, offline) of the form with the lemmas of the hypothesis.  Correct terms / all terms.
* **window overlap** at window ``w``: for each term instance whose reference form occurs in the hypothesis,
  the share of the ``w`` non-punctuation tokens left and right of the term in the reference that also
  surround it in the hypothesis; instances and hypothesis occurrences of one form are paired greedily,
  best first; a segment scores the mean over its pairs (0 without any) and the corpus the mean over all
  segments, a segment without terms counting 0 (as the reference scorer does).
* **1 - TERm**: TER (Snover et al., 2006) with shifts found by sacrebleu's Tercom port, then a weighted
  edit distance in which every edit touching a reference token of a term costs 2; per segment
  (edits / reference tokens), one minus the mean over segments.
* **BLEU**, **chrF**: sacrebleu's corpus scores (0..100) on the tokenized hypothesis against the reference.
* **consistency**: for every source term (by its id) occurring more than once in a document, the share of
  its later occurrences translated with the same allowed target form as its first occurrence (a form found
  by its lemma counts as that form; an occurrence whose term is missing is inconsistent); None when no
  term repeats.

Text is compared as whitespace tokens: the task's references are Moses-tokenized, so a hypothesis is
tokenized with sacremoses' Moses tokenizer (``tokenize="moses"``) unless it already is (``"none"``).
Matching is case-sensitive, as in the reference scorer.
"""

from __future__ import annotations

import json
import string
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidRequestError

METRICS = ("term_accuracy", "window_overlap_2", "window_overlap_3", "one_minus_term", "bleu", "chrf",
           "consistency")
TERM_WEIGHT = 2  # TERm: cost of an edit on a term's reference token


@dataclass
class Term:
    """One term of a segment: ``src`` (source words), ``forms`` (allowed target forms, tokenized, the
    reference's own form last when the glossary lacks it), ``ref_surface`` (its form in the reference)."""

    id: int | str
    src: str
    forms: list[str]
    ref_surface: str
    type: str = ""


@dataclass
class Segment:
    """One line of a terms JSONL file (``doc_id``, ``seg_id``, ``src``, ``ref``, ``terms``)."""

    doc_id: str
    seg_id: int | str
    src: str
    ref: str
    terms: list[Term] = field(default_factory=list)


def load_segments(path: str | Path) -> list[Segment]:
    """Segments of a terms JSONL file, one per line, in file order (the WMT21 format: ``doc_id, seg_id, src,
    ref, terms: [{id, src, tgt: [forms], type, ref_surface}]``).  Raises :class:`InvalidRequestError` naming the
    line of a malformed record; FileNotFoundError when the file is missing."""
    segs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            terms = []
            for t in d.get("terms", []):
                forms = [f for f in t["tgt"] if f.strip()]
                ref = t.get("ref_surface") or ""
                if ref.strip() and ref not in forms:
                    forms.append(ref)
                terms.append(Term(t.get("id", len(terms)), t["src"], forms, ref, t.get("type", "")))
            segs.append(Segment(str(d["doc_id"]), d.get("seg_id", n), d["src"], d.get("ref", ""), terms))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidRequestError(f"{path}, line {n}: not a terms record ({type(e).__name__}: {e}); each line "
                                      "needs doc_id, src, ref and terms: [{src, tgt: [forms], ref_surface}]") from None
    return segs


class Tokenizer:
    """Whitespace tokens of a text: Moses-tokenized first (sacremoses, ``lang``) or split as is (``"none"``).
    Line breaks count as whitespace, so a term split by one still matches."""

    def __init__(self, mode: str = "moses", lang: str = "fr"):
        if mode not in ("moses", "none"):
            raise InvalidRequestError(f"unknown tokenization {mode!r}; choose moses or none")
        self.mode, self._moses = mode, None
        if mode == "moses":
            from sacremoses import MosesTokenizer

            self._moses = MosesTokenizer(lang=lang)

    def __call__(self, text: str) -> list[str]:
        words = " ".join(text.split())
        if self._moses is None or not words:
            return words.split()
        return self._moses.tokenize(words, escape=False, aggressive_dash_splits=False)


class Lemmatizer:
    """Per-token lemmas from simplemma's offline tables (``lang``: an ISO 639-1 code), cached."""

    def __init__(self, lang: str = "fr"):
        import simplemma

        self.lang, self._lemmatize, self._cache = lang, simplemma.lemmatize, {}

    def __call__(self, tokens: list[str]) -> list[str]:
        out = []
        for t in tokens:
            lem = self._cache.get(t)
            if lem is None:
                lem = self._cache[t] = self._lemmatize(t, lang=self.lang)
            out.append(lem)
        return out


def _occurrences(tokens: list[str], needle: list[str]) -> list[int]:
    """Start indices of ``needle`` as a contiguous run of ``tokens``."""
    k = len(needle)
    if k == 0:
        return []
    return [i for i in range(len(tokens) - k + 1) if tokens[i:i + k] == needle]


def match_terms(hyp: list[str], terms: list[Term], lemmatize: Lemmatizer | None) -> list[str | None]:
    """The allowed form found for each term in the hypothesis tokens (None: missing).

    Forms are tried in order, each hypothesis start position satisfying one term; then, for a term still
    missing, the lemmas of each form against the lemmas of the hypothesis (same positions, same rule)."""
    used: set[int] = set()
    found: list[str | None] = []
    hyp_lem = None
    for t in terms:
        form = _first_free(hyp, t.forms, lambda f: f.split(), used)
        if form is None and lemmatize is not None:
            hyp_lem = hyp_lem if hyp_lem is not None else lemmatize(hyp)
            form = _first_free(hyp_lem, t.forms, lambda f: lemmatize(f.split()), used)
        found.append(form)
    return found


def _first_free(tokens: list[str], forms: list[str], split, used: set[int]) -> str | None:
    for f in forms:
        for i in _occurrences(tokens, split(f)):
            if i not in used:
                used.add(i)
                return f
    return None


def _context(tokens: list[str], start: int, end: int, window: int) -> list[str]:
    """Up to ``window`` non-punctuation tokens left of ``start`` and right of ``end`` (exclusive)."""
    left = [t for t in reversed(tokens[:start]) if t not in string.punctuation][:window]
    right = [t for t in tokens[end:] if t not in string.punctuation][:window]
    return left + right


def _overlap(ref_ctx: list[str], hyp_ctx: list[str]) -> float:
    if not ref_ctx:
        return 0.0
    common = Counter(ref_ctx) & Counter(hyp_ctx)
    return sum(common.values()) / len(ref_ctx)


def window_overlap(hyp: list[str], ref: list[str], terms: list[Term], window: int) -> float:
    """One segment's window overlap (see the module docstring): mean over greedily paired
    (reference instance, hypothesis occurrence) of each term's reference form; 0.0 with no pair."""
    by_form: dict[str, int] = Counter(t.ref_surface for t in terms if t.ref_surface.strip())
    total, pairs = 0.0, 0
    for form, n_inst in by_form.items():
        f = form.split()
        ref_starts = _occurrences(ref, f)[:n_inst]
        hyp_starts = _occurrences(hyp, f)
        scores = []
        for j, rs in enumerate(ref_starts):
            rc = _context(ref, rs, rs + len(f), window)
            for k, hs in enumerate(hyp_starts):
                scores.append((_overlap(rc, _context(hyp, hs, hs + len(f), window)), j, k))
        scores.sort(key=lambda x: -x[0])  # stable: ties keep reference order, then hypothesis order
        seen_j, seen_k = set(), set()
        for s, j, k in scores:
            if j not in seen_j and k not in seen_k:
                seen_j.add(j)
                seen_k.add(k)
                total += s
                pairs += 1
    return total / pairs if pairs else 0.0


def term_positions(ref: list[str], terms: list[Term]) -> set[int]:
    """Reference token indices covered by the terms' reference forms (the k-th instance of a form at its
    k-th occurrence)."""
    pos: set[int] = set()
    seen: Counter = Counter()
    for t in terms:
        f = t.ref_surface.split()
        occ = _occurrences(ref, f)
        if f and seen[t.ref_surface] < len(occ):
            s = occ[seen[t.ref_surface]]
            pos.update(range(s, s + len(f)))
        seen[t.ref_surface] += 1
    return pos


def weighted_edit_distance(hyp: list[str], ref: list[str], weights: list[int]) -> int:
    """Levenshtein distance of token lists where an edit on reference token j (substituting or inserting it)
    costs ``weights[j]`` and deleting a hypothesis token costs 1."""
    prev = [0] * (len(ref) + 1)
    for j in range(1, len(ref) + 1):
        prev[j] = prev[j - 1] + weights[j - 1]
    for i in range(1, len(hyp) + 1):
        cur = [prev[0] + 1] + [0] * len(ref)
        h = hyp[i - 1]
        for j in range(1, len(ref) + 1):
            sub = prev[j - 1] + (0 if h == ref[j - 1] else weights[j - 1])
            cur[j] = min(sub, prev[j] + 1, cur[j - 1] + weights[j - 1])
        prev = cur
    return prev[-1]


def term_ter(hyp: list[str], ref: list[str], positions: set[int], weight: int = TERM_WEIGHT) -> float:
    """TERm of one segment: (shifts + weighted edits) / reference tokens.  Shifts are chosen as sacrebleu's
    Tercom port chooses them (unweighted); the remaining edits are weighted by :func:`weighted_edit_distance`
    with ``weight`` on the tokens at ``positions``.  An empty reference scores 1.0 against a non-empty
    hypothesis, 0.0 against an empty one."""
    from sacrebleu.metrics import lib_ter

    if not ref:
        return float(len(hyp) > 0)
    ed = lib_ter.BeamEditDistance(ref)
    words, shifts, checked = list(hyp), 0, 0
    while True:
        delta, new_words, checked = lib_ter._shift(words, ref, ed, checked)
        if checked >= lib_ter._MAX_SHIFT_CANDIDATES or delta <= 0:
            break
        shifts, words = shifts + 1, new_words
    weights = [weight if j in positions else 1 for j in range(len(ref))]
    return (shifts + weighted_edit_distance(words, ref, weights)) / len(ref)


def consistency(doc_forms: list[tuple[Term, str | None]]) -> tuple[int, int]:
    """(consistent, counted) over one document's term occurrences in order, each with the form found
    (None: missing): for each term id seen more than once, its occurrences after the first count, and are
    consistent when their form is the first occurrence's (and not missing)."""
    first: dict = {}
    consistent = counted = 0
    for t, form in doc_forms:
        key = t.id
        if key not in first:
            first[key] = form
            continue
        counted += 1
        consistent += int(form is not None and form == first[key])
    return consistent, counted


@dataclass
class _SegmentScore:
    doc_id: str
    hyp: str
    ref: str
    correct: int
    terms: int
    wo2: float
    wo3: float
    term: float
    forms: list[tuple[Term, str | None]]


def score_segment(seg: Segment, hyp_text: str, tokenize: Tokenizer, lemmatize: Lemmatizer | None) -> _SegmentScore:
    """Every per-segment quantity of :func:`score` for one hypothesis (the reference is split on whitespace)."""
    hyp, ref = tokenize(hyp_text), seg.ref.split()
    found = match_terms(hyp, seg.terms, lemmatize)
    return _SegmentScore(seg.doc_id, " ".join(hyp), " ".join(ref), sum(f is not None for f in found), len(seg.terms),
                         window_overlap(hyp, ref, seg.terms, 2), window_overlap(hyp, ref, seg.terms, 3),
                         term_ter(hyp, ref, term_positions(ref, seg.terms)), list(zip(seg.terms, found)))


def _aggregate(rows: list[_SegmentScore]) -> dict:
    import sacrebleu

    n = len(rows)
    terms = sum(r.terms for r in rows)
    cons = [consistency([f for r in rows if r.doc_id == d for f in r.forms]) for d in dict.fromkeys(r.doc_id for r in rows)]
    counted = sum(c[1] for c in cons)
    hyps, refs = [r.hyp for r in rows], [r.ref for r in rows]
    return {
        "term_accuracy": sum(r.correct for r in rows) / terms if terms else None,
        "window_overlap_2": sum(r.wo2 for r in rows) / n,
        "window_overlap_3": sum(r.wo3 for r in rows) / n,
        "one_minus_term": 1.0 - sum(r.term for r in rows) / n,
        "bleu": sacrebleu.corpus_bleu(hyps, [refs], force=True).score,
        "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
        "consistency": sum(c[0] for c in cons) / counted if counted else None,
        "segments": n, "terms": terms, "repeated_occurrences": counted,
    }


def score(segments: list[Segment], hyps: list[str], tokenize: str = "moses", lang: str = "fr",
          lemmas: bool = True) -> dict:
    """All metrics, overall and per document: ``{"overall": {metric: value}, "documents": {doc_id: {...}}}``.

    Metrics: :data:`METRICS` (fractions in 0..1; ``bleu`` and ``chrf`` on sacrebleu's 0..100 scale; None where
    undefined: term accuracy without terms, consistency without a repeated term) plus the counts ``segments``,
    ``terms`` and ``repeated_occurrences``.  ``hyps[i]`` translates ``segments[i]`` (matched by order);
    documents come from ``Segment.doc_id``.  tokenize: how hypotheses are tokenized ("moses" or "none");
    lemmas: the lemma fallback of term accuracy.  Raises :class:`InvalidRequestError` when the counts differ
    or there is no segment.
    """
    if len(hyps) != len(segments):
        raise InvalidRequestError(f"{len(hyps)} hypotheses for {len(segments)} segments: give one hypothesis line "
                                  "per line of the terms file, in the same order")
    if not segments:
        raise InvalidRequestError("no segments to score")
    tok = Tokenizer(tokenize, lang)
    lem = Lemmatizer(lang) if lemmas else None
    rows = [score_segment(s, h, tok, lem) for s, h in zip(segments, hyps)]
    docs = {d: _aggregate([r for r in rows if r.doc_id == d]) for d in dict.fromkeys(r.doc_id for r in rows)}
    return {"overall": _aggregate(rows), "documents": docs}


def with_references(segments: list[Segment], refs: list[str]) -> list[Segment]:
    """The segments with their references replaced by ``refs`` (one per segment, by order); raises
    :class:`InvalidRequestError` when the counts differ."""
    if len(refs) != len(segments):
        raise InvalidRequestError(f"{len(refs)} reference lines for {len(segments)} segments of the terms file: "
                                  "give one reference line per terms line, in the same order")
    return [Segment(s.doc_id, s.seg_id, s.src, r, s.terms) for s, r in zip(segments, refs)]
