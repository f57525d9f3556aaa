"""Issue 30: speculative decoding from the conversation itself (prompt lookup, Predicted Outputs), lossless.

On the default path (GGUF blocks in place, bf16 KV, the invariant C++ kernels: issue 26) a verify row scores each
draft exactly as plain decoding scores that token, so greedy output with speculation must be token-identical to
output without, with the logprobs of every emitted token bit for bit: alone and batched, with prefix-cache hits,
over session turns, with a prediction, and where a stop string, a stop token or max_tokens falls inside an accepted
draft.  The reference engine runs without speculation (and without predictions: its requests send none).
"""

from __future__ import annotations

import argparse

import pytest

from kvkeeper import SamplingParams
from kvkeeper.engine.config import EngineConfig, speculative_arg
from kvkeeper.spec_decode import drafter as drafter_mod
from kvkeeper.spec_decode.config import SpeculativeConfig, parse_speculative_config
from kvkeeper.spec_decode.cost_model import StepCost
from kvkeeper.spec_decode.drafter import Drafter
from kvkeeper.spec_decode.ngram_proposer import NgramIndex
from kvkeeper.spec_decode.suffix_proposer import SuffixTable
from kvkeeper.engine.sequence import Sequence
from kvkeeper.errors import InvalidRequestError
from kvkeeper.kernels import cpu as cpu_kernels
from kvkeeper.kvcache.namespace import Namespace, tenant_namespace
from kvkeeper.sessions import SessionManager

from tests.utils.engines import make_engine
from tests.utils.paths import DATA

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels are not built")

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
        "disable_by_batch_size": None}
SUFFIX = dict(SPEC, method="suffix")


def _passage() -> str:
    text = (DATA / "gutenberg_pride_and_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    start = text.index("It is a truth universally acknowledged")
    return " ".join(text[start:start + 700].split())


COPY = [{"role": "user", "content": "Copy this passage exactly, word for word:\n\n" + _passage()}]
OPEN = [{"role": "user", "content": "Compose an engaging travel blog post about a recent trip to Hawaii."}]


def _greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, **kw)


@pytest.fixture(scope="module")
def ref():
    eng = make_engine(quantization="gguf", validate_every=0, num_kv_blocks=256)
    assert eng.runner.invariant, "the bit-exact comparison needs the invariant path"
    return eng


