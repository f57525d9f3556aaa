"""Document translation as sessions on the real embedded model (SmolLM2-135M, exact float32 path, fp32 KV):
reuse never changes a greedy translation, the glossary system message is served from cache after the first
turn of each document, and ``kvkeeper eval terms generate`` through a real server with the openai client."""

from __future__ import annotations

import json

import pytest

from kvkeeper.cli import main
from kvkeeper.eval import term_translate as TT
from kvkeeper.eval import terms as T
from tests.utils.serverproc import running_server
from tests.utils import paths

pytestmark = pytest.mark.slow

DATA = paths.DATA / "wmt21_terminology_enfr" / "dev.en-fr.terms.jsonl"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def segments():
    return T.load_segments(DATA)


@pytest.fixture(scope="module")
def docs(segments):
    return TT.documents(segments, ["CMU_1", "wiki_26"], max_segments=3)


@pytest.fixture(scope="module")
def runs(engine, segments, docs):
    """The glossary condition with and without reuse (the session fixture: float32 weights, fp32 KV)."""
    assert engine.runner.weight_format == "none" and engine.runner.kv_format.name == "float32"
    return {reuse: TT.translate_condition(TT.LocalTranslator(engine, MAX_TOKENS, reuse=reuse), docs, "glossary",
                                          segments) for reuse in (True, False)}


def test_reuse_never_changes_a_greedy_translation(runs, docs):
    on, off = runs[True]["turns"], runs[False]["turns"]
    assert len(on) == len(off) == 6
    for a, b in zip(on, off):
        assert a["token_ids"] == b["token_ids"], (a["doc_id"], a["text"], b["text"])
    assert all(t["cached_tokens"] == 0 for t in off)  # the baseline really recomputed everything
    chosen = [s for d in docs.values() for s in d]
    s_on, s_off = (T.score(chosen, runs[r]["hyps"]) for r in (True, False))
    for k in ("term_accuracy", "consistency", "window_overlap_2", "one_minus_term", "bleu"):
        assert s_on["overall"][k] == s_off["overall"][k]


def test_glossary_prefix_is_served_from_cache_after_the_first_turn(engine, runs, docs):
    turns = runs[True]["turns"]
    for doc_id in docs:
        system = runs[True]["systems"][doc_id]
        assert "Use these French terms" in system
        sys_ids = engine.encode_chat([{"role": "system", "content": system}], add_generation_prompt=False)
        mine = [t for t in turns if t["doc_id"] == doc_id]
        assert mine[0]["cached_tokens"] < len(sys_ids)  # the first turn computes the system message
        for t in mine[1:]:
            assert t["cached_tokens"] >= len(sys_ids), (doc_id, t["cached_tokens"], len(sys_ids))
            assert t["cached_tokens"] < t["prompt_tokens"]


def test_generate_through_a_server_with_the_openai_client(tmp_path, engine, runs, capsys):
    with running_server(tmp_path / "server.log", "--quantization", "none", "--kv-dtype", "fp32",
                        "--threads", "1") as base:  # one thread: two oversubscribe the 2 cores beside the workers
        rc = main(["eval", "terms", "generate", "--server", base, "--docs", "CMU_1", "wiki_26", "--max-segments", "3",
                   "--max-tokens", str(MAX_TOKENS), "--conditions", "glossary", "--out", str(tmp_path / "out"),
                   "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    g = r["conditions"]["glossary"]
    assert set(T.METRICS) <= set(g["overall"]) and set(g["documents"]) == {"CMU_1", "wiki_26"}
    turns = [json.loads(line) for line in (tmp_path / "out" / "turns.glossary.jsonl").read_text().splitlines()]
    # the same exact path through the server door: the same greedy translations as the local engine
    assert [t["text"] for t in turns] == runs[True]["hyps"]
    assert [t["prompt_tokens"] for t in turns] == [t["prompt_tokens"] for t in runs[True]["turns"]]
    # the session (X-Session-ID) serves each document's earlier turns, system message included, from cache
    for doc_id in ("CMU_1", "wiki_26"):
        sys_ids = engine.encode_chat([{"role": "system", "content": runs[True]["systems"][doc_id]}],
                                     add_generation_prompt=False)
        mine = [t for t in turns if t["doc_id"] == doc_id]
        assert all(t["cached_tokens"] >= len(sys_ids) for t in mine[1:]), mine
    assert (tmp_path / "out" / "hyp.glossary.txt").read_text().splitlines() == runs[True]["hyps"]


def test_generate_cli_on_the_local_engine(capsys):
    assert main(["eval", "terms", "generate", "--docs", "wiki_26", "--max-segments", "2", "--max-tokens", "8",
                 "--conditions", "none", "random", "--policy", "knorm", "--ratio", "0.25", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["settings"]["documents"] == {"wiki_26": 2} and r["settings"]["policy"] == "knorm"
    for cond in ("none", "random"):
        c = r["conditions"][cond]
        assert c["overall"]["segments"] == 2 and c["cache"]["turns"] == 2
        assert c["cache"]["prompt_tokens"] > c["cache"]["cached_tokens"] >= 0
    assert main(["eval", "terms", "generate", "--docs", "nope"]) == 2
    assert "unknown document 'nope'" in capsys.readouterr().err
