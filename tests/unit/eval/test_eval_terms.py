"""Terminology metrics (kvkeeper.eval.terms) on hand-made segments whose values are worked out by hand here,
the glossary conditions, and ``kvkeeper eval terms score`` on files."""

from __future__ import annotations

import json

import pytest

from kvkeeper.cli import main
from kvkeeper.errors import InvalidRequestError
from kvkeeper.eval import term_translate as TT
from kvkeeper.eval import terms as T
from tests.utils import paths

DATA = paths.DATA / "wmt21_terminology_enfr" / "dev.en-fr.terms.jsonl"

REF = "le patient a des symptômes graves ."  # 7 tokens; the term "symptômes" is token 4
SYMPTOMS = T.Term(569, "symptoms", ["symptômes"], "symptômes")
NOSE = T.Term(330, "runny nose", ["nez coule-t-il", "nez qui coule"], "nez coule-t-il")


def seg(doc="d1", ref=REF, terms=(SYMPTOMS,)):
    return T.Segment(doc, 1, "src", ref, list(terms))


def one(hyp, s=None, **kw):
    return T.score([s or seg()], [hyp], tokenize="none", **kw)["overall"]


def test_term_present():
    r = one(REF)
    assert r["term_accuracy"] == 1.0
    assert r["window_overlap_2"] == 1.0 and r["window_overlap_3"] == 1.0
    assert r["one_minus_term"] == 1.0
    assert r["bleu"] == pytest.approx(100.0)


def test_term_absent_and_term_weighted_ter():
    # substitutions: patient -> malade (weight 1), symptômes -> signes (a term token: weight 2); 3 edits / 7 tokens
    r = one("le malade a des signes graves .")
    assert r["term_accuracy"] == 0.0
    assert r["window_overlap_2"] == 0.0  # the term's reference form never occurs
    assert r["one_minus_term"] == pytest.approx(1 - 3 / 7)
    ref = REF.split()
    assert T.term_ter("le malade a des signes graves .".split(), ref, set()) == pytest.approx(2 / 7)  # plain TER


def test_term_inflected_found_by_lemma_only():
    hyp = "le patient a un symptôme grave ."
    assert one(hyp)["term_accuracy"] == 1.0  # symptôme and symptômes share the lemma symptôme
    assert one(hyp, lemmas=False)["term_accuracy"] == 0.0
    assert one(hyp)["window_overlap_2"] == 0.0  # window overlap needs the reference form itself


def test_term_split_by_a_line_break():
    s = seg(ref="il a le nez coule-t-il ?", terms=[NOSE])
    assert one("il a le nez qui\ncoule ?", s)["term_accuracy"] == 1.0
    assert T.match_terms(T.Tokenizer("none")("le nez qui\ncoule"), [NOSE], None) == ["nez qui coule"]


def test_window_overlap_by_hand():
    # reference context of "symptômes": left (des, a | patient), right (graves; "." is punctuation)
    # hypothesis context: left (des, a | malade), right (très, graves)
    hyp = "un malade a des symptômes très graves"
    assert one(hyp)["window_overlap_2"] == pytest.approx(3 / 3)
    assert one(hyp)["window_overlap_3"] == pytest.approx(3 / 4)
    # the corpus score averages over every segment, one without terms counting 0 (as the task's scorer)
    r = T.score([seg(), seg(ref="bonjour .", terms=[])], [hyp, "bonjour ."], tokenize="none")["overall"]
    assert r["window_overlap_3"] == pytest.approx(3 / 8)
    assert r["term_accuracy"] == 1.0 and r["terms"] == 1


def test_each_hypothesis_position_satisfies_one_term():
    s = seg(ref="des symptômes et des symptômes", terms=[SYMPTOMS, SYMPTOMS])
    assert one("des symptômes et des signes", s)["term_accuracy"] == 0.5
    assert one("des symptômes et des symptômes", s)["term_accuracy"] == 1.0


def test_consistency_document_with_a_term_translated_two_ways():
    refs = ["il a le nez coule-t-il", "le nez coule-t-il encore", "son nez coule-t-il ?"]
    hyps = ["il a le nez qui coule", "le nez coule-t-il encore", "son nez qui coule ?"]
    segs = [seg("doc", r, [NOSE]) for r in refs]
    r = T.score(segs, hyps, tokenize="none")["documents"]["doc"]
    assert r["term_accuracy"] == 1.0  # every occurrence uses an allowed form...
    assert r["consistency"] == 0.5  # ...but the second differs from the first: 1 of 2 later occurrences
    assert r["repeated_occurrences"] == 2


