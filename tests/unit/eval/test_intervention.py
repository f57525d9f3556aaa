"""The cache "hotfixes" of issue 26 (kvkeeper.eval.intervention) on the real embedded model, default path (GGUF
blocks in place, bf16 KV, the invariant C++ kernels): what each policy writes into the KV of a span, and what it
leaves alone; the fresh recompute's positions; ``kvkeeper eval intervene`` on a tiny input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvkeeper import SamplingParams
from kvkeeper.cli import main
from kvkeeper.errors import InvalidRequestError
from kvkeeper.eval.intervene import document_perplexity, sentence_ends
from kvkeeper.kernels import cpu as cpu_kernels
from kvkeeper.eval.intervention import KVIntervention, fresh_span_kv, intervene

from tests.utils.engines import make_engine

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels are not built")

TEXT = ("The cat sat on the mat. It was a sunny day in the small town, and nobody was in a hurry. The dog barked "
        "at the mailman, who ran away quickly! Then it rained for three hours. Why did it rain? Nobody knew.")
A, START, END = 7, 14, 30  # anchor tokens, span [START, END)


@pytest.fixture(scope="module")
def eng():
    eng = make_engine(quantization="gguf", num_kv_blocks=128)
    assert eng.runner.invariant and eng.runner.kv_format.storage == torch.bfloat16
    return eng


def _held(eng):
    """A finished sequence of TEXT holding its KV (an isolated namespace), and its KV per layer (float32)."""
    ids = eng.tokenizer.encode(TEXT, add_special_tokens=False)
    kept = {}
    seq = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0), namespace=eng.isolated_namespace("t"))
    seq.kv_holder = lambda s: kept.setdefault("s", s)
    eng.run_until_done([seq])
    s = kept["s"]
    assert s.num_computed > END
    return s


def _kv(eng, s) -> list[tuple[torch.Tensor, torch.Tensor]]:
    bt = torch.tensor(s.block_table, dtype=torch.int64)
    n = s.num_computed
    return [eng.kv.store.gather(i, bt[: -(-n // eng.block_size)], n, torch.float32)
            for i in range(eng.kv.store.num_layers)]


@pytest.fixture
def held(eng):
    s = _held(eng)
    yield s
    eng.kv.free(s)


def test_fresh_recompute_keeps_positions_and_resets_the_context(eng, held):
    before = _kv(eng, held)
    fresh = fresh_span_kv(eng, held.token_ids, A, START, END)
    # layer 0's K/V depend only on the token and its RoPE position: equal bit for bit when the positions are right
    assert torch.equal(fresh[0][0], before[0][0][START:END]) and torch.equal(fresh[0][1], before[0][1][START:END])
    # deeper layers saw another context (the anchor only): they differ
    assert all(not torch.equal(fresh[i][0], before[i][0][START:END]) for i in range(1, len(before)))
    # a recompute for layer 3 runs layers 0-3 only, and gives what the whole model's recompute gives there
    shallow = fresh_span_kv(eng, held.token_ids, A, START, END, [3])
    assert list(shallow) == [3]
    assert torch.equal(shallow[3][0], fresh[3][0]) and torch.equal(shallow[3][1], fresh[3][1])
    # with the anchor reaching the span the context is the original one: every layer equal (invariant path)
    same = fresh_span_kv(eng, held.token_ids, START, START, END)
    assert all(torch.equal(same[i][0], before[i][0][START:END]) and torch.equal(same[i][1], before[i][1][START:END])
               for i in range(len(before)))


def _unchanged_elsewhere(before, after, layers):
    for i, ((k0, v0), (k1, v1)) in enumerate(zip(before, after)):
        if i not in layers:
            assert torch.equal(k0, k1) and torch.equal(v0, v1), f"layer {i} changed"
        else:
            for x0, x1 in ((k0, k1), (v0, v1)):
                assert torch.equal(x0[:START], x1[:START]) and torch.equal(x0[END:], x1[END:]), f"layer {i} outside"


def test_layer_reset_writes_the_fresh_kv_into_its_layer_only(eng, held):
    before = _kv(eng, held)
    pol = KVIntervention("layer_reset", (3,))
    fresh = fresh_span_kv(eng, held.token_ids, A, START, END, [3])
    r = intervene(eng, held, START, END, A, pol)
    after = _kv(eng, held)
    assert r["tokens"] == END - START and r["recomputed"] == A + END - START and r["max_abs_change"] > 0
    assert torch.equal(after[3][0][START:END], fresh[3][0]) and torch.equal(after[3][1][START:END], fresh[3][1])
    _unchanged_elsewhere(before, after, {3})


def test_gated_refresh_stores_the_stated_mix(eng, held):
    before = _kv(eng, held)
    pol = KVIntervention("gated_refresh", (2, 5), gate=0.25)
    fresh = fresh_span_kv(eng, held.token_ids, A, START, END, [2, 5])
    intervene(eng, held, START, END, A, pol)
    after = _kv(eng, held)
    for layer in (2, 5):
        for j in (0, 1):
            want = (0.25 * before[layer][j][START:END] + 0.75 * fresh[layer][j]).bfloat16().float()
            assert torch.equal(after[layer][j][START:END], want), (layer, j)
    _unchanged_elsewhere(before, after, {2, 5})


def test_gated_refresh_at_gate_one_changes_nothing(eng, held):
    before = _kv(eng, held)
    intervene(eng, held, START, END, A, KVIntervention("gated_refresh", (3,), gate=1.0))
    after = _kv(eng, held)
    assert all(torch.equal(b[0], a[0]) and torch.equal(b[1], a[1]) for b, a in zip(before, after))


def test_layernorm_aware_reset_keeps_the_old_scale_with_the_fresh_direction(eng, held):
    before = _kv(eng, held)
    fresh = fresh_span_kv(eng, held.token_ids, A, START, END, [3])
    intervene(eng, held, START, END, A, KVIntervention("ln_reset", (3,)))
    after = _kv(eng, held)
    for j in (0, 1):
        old, new, fr = before[3][j][START:END], after[3][j][START:END], fresh[3][j]
        torch.testing.assert_close(new.norm(dim=-1), old.norm(dim=-1), rtol=8e-3, atol=1e-3)  # bf16 storage
        cos = torch.nn.functional.cosine_similarity(new, fr, dim=-1)
        assert float(cos.min()) > 0.999
        assert not torch.equal(new, fr) and not torch.equal(new, old)
    _unchanged_elsewhere(before, after, {3})


def test_refusals(eng, held):
    with pytest.raises(InvalidRequestError, match="unknown intervention"):
        KVIntervention("reset_everything")
    with pytest.raises(InvalidRequestError, match="gate"):
        KVIntervention("gated_refresh", gate=1.5)
    with pytest.raises(InvalidRequestError, match="layer 99 does not exist"):
        intervene(eng, held, START, END, A, KVIntervention("layer_reset", (99,)))
    with pytest.raises(InvalidRequestError, match="past the"):
        intervene(eng, held, START, held.num_computed + 1, A, KVIntervention("layer_reset"))
    b = held.block_table[START // eng.block_size]
    eng.pool.incref(b)  # another owner holds the span's block: rewriting it would change that owner's KV
    try:
        with pytest.raises(ValueError, match="shared with another owner"):
            intervene(eng, held, START, END, A, KVIntervention("layer_reset"))
    finally:
        eng.pool.free(b)


def test_sentence_ends_and_document_perplexity(eng):
    ids = eng.tokenizer.encode(TEXT, add_special_tokens=False)
    ends = sentence_ends(eng.tokenizer, ids)
    assert len(ends) == 6 and ends[-1] == len(ids)
    assert [eng.tokenizer.decode(ids[e - 1:e]).strip()[-1] for e in ends[:-1]] == [".", ".", "!", ".", "?"]
    base = document_perplexity(eng, ids, None)
    assert base["interventions"] == 0 and base["scored_tokens"] == len(ids) - ends[0]
    reset = document_perplexity(eng, ids, KVIntervention("layer_reset", (3,)))
    assert reset["interventions"] == 4  # every sentence after the anchor but the last
    assert math.isfinite(reset["ppl"]) and reset["ppl"] != base["ppl"]
    assert eng.pool.num_used == 0  # the measurement's sequence gave its blocks back


def test_cli_eval_intervene_tiny(tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text(TEXT * 3)
    out = tmp_path / "r.json"
    assert main(["eval", "intervene", "--quantization", "gguf", "--kv-blocks", "256", "--text", str(text),
                 "--context", "120", "--skip-tokens", "0", "--docs", "CMU_1", "--max-segments", "2",
                 "--max-tokens", "4", "--policies", "layer_reset", "ln_reset", "--json", "--out", str(out)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert list(r["rows"]) == ["none", "layer_reset@3", "ln_reset@3"]
    assert r["settings"]["weights"] == "gguf" and r["settings"]["kv_dtype"] == "bfloat16"
    none = r["rows"]["none"]
    assert none["perplexity"]["ppl_change"] == 0 and none["terms"]["identical_turns"] == [2, 2]
    for name in ("layer_reset@3", "ln_reset@3"):
        row = r["rows"][name]
        assert row["perplexity"]["interventions"] > 0 and math.isfinite(row["perplexity"]["ppl"])
        assert row["terms"]["intervention_ms"] > 0 and 0 <= row["terms"]["identical_turns"][0] <= 2
        assert set(row["terms"]["scores"]) >= {"term_accuracy", "consistency"}
        assert "turns" not in row["terms"]  # --json leaves the translations to --out
    full = json.loads(out.read_text())
    assert len(full["rows"]["layer_reset@3"]["terms"]["turns"]) == 2
    assert main(["eval", "intervene", "--skip-perplexity", "--skip-terms"]) != 0
