"""Reuse audit: no divergence over MT-Bench sessions and shared prefixes; injected faults are named
(layer and token); sampling (the server's counters in /metrics and the session dump endpoint:
tests/api/test_audit_server.py)."""

from __future__ import annotations

import json

import pytest

from kvkeeper import SamplingParams
from kvkeeper.diagnostics import faults
from kvkeeper.diagnostics.audit import ReuseAuditor
from kvkeeper.kvcache.compression import KVCompression
from kvkeeper.sessions import SessionManager

from tests.utils.sessionutil import sessions_of
from tests.utils.engines import make_engine

TEXT_A = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a flask "
          "of tea and a notebook in which he recorded the ships that passed the rocky point during the night.")
TEXT_B = ("A small bakery on the corner sold bread, pastries and cakes to the people of the village, opening "
          "before sunrise so that the farmers could buy warm loaves on their way to the fields.")


@pytest.fixture(scope="module")
def eng():
    """SmolLM2 fp32 with every request audited; validators off (the fault tests corrupt the cache on purpose,
    each in its own namespace); the clean-run test turns them back on."""
    e = make_engine(num_kv_blocks=320, validate_every=0, quantization="none")
    e.auditor = ReuseAuditor(1.0).attach(e)  # the tests read its counters and reports
    return e


def _report(eng, request_id):
    return next(r for r in eng.auditor.reports if r.request_id == request_id)


def _first_diff(a, b):
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def test_no_mismatch_over_mt_bench_sessions_and_shared_prefixes(eng, mt_bench):
    eng.validate_every = 1  # the integrity validators run too: a clean run must satisfy both
    try:
        before = eng.auditor.total
        ids = []
        for q in mt_bench[:2]:  # both turns of each question as a session: turn 2 reuses turn 1's KV
            s = sessions_of(eng).open()
            for t in q["turns"]:
                s.send(t, SamplingParams(max_tokens=6))
            ids += [f"{s.id}-t1", f"{s.id}-t2"]
            s.close()
        shared = "Answer the following question carefully and briefly, in one sentence. " * 3
        prompts = [shared + q["turns"][0] for q in mt_bench[3:5]]
        outs = eng.generate(prompts, SamplingParams(max_tokens=2))  # share the prefix within the batch...
        outs += eng.generate(prompts, SamplingParams(max_tokens=2))  # ...and all but the last block the second time
    finally:
        eng.validate_every = 0
    ids += [o.request_id for o in outs]
    assert eng.auditor.total - before == len(ids) == 8
    reps = [_report(eng, i) for i in ids]
    assert all(r.ok for r in reps), [r.summary() for r in reps if not r.ok]
    assert all(len(r.layer_max_abs_diff) == eng.model_config.num_layers and r.logits_max_abs_diff is not None
               for r in reps)
    turn2 = [r for r in reps if r.request_id.endswith("-t2")]
    assert len(turn2) == 2 and all(r.cached_tokens > 0 for r in turn2)
    # reuse vs recompute: fp32 rounding only (GEMMs of other shapes; turn 2 also reuses decoded tokens' KV,
    # computed by one-row products): relative to the largest |K| or |V| at most 1e-5
    batch2 = [_report(eng, o.request_id) for o in outs[2:]]
    assert all(r.cached_tokens >= r.prompt_tokens - 16 for r in batch2)
    assert max(r.kv_max_rel_diff for r in reps) <= 1e-5
    assert max(r.kv_max_abs_diff for r in reps) <= 1e-4
    assert max(r.logits_max_abs_diff for r in reps) <= 1e-4
    assert eng.auditor.mismatches == 0


def test_block_reused_across_namespaces_is_named(eng):
    ns_a, ns_b = eng.isolated_namespace("a"), eng.isolated_namespace("b")
    ids_a = eng.tokenizer.encode(TEXT_A)
    ids_b = ids_a[:5] + eng.tokenizer.encode(TEXT_B)  # the first 5 tokens agree, token 5 differs
    eng.generate([ids_a], SamplingParams(max_tokens=2), namespace=ns_a)
    bid, _ = eng.pool.lookup(None, ns_a, ids_a[:16])
    assert bid is not None
    seq = eng.add_request(ids_b, SamplingParams(max_tokens=2), namespace=ns_b)
    faults.reuse_foreign_block(eng, seq, bid)  # B gets A's first block as if the prefix cache handed it out
    n = eng.auditor.mismatches
    eng.run_until_done([seq])
    r = _report(eng, seq.request_id)
    assert not r.ok and eng.auditor.mismatches == n + 1
    assert (r.layer, r.token, r.tensor) == (0, _first_diff(ids_a, ids_b), "k") == (0, 5, "k")
    assert r.layer_max_abs_diff[0] > 0.1


def test_positions_shifted_by_one_are_named(eng):
    ids = eng.tokenizer.encode(TEXT_A)
    seq = eng.add_request(ids, SamplingParams(max_tokens=2), namespace=eng.isolated_namespace("shift"))
    faults.shift_positions(eng, seq, 20, 28)  # tokens 20..27 get RoPE positions 21..28
    eng.run_until_done([seq])
    r = _report(eng, seq.request_id)
    assert not r.ok
    assert (r.layer, r.token, r.tensor) == (0, 20, "k")  # layer 0: V has no RoPE, only K of tokens 20.. moves
    assert r.logits_max_abs_diff > 1e-3