def test_consistency_missing_term_counts_inconsistent_and_documents_are_separate():
    segs = [seg("a"), seg("a"), seg("a"), seg("b")]
    hyps = ["des symptômes", "des symptômes", "des signes", "des symptômes"]
    r = T.score(segs, hyps, tokenize="none")
    assert r["documents"]["a"]["consistency"] == 0.5
    assert r["documents"]["b"]["consistency"] is None  # no repeated term in b
    assert r["overall"]["consistency"] == 0.5 and r["overall"]["term_accuracy"] == 0.75


def test_moses_tokenization_of_hypotheses():
    s = seg(ref="et avez-vous l' un des symptômes ?", terms=[SYMPTOMS])
    assert T.Tokenizer("moses")("et avez-vous l'un des symptômes?") == "et avez-vous l' un des symptômes ?".split()
    moses = T.score([s], ["et avez-vous l'un des symptômes?"], tokenize="moses")["overall"]
    assert moses["one_minus_term"] == 1.0 and moses["bleu"] == pytest.approx(100)
    assert one("et avez-vous l'un des symptômes?", s)["one_minus_term"] == pytest.approx(1 - 5 / 7)
    # as given: l'un -> l' (1), + un (1), symptômes? -> symptômes (a term token: 2), + ? (1) = 5 edits / 7 tokens


def test_bad_input_is_refused():
    with pytest.raises(InvalidRequestError, match="2 hypotheses for 1 segments"):
        T.score([seg()], ["a", "b"])
    with pytest.raises(InvalidRequestError, match="unknown tokenization"):
        T.Tokenizer("spacy")


def test_load_segments_adds_the_reference_form(tmp_path):
    segs = T.load_segments(DATA)
    assert len(segs) == 971 and len({s.doc_id for s in segs}) == 13
    assert sum(len(s.terms) for s in segs) == 901
    assert all(t.ref_surface in t.forms for s in segs for t in s.terms)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"doc_id": "a", "src": "x", "ref": "y", "terms": []}\n{"src": "x"}\n')
    with pytest.raises(InvalidRequestError, match="line 2"):
        T.load_segments(bad)


def test_glossary_conditions():
    segs = T.load_segments(DATA)
    docs = TT.documents(segs, ["CMU_1"], max_segments=5)
    entries = TT.glossary(docs["CMU_1"])
    assert entries[:2] == [("symptoms", "symptômes"), ("runny nose", "nez coule-t-il")]  # distinct ids, in order
    wrong = TT.random_glossary(entries, segs, seed=0)
    assert [s for s, _ in wrong] == [s for s, _ in entries]
    for (_, right), (src, bad) in zip(entries, wrong):
        assert len(bad.split()) == len(right.split())  # the same shape
        assert bad not in {f for s in segs for t in s.terms if t.src == src for f in t.forms}
    assert wrong == TT.random_glossary(entries, segs, seed=0)
    assert "\n- symptoms = symptômes\n" in TT.system_message(entries)
    assert TT.system_message(None) == TT.INSTRUCTION
    with pytest.raises(InvalidRequestError, match="unknown document"):
        TT.documents(segs, ["nope"])


def test_cli_score_json_and_table(tmp_path, capsys):
    segs = [json.loads(line) for line in DATA.read_text().splitlines()][:6]
    terms = tmp_path / "t.jsonl"
    terms.write_text("".join(json.dumps(s) + "\n" for s in segs))
    ref = tmp_path / "ref.txt"
    ref.write_text("".join(s["ref"] + "\n" for s in segs))
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("".join(s["ref"] + "\n" for s in segs[:5]) + "rien\n")
    assert main(["eval", "terms", "score", "--hyp", str(hyp), "--ref", str(ref), "--terms", str(terms),
                 "--tokenize", "none", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(T.METRICS) <= set(r["overall"]) and list(r["documents"]) == ["CMU_1"]
    n_terms = sum(len(s["terms"]) for s in segs)
    assert r["overall"]["term_accuracy"] == pytest.approx((n_terms - len(segs[5]["terms"])) / n_terms)
    assert main(["eval", "terms", "score", "--hyp", str(hyp), "--ref", str(ref), "--terms", str(terms)]) == 0
    assert "consistency" in capsys.readouterr().out
    hyp.write_text("one line\n")
    assert main(["eval", "terms", "score", "--hyp", str(hyp), "--ref", str(ref), "--terms", str(terms)]) == 2
    assert "1 hypotheses for 6 segments" in capsys.readouterr().err