@pytest.fixture(scope="module")
def spec():
    """Speculation on every step (8 drafts, 1-token n-grams, no batch gate), the KV validators before every step and a
    check that no running sequence holds a block past its computed tokens (a rejected draft's)."""
    eng = make_engine(quantization="gguf", validate_every=1, num_kv_blocks=256, speculative_config=SPEC)
    assert eng.runner.invariant
    # the draft lengths' cost model held fixed (a row 0.1 of a step): fitted to step timings it drafts by the
    # machine's load (seen: an open-ended prompt drafting nothing at load 6); its fit has its own unit test
    eng.drafter.cost.observe = lambda rows, seconds: None
    eng.drafter.cost.base, eng.drafter.cost.per_row = 0.9, 0.1

    def no_draft_blocks_left():  # stricter than the validators' one block of slack: none before a step
        for seq in eng.scheduler.running:
            need = -(-(seq.num_computed - seq.kv_offset) // eng.block_size)
            assert len(seq.block_table) == need, f"{seq.request_id}: {len(seq.block_table)} blocks for {need}"
    eng.step_hooks.append(no_draft_blocks_left)
    return eng


def _same(a, b) -> None:
    """Two outputs (RequestOutput or Sequence) emitted the same tokens, text, finish and logprobs, bit for bit."""
    ids = lambda o: list(o.output_token_ids) if isinstance(o, Sequence) else list(o.token_ids)  # noqa: E731
    assert ids(a) == ids(b)
    assert a.text == b.text and a.finish_reason == b.finish_reason
    assert [(e["token_id"], e["logprob"], e["top"]) for e in a.logprobs] == \
           [(e["token_id"], e["logprob"], e["top"]) for e in b.logprobs]


def _accepted(eng) -> int:
    return eng.drafter.stats.num_accepted_tokens


@needs_kernels
def test_greedy_alone_is_token_identical(ref, spec):
    """A copy-heavy and an open-ended prompt, each alone: the same tokens and logprobs; drafts were accepted."""
    for msgs in (COPY, OPEN):
        before = spec.drafter.stats.num_draft_tokens, _accepted(spec)
        a = ref.generate([ref.encode_chat(msgs)], _greedy())[0]
        b = spec.generate([spec.encode_chat(msgs)], _greedy())[0]
        _same(a, b)
        assert spec.drafter.stats.num_draft_tokens > before[0]
    assert _accepted(spec) > 20  # the copy prompt's drafts are mostly right


@needs_kernels
def test_greedy_batched_with_prefix_hits(ref, spec):
    """Three requests in one batch (a copy, an open-ended one, the copy again: its prompt hits the prefix cache of
    the first) match each one run alone without speculation."""
    ns = spec.isolated_namespace()
    alone = {id(m): ref.generate([ref.encode_chat(m)], _greedy())[0]
             for m in (COPY, OPEN)}
    hits = spec.kv.prefix_tokens()[1]  # prompt tokens found in the prefix cache
    spec.generate([spec.encode_chat(COPY)], _greedy(1), namespace=ns)  # caches the copy prompt
    outs = spec.generate([spec.encode_chat(m) for m in (COPY, OPEN, COPY)], _greedy(), namespace=ns)
    assert spec.kv.prefix_tokens()[1] - hits > 100
    for m, o in zip((COPY, OPEN, COPY), outs):
        _same(alone[id(m)], o)


@needs_kernels
def test_session_turns_are_token_identical(ref, spec):
    """Three turns of a session (the second and third copy earlier turns: drafts from the session's history), each
    turn reusing the session's KV: the same tokens and logprobs as without speculation."""
    turns = [COPY[0]["content"], "Now copy your previous answer again, exactly.", "Say it once more."]
    runs = []
    for eng in (ref, spec):
        s, msgs, outs = SessionManager(eng).open(), [], []
        for text in turns:
            msgs.append({"role": "user", "content": text})
            seq = s.begin_turn(messages=list(msgs), params=_greedy(32))
            eng.run_until_done([seq])
            msgs.append({"role": "assistant", "content": seq.text})
            outs.append(seq)
        runs.append(outs)
    for a, b in zip(*runs):
        _same(a, b)
    assert runs[1][2].num_cached_tokens > 0  # the last turn reused the session's KV
    assert runs[1][1].spec.accepted > 0


@needs_kernels
def test_prediction_drafts_and_counts(ref, spec):
    """A prediction (the expected reply with a few words changed): the same output as without one, drafts taken
    from it, accepted ones and the rejected ones at the changes counted."""
    a = ref.generate([ref.encode_chat(COPY)], _greedy(32))[0]
    edited = a.text.replace("truth", "fact").replace("fortune", "money")
    assert edited != a.text
    seq = spec.add_request(spec.encode_chat(COPY), _greedy(32, prediction=edited))
    spec.run_until_done([seq])
    _same(a, seq)
    assert seq.spec.prediction_accepted > 10 and seq.spec.prediction_rejected > 0


class _Recorder:
    """Wraps the engine's verify to keep, per call, the output length before it, the drafts and the Verified."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, seq, logits, drafts, processor):
        before = seq.num_output_tokens
        got = self.real(seq, logits, drafts, processor)
        self.calls.append((before, list(drafts), got))
        return got


def _ends_at(ids: list[int], tokenizer, kind: str, p: int) -> dict | None:
    """The request fields that end the output at its token ``p`` (None when that token cannot be told apart)."""
    if kind == "length":
        return dict(max_tokens=p + 1)
    if kind == "token":
        return dict(stop_token_ids=[ids[p]]) if ids[p] not in ids[:p] else None
    stop = tokenizer.decode(ids[p - 1:p + 1]).strip()
    return dict(stop=[stop]) if len(stop) > 3 and stop not in tokenizer.decode(ids[:p + 1])[:-len(stop) - 1] else None


@needs_kernels
@pytest.mark.parametrize("kind", ["string", "token", "length"])
def test_stop_inside_an_accepted_draft(ref, spec, monkeypatch, kind):
    """A stop string, a stop token id that fall on an accepted draft token (one the uncut run accepted, past the
    12th), and max_tokens there, end the output exactly where decoding without speculation ends it, in the step
    that accepted that draft."""
    rec = _Recorder(drafter_mod.verify)
    monkeypatch.setattr(drafter_mod, "verify", rec)
    monkeypatch.setattr(spec.drafter.cost, "observe", lambda rows, s: None)  # the same drafts in both runs
    full = spec.generate([spec.encode_chat(COPY)], _greedy(32))[0]
    accepted = [b + i for b, _, got in rec.calls for i in range(got.accepted) if b + i >= 12]
    kw = next(kw for p in accepted if (kw := _ends_at(full.token_ids, spec.tokenizer, kind, p)) is not None)
    params = _greedy(**{"max_tokens": 32, **kw})
    a = ref.generate([ref.encode_chat(COPY)], params)[0]
    rec.calls.clear()
    b = spec.generate([spec.encode_chat(COPY)], params)[0]
    _same(a, b)
    assert a.finish_reason == ("length" if kind == "length" else "stop") and len(a.token_ids) < 32
    _, drafts, last = rec.calls[-1]
    assert last.finished and last.emitted == last.accepted <= len(drafts), \
        f"the output did not end on an accepted draft token: {last.emitted} emitted, {last.accepted} of " \
        f"{len(drafts)} drafts accepted"


@needs_kernels
def test_opt_out_drafts_nothing(ref, spec):
    before = spec.drafter.stats.num_drafts
    b = spec.generate([spec.encode_chat(COPY)], _greedy(24, speculative=False))[0]
    assert spec.drafter.stats.num_drafts == before
    _same(ref.generate([ref.encode_chat(COPY)], _greedy(24))[0], b)


@needs_kernels
def test_drafts_never_cross_tenants(spec, monkeypatch):
    """Tenant A's session plants a distinctive continuation; tenant B's request, whose prompt opens it, gets the
    drafts, acceptance counts and output of an engine that never saw A (a draft store shared across requests
    would draft A's continuation for B and count it accepted)."""
    secret = "Quartz zebras vaccinate the violet harmonica near Oslo at midnight, says Professor Quimby"
    ns_a = tenant_namespace(spec.namespace, "tenant-a", None)
    s = SessionManager(spec).open(tenant="tenant-a")
    for _ in range(2):
        seq = s.begin_turn(messages=[{"role": "user", "content": f"Repeat exactly: {secret}. {secret}."}],
                           params=_greedy(40), namespace=ns_a)
        spec.run_until_done([seq])
    prompt = [{"role": "user", "content": "Continue: Quartz zebras vaccinate"}]

    def run_b(eng):
        seq = eng.add_request(eng.encode_chat(prompt), _greedy(24),
                              namespace=tenant_namespace(eng.namespace, "tenant-b", None))
        eng.run_until_done([seq])
        return seq

    fresh = make_engine(quantization="gguf", validate_every=0, num_kv_blocks=128, speculative_config=SPEC)
    for eng in (spec, fresh):  # the draft lengths' cost model (step timings, engine-wide) held equal on both
        monkeypatch.setattr(eng.drafter.cost, "observe", lambda rows, seconds: None)
        monkeypatch.setattr(eng.drafter.cost, "per_row", 0.1)
        monkeypatch.setattr(eng.drafter.cost, "base", 0.9)
    b, clean = run_b(spec), run_b(fresh)
    _same(clean, b)
    assert (b.spec.drafted, b.spec.accepted) == (clean.spec.drafted, clean.spec.accepted)


@needs_kernels
def test_suffix_drafts_from_the_namespace_earlier_requests_only(ref, monkeypatch):
    """Method "suffix": a request whose reply repeats an earlier request's reply (not in its prompt) in the same
    namespace drafts it from that namespace's suffix table (accepted; the output that of no speculation); the same
    request in another tenant's namespace, or under another cache salt, drafts, accepts and emits exactly what an
    engine that never saw the first request does."""
    eng = make_engine(quantization="gguf", validate_every=0, num_kv_blocks=256, speculative_config=SUFFIX)
    fresh = make_engine(quantization="gguf", validate_every=0, num_kv_blocks=256, speculative_config=SUFFIX)
    for e in (eng, fresh):  # the draft lengths' cost model held equal on both
        monkeypatch.setattr(e.drafter.cost, "observe", lambda rows, seconds: None)
        monkeypatch.setattr(e.drafter.cost, "per_row", 0.1)
        monkeypatch.setattr(e.drafter.cost, "base", 0.9)

    def run(e, ns):
        seq = e.add_request(e.encode_chat(OPEN), _greedy(32), namespace=ns)
        e.run_until_done([seq])
        return seq

    plain = ref.generate([ref.encode_chat(OPEN)], _greedy(32))[0]
    ns_a = tenant_namespace(eng.namespace, "tenant-a", None)
    first = run(eng, ns_a)
    again = run(eng, ns_a)
    _same(plain, first)
    _same(plain, again)
    assert again.spec.accepted >= first.spec.accepted + 16, (first.spec.accepted, again.spec.accepted)
    for ns_of in (lambda e: tenant_namespace(e.namespace, "tenant-b", None), lambda e: e.isolated_namespace("x")):
        b, clean = run(eng, ns_of(eng)), run(fresh, ns_of(fresh))
        _same(clean, b)
        assert (b.spec.drafted, b.spec.accepted) == (clean.spec.drafted, clean.spec.accepted)
        assert b.spec.accepted < again.spec.accepted


# ---- configuration, drafting, adaptivity (no model) ----------------------------------------------------


def test_config_refuses_unknown_fields_by_name():
    with pytest.raises(InvalidRequestError, match="unknown field.*draft_model"):
        parse_speculative_config('{"method": "ngram", "draft_model": "x"}')
    with pytest.raises(InvalidRequestError, match="method 'eagle' is not implemented"):
        parse_speculative_config({"method": "eagle"})
    with pytest.raises(InvalidRequestError, match="prompt_lookup_min"):
        parse_speculative_config({"prompt_lookup_min": 5, "prompt_lookup_max": 3})
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens must be an integer >= 1"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(argparse.ArgumentTypeError, match="must be a JSON object"):
        speculative_arg("ngram")
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative_config
    assert cfg == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(InvalidRequestError, match="speculative false"):
        SamplingParams(prediction="x", speculative=False)


def test_ngram_index_finds_the_latest_earlier_occurrence():
    toks = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    idx = NgramIndex(1, 3)
    idx.sync(toks, len(toks) - 1)
    assert idx.latest(toks) == 7  # [1, 2, 3] last ended at 7 (followed by 8): the end of toks itself is not indexed
    assert idx.first_from(toks, 0) == 3 and idx.first_from(toks, 5) == 7
    assert idx.latest([5, 6]) is None
    assert idx.latest(toks, room=5) == 7 and idx.latest(toks, room=6) == 3  # followed by 5 tokens: the one before


def _seq(tokens, prompt_len, **params) -> Sequence:
    s = Sequence("r", list(tokens), SamplingParams(max_tokens=100, **params), Namespace("m"), num_prompt_tokens=prompt_len)
    s.max_total_tokens = len(tokens) + 100
    s.num_computed = len(tokens) - 1
    return s


def test_drafter_follows_the_prediction_and_resynchronises():
    d = Drafter(None)
    seq = _seq([50, 51, 10], 2)
    d.start(seq, [10, 11, 12, 13, 20, 21, 22, 23, 24], supported=True)
    assert d.propose(seq, 64, 1) == [11, 12, 13, 20, 21]  # prior 4/5, a row 0.12 of a step: 5 drafts are best
    seq.token_ids += [11, 99, 21]  # diverged at 12, back on the prediction at 21 (a 1-token n-gram)
    seq.num_computed = len(seq.token_ids) - 1
    assert d.propose(seq, 64, 1) == [22, 23, 24]
    assert d.propose(seq, 3, 1) == [22, 23]  # the step's budget: the row's own token plus two drafts


def test_step_cost_fits_rows():
    cost = StepCost()
    for _ in range(4):
        cost.observe(1, 0.010)
        cost.observe(5, 0.030)
    assert cost.base == pytest.approx(0.005) and cost.per_row == pytest.approx(0.005)


def test_drafter_adapts_to_acceptance_and_batch():
    d = Drafter(SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_min=1, disable_by_batch_size=4))
    seq = _seq([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1], 4)
    d.start(seq, None, supported=True)
    assert d.propose(seq, 64, 5) == []  # more running sequences than disable_by_batch_size: plain decode
    assert d.propose(seq, 64, 1) == [2, 3]  # prior 1/2, a row 0.12 of a step: 1.75/1.24 beats 1.5/1.12, 1.875/1.36
    for _ in range(5):
        d.record(seq, 1, 1)
    assert seq.spec.rate > 0.85 and d.length(seq.spec, 1) == 6  # accepted: long drafts (6: 5.28/1.72 > 4.73/1.6)
    assert d.propose(seq, 64, 1) == [2, 3, 4, 1, 2, 3]  # after the latest [2, 3, 4, 1] that 6 tokens follow
    for _ in range(3):
        d.cost.observe(1, 0.011)
        d.cost.observe(9, 0.091)  # compute-bound: a row costs ten times the rest of a step
    assert d.length(seq.spec, 4) == 0 and d.propose(seq, 64, 4) == []  # no row pays for itself: a pause
    assert seq.spec.paused_until == seq.num_output_tokens + 16
    assert d.stats.num_drafts == 5 and d.stats.accepted_per_position[:2] == [5, 0]


def test_drafter_pauses_a_sequence_whose_drafts_fail():
    d = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    seq = _seq([5, 6, 7, 5, 6, 7, 5], 3)
    d.start(seq, None, supported=True)
    for _ in range(6):  # estimate 0.08: a draft brings less than the 0.12 of a step its row costs
        d.record(seq, 1, 0)
    assert d.propose(seq, 64, 1) == [] and seq.spec.paused_until == seq.num_output_tokens + 16
    seq.token_ids += [6] * 16
    seq.num_computed = len(seq.token_ids) - 1
    assert d.propose(seq, 64, 1) == [6, 6]  # the pause is over: two drafts, from the prior again


def test_suffix_table_counts_continuations_and_forgets():
    t = SuffixTable(1, 2)
    t.add([1, 2, 3, 4])
    t.add([1, 2, 3, 5])
    t.add([9, 2, 3, 5])
    assert t.draft([7, 1, 2], 4, 0.1) == [3, 5]  # (2, 3) -> 5 twice, 4 once; nothing follows (3, 5)
    assert t.draft([7, 1, 2], 4, 0.7) == [3]  # 5 has 2/3 of (2, 3)'s continuations: below 0.7
    assert t.draft([8], 4, 0.0) == []  # no context of 1..2 tokens occurs
    t.add([1, 2, 3, 5], -1)
    t.add([9, 2, 3, 5], -1)
    assert t.draft([2, 3], 2, 0.1) == [4] and t.docs == 1
    t.add([1, 2, 3, 4], -1)
    assert t.next == {} and t.docs == 0


def test_suffix_drafter_keeps_namespaces_apart_and_bounded():
    d = Drafter(SpeculativeConfig(method="suffix", num_speculative_tokens=4, prompt_lookup_min=1,
                                  suffix_decoding_max_cached_requests=2))
    d.cost.base, d.cost.per_row = 0.9, 0.1
    ns_a, ns_b = Namespace("m", tenant_salt="a"), Namespace("m", tenant_salt="b")

    def done(tokens, ns):
        s = _seq(tokens, 2)
        s.namespace, s.finish_reason = ns, "stop"
        d.start(s, None, supported=True)
        d.finish(s)

    done([40, 41, 10, 11, 12, 13], ns_a)
    seq = _seq([42, 43, 10], 2)  # its own tokens hold no match for 10: the table of its namespace drafts
    seq.namespace = ns_a
    d.start(seq, None, supported=True)
    assert d.propose(seq, 64, 1) == [11, 12]
    assert seq.spec.source == "suffix"
    seq.namespace = ns_b
    assert d.propose(seq, 64, 1) == []  # another tenant's table: none
    done([1, 2], ns_b)
    done([3, 4], ns_b)  # a third request: the oldest (tenant a's) leaves
    seq.namespace = ns_a
    assert d.propose(seq, 64, 1) == [] and ns_a.key not in d.tables
    with pytest.raises(InvalidRequestError, match="suffix_decoding_min_token_prob"):
        SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=2)