def test_block_freed_while_referenced_is_named(eng):
    s = sessions_of(eng).open()
    s.send(TEXT_A + " " + TEXT_B, SamplingParams(max_tokens=2))
    st = s.kv
    assert st.num_computed >= 48
    bid = faults.free_while_referenced(eng, st, 2)  # positions 32..47: past the (shared) system prompt
    other = eng.generate([TEXT_B + " " + TEXT_A], SamplingParams(max_tokens=2),
                         namespace=eng.isolated_namespace("other"))[0]  # takes the freed block and overwrites it
    assert _report(eng, other.request_id).ok
    s.send("Summarise that in five words.", SamplingParams(max_tokens=2))
    r = _report(eng, f"{s.id}-t2")
    try:
        assert not r.ok
        assert (r.layer, r.token, r.tensor) == (0, 32, "k")
    finally:
        eng.pool.incref(bid)  # give the session its reference back so that closing it is consistent
        s.close()


def test_sampling_is_seeded_and_compressed_kv_is_skipped(eng):
    a, b = ReuseAuditor(0.3, seed=7), ReuseAuditor(0.3, seed=7)
    draws = [a.sample() for _ in range(400)]
    assert draws == [b.sample() for _ in range(400)]
    assert 80 < sum(draws) < 160
    assert not any(ReuseAuditor(0.0).sample() for _ in range(50))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ReuseAuditor(1.5)
    seq = eng.add_request(TEXT_A, SamplingParams(max_tokens=3), compression=KVCompression("knorm", 0.5))
    seq.kv_holder = lambda s: None  # keep its blocks after it finishes (freed below)
    eng.run_until_done([seq])
    try:
        assert _report(eng, seq.request_id).ok  # audited at its first token, before compression
        assert seq.kv_offset > 0
        skipped = eng.auditor.skipped
        assert eng.auditor.audit(eng, seq, None) is None and eng.auditor.skipped == skipped + 1
    finally:
        eng.kv.free(seq)


def test_kv_audit_command(eng, monkeypatch, capsys, tmp_path):
    import kvkeeper.cli as cli

    fresh = ReuseAuditor(1.0).attach(eng)  # fresh counters for this command
    monkeypatch.setattr(cli.kv, "load_engine", lambda args: eng)
    monkeypatch.setattr(cli.kv, "new_auditor", lambda engine: fresh)
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"id": "x", "turns": ["Say hello.", "Say goodbye."]}) + "\n")
    assert cli.main(["kv", "audit", "--conversations", str(conv), "--max-tokens", "2", "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(out) == 2 and all(r["ok"] for r in out) and out[1]["cached_tokens"] > 0
    seq = eng.add_request(TEXT_B, SamplingParams(max_tokens=1), namespace=eng.isolated_namespace("cli"))
    faults.shift_positions(eng, seq, 3, 4)
    eng.run_until_done([seq])  # one divergent request on the same auditor: the command now exits 1
    assert cli.main(["kv", "audit", "--prompt", "Hi", "--max-tokens", "1"]) == 1
    assert "first divergent layer 0, token 3 (K)" in capsys.readouterr().out
    eng.first_token_hooks.remove(fresh.on_first_token)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4"])
def test_quantized_cache_faults_are_named_above_the_rounding_noise(kv_dtype, mt_bench):
    """With int8/fp8/int4 KV the tolerances sit above quantization noise, yet a foreign block and shifted
    positions are still named at layer 0 and their first token; a clean two-turn session passes."""
    eng = make_engine(num_kv_blocks=160, validate_every=0, kv_dtype=kv_dtype, block_size=16)
    eng.auditor = ReuseAuditor(1.0).attach(eng)
    s = SessionManager(eng).open()
    for turn in mt_bench[0]["turns"]:
        s.send(turn, SamplingParams(max_tokens=16))
    assert eng.auditor.total == 2 and eng.auditor.mismatches == 0
    s.close()
    ns_a, ns_b = eng.isolated_namespace("a"), eng.isolated_namespace("b")
    ids_a = eng.tokenizer.encode(TEXT_A)
    ids_b = ids_a[:5] + eng.tokenizer.encode(TEXT_B)
    eng.generate([ids_a], SamplingParams(max_tokens=2), namespace=ns_a)
    bid, _ = eng.pool.lookup(None, ns_a, ids_a[:16])
    seq = eng.add_request(ids_b, SamplingParams(max_tokens=2), namespace=ns_b)
    faults.reuse_foreign_block(eng, seq, bid)
    eng.run_until_done([seq])
    r = _report(eng, seq.request_id)
    assert not r.ok and (r.layer, r.token, r.tensor) == (0, 5, "k")
    seq = eng.add_request(ids_a, SamplingParams(max_tokens=2), namespace=eng.isolated_namespace("shift"))
    faults.shift_positions(eng, seq, 20, 28)
    eng.run_until_done([seq])
    r = _report(eng, seq.request_id)
    if kv_dtype == "int4":  # int4's looser tolerance: the shift is named at layer 0, within the shifted tokens
        assert not r.ok and r.layer == 0 and 20 <= r.token < 28 and r.tensor == "k", (r.layer, r.token)
    else:
        assert not r.ok and (r.layer, r.token, r.tensor) == (0, 20, "k")


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_kv_audit_limit_below_one_is_refused(limit, tmp_path, monkeypatch, capsys):
    # --limit -1 (or 0) audited nothing and exited 0: "no divergence" for a run that checked no request
    import kvkeeper.cli as cli

    monkeypatch.setattr(cli.kv, "load_engine", lambda args: pytest.fail("the model was loaded"))
    f = tmp_path / "c.jsonl"
    f.write_text('{"turns": ["Hi"]}\n')
    with pytest.raises(SystemExit) as e:
        cli.main(["kv", "audit", "--conversations", str(f), "--limit", limit])
    assert e.value.code == 2 and "--limit" in capsys.readouterr().err
