"""Issue 26: on the default path (GGUF blocks in place, bf16 KV, the C++ kernels) a token's K/V and logits depend
only on the token ids before it, bit for bit: not on prefill chunks, prefix-cache hits, session hand-overs, decode
vs prefill, the batch, fused vs layer-by-layer steps or the thread count.

Each test fails with the previous decode kernel (``KVK_TEST_OLD_KERNELS=1`` runs them with
``set_invariant_attention(False)``: they then fail at the first decoded token's KV, off by a bf16 step).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvkeeper import SamplingParams
from kvkeeper.attention.metadata import AttentionMetadata, PrefillSpan
from kvkeeper.diagnostics.audit import recompute_prompt
from kvkeeper.diagnostics.kvdump import dump_prompt, dump_session
from kvkeeper.kernels import cpu as cpu_kernels
from kvkeeper.kvcache.store import KVStore
from kvkeeper.sessions import SessionManager
from kvkeeper.worker.runner import StepBatch

from tests.utils.engines import make_engine

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels are not built")

OLD = os.environ.get("KVK_TEST_OLD_KERNELS") == "1"
QUESTIONS = ["Name three colours.", "And three animals?", "Which of them is the largest?", "Why?",
             "Say it in French.", "Now in one word.", "Translate 'glossary' into German.", "Thanks, summarise."]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


def _engine(**settings):
    eng = make_engine(quantization="gguf", validate_every=0, num_kv_blocks=256,
                      invariant_kernels=not OLD, **settings)
    assert eng.runner.weight_format == "gguf" and eng.runner.kv_format.storage == torch.bfloat16
    return eng


@pytest.fixture(scope="module")
def eng():
    return _engine()


def _threads(n: int):
    class _T:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)
    return _T()


def _equal_dumps(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in sorted(a, key=lambda n: (int(n.split(".")[1]), n)):
        d = (a[name].float() - b[name].float()).abs()
        assert torch.equal(a[name], b[name]), f"{name}: max difference {float(d.max())} at token " \
                                              f"{int((d.flatten(1).amax(1) > 0).nonzero()[0])}"


class _Reference:
    """The reference engine's from-scratch results, each computed once per module for the same ids at the same
    thread count: the sessions of several tests (every split, the fused and layer-by-layer steps) reach the same
    prompts, whose recomputation is the same work each time."""

    def __init__(self, eng):
        self.eng, self.done = eng, {}

    def _once(self, kind: str, ids: list[int], compute):
        key = (kind, torch.get_num_threads(), tuple(ids))
        if key not in self.done:
            self.done[key] = compute()
        return self.done[key]

    def recompute(self, ids: list[int]):
        """(token ids, logprobs) of ``ids`` generated from scratch on the reference engine (no cache shared)."""
        def run():
            out = self.eng.generate([ids], GREEDY, namespace=self.eng.isolated_namespace())[0]
            return out.token_ids, out.logprobs
        return self._once("generate", ids, run)

    def generate(self, ids: list[int], params):
        """The ``RequestOutput`` of ``ids`` generated from scratch with ``params`` (greedy) on the reference."""
        return self._once(f"generate {params!r}", ids,
                          lambda: self.eng.generate([ids], params, namespace=self.eng.isolated_namespace())[0])

    def dump(self, ids: list[int]) -> dict:
        """``dump_prompt`` of ``ids`` prefilled from scratch on the reference: {name: KV tensor}."""
        return self._once("dump", ids, lambda: dump_prompt(self.eng, ids, namespace=self.eng.isolated_namespace())[0])


@pytest.fixture(scope="module")
def ref(eng):
    return _Reference(eng)


def _conversation(eng, ref: _Reference, turns: int, companions: int = 0) -> int:
    """``turns`` turns of one session on ``eng`` (each reusing the session's KV), each compared with the same
    prompt ids recomputed from scratch on ``ref.eng``: token ids, logprobs (bitwise) and the session's KV after the
    turn (max difference 0).  companions: other requests running beside each turn (a batch of 1 + companions)."""
    sessions = SessionManager(eng)
    s = sessions.open()
    reused = 0
    try:
        for i, q in enumerate(QUESTIONS[:turns]):
            seq = s.begin_turn(messages=s.messages + [{"role": "user", "content": q}], params=GREEDY)
            others = [eng.add_request(f"{q} (companion {j}) " * (j + 1), SamplingParams(max_tokens=5 + j),
                                      namespace=eng.isolated_namespace()) for j in range(companions)]
            eng.run_until_done([seq, *others])
            prompt = list(seq.token_ids[: seq.num_prompt_tokens])
            reused += seq.num_cached_tokens or 0
            ids, lps = ref.recompute(prompt)
            assert list(seq.output_token_ids) == ids, f"turn {i + 1}: tokens differ"
            assert seq.logprobs == lps, f"turn {i + 1}: logprobs differ"
            kept, _ = dump_session(sessions, s.id)
            fresh = ref.dump(list(s.kv.token_ids[: s.kv.num_computed]))
            _equal_dumps(kept, fresh)
    finally:
        s.close()
    return reused


def test_eight_turns_through_a_session_equal_recompute_bit_for_bit(eng, ref):
    assert eng.runner.invariant != OLD
    reused = _conversation(eng, ref, 8)
    assert reused > 0  # the later turns really took the earlier turns' KV from the session


def test_reuse_off_recomputes_the_same_ids(eng):
    """A session with reuse=False (the baseline of the terminology evaluation) prompts each turn with the ids of
    the reuse rule, recomputed from scratch: the same prompts, tokens and logprobs as the reusing session, turn by
    turn (its history is not re-tokenized from text, which can split the generated tokens differently)."""
    (a_id,) = eng.tokenizer.encode("a", add_special_tokens=False)
    # the first reply is "a" eight times, one token each: as text, "aaaaaaaa" tokenizes into fewer, longer tokens
    first = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, logit_bias={a_id: 100.0})
    sessions = SessionManager(eng)
    on, off = sessions.open(), sessions.open(reuse=False)
    try:
        for i, q in enumerate(QUESTIONS[:4]):
            p = first if i == 0 else GREEDY
            a = on.begin_turn(messages=on.messages + [{"role": "user", "content": q}], params=p)
            b = off.begin_turn(messages=off.messages + [{"role": "user", "content": q}], params=p)
            eng.run_until_done([a, b])
            assert list(a.token_ids[: a.num_prompt_tokens]) == list(b.token_ids[: b.num_prompt_tokens]), f"turn {i + 1}"
            assert list(a.output_token_ids) == list(b.output_token_ids) and a.logprobs == b.logprobs, f"turn {i + 1}"
            assert not b.num_cached_tokens and (i == 0 or a.num_cached_tokens)
            if i == 0:
                assert list(a.output_token_ids) == [a_id] * 8
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("chunk,threads,companions", [(1, 2, 0), (7, 2, 0), (16, 1, 0), (512, 1, 8), (7, 2, 8)])
def test_turns_equal_recompute_whatever_the_split(eng, ref, chunk, threads, companions):
    """Chunked prefill of 1, 7, 16, 512 tokens, a batch of 1 or of 9 (8 other requests beside the turn), 1 or 2
    threads: the turns of a session equal a one-piece recompute on the default engine (512-token chunks, alone)."""
    other = _engine(max_num_batched_tokens=chunk)
    with _threads(threads):
        _conversation(other, ref, 3, companions)


LONG = ("The archive keeps every letter the harbour master wrote between 1881 and 1907, sorted by ship and by "
        "cargo, with a note on the weather of each day. ") * 25


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_across_segment_boundaries_equals_prefill(eng, ref, threads):
    """A turn whose decode crosses the invariant kernels' fixed split points (every 512 keys: decode runs a long
    context's segments in parallel and combines them, prefill combines the same segments) keeps the KV and logprobs
    of the same ids prefilled, bit for bit: the prompt ends a few tokens before 1,024 keys, 24 tokens are decoded."""
    sessions = SessionManager(eng)
    s = sessions.open()
    ids = eng.encode_chat([{"role": "user", "content": LONG}])
    assert 1024 - 40 < len(ids) < 1024 - 4, len(ids)  # the decoded tokens cross key 1,024
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    try:
        with _threads(threads):
            seq = s.begin_turn(messages=[{"role": "user", "content": LONG}], params=params)
            eng.run_until_done([seq])
        out = ref.generate(list(seq.token_ids[: seq.num_prompt_tokens]), params)  # the same for both thread counts
        assert list(seq.output_token_ids) == out.token_ids and seq.logprobs == out.logprobs
        kept, _ = dump_session(sessions, s.id)
        fresh = ref.dump(list(s.kv.token_ids[: s.kv.num_computed]))
        assert s.kv.num_computed > 1024
        _equal_dumps(kept, fresh)
    finally:
        s.close()


def test_fused_and_layer_by_layer_decode_equal(eng, ref):
    other = _engine(fused_decode=False)
    assert other.runner.fused_decode is None
    _conversation(other, ref, 2)


def _prefill_split(runner, ids: list[int], cuts: list[int], companions: list[list[int]]) -> KVStore:
    """Prefill ``ids`` in steps ending at ``cuts`` (and at len(ids)), each step packing the next piece of every
    companion prompt beside it (one piece per step), into a private store; returns the store (the target's
    blocks first)."""
    bs = runner.block_size
    prompts = [ids, *companions]
    nblocks = [-(-len(p) // bs) for p in prompts]
    store = KVStore.allocate(runner.cfg, sum(nblocks), bs, runner.kv_format, runner.device)
    tables, first = [], 0
    for n in nblocks:
        tables.append(torch.arange(first, first + n, dtype=torch.int64))
        first += n
    ends = sorted(set(c for c in cuts if 0 < c < len(ids))) + [len(ids)]
    done = [0] * len(prompts)
    for step, end in enumerate(ends):
        tok, pos, spans = [], [], []
        for i, p in enumerate(prompts):
            stop = end if i == 0 else min(len(p), done[i] + max(1, len(p) // len(ends)) + step % 3)
            if stop <= done[i]:
                continue
            spans.append(PrefillSpan(len(tok), stop - done[i], stop, tables[i]))
            tok += p[done[i]:stop]
            pos += list(range(done[i], stop))
            done[i] = stop
        ids_t = torch.tensor(tok, dtype=torch.int64)
        pos_t = torch.tensor(pos, dtype=torch.int64)
        slots = torch.cat([sp.block_table[pos_t[sp.start: sp.start + sp.q_len] // bs] * bs
                           + pos_t[sp.start: sp.start + sp.q_len] % bs for sp in spans])
        meta = AttentionMetadata(slot_mapping=slots, prefills=spans, backend=runner.attention_backend)
        with torch.inference_mode():
            runner.forward(StepBatch(ids_t, pos_t, meta, [], []), "none", store=store)
    return store


@settings(max_examples=4, deadline=None, phases=[Phase.generate], suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_splits_and_companions_give_bitwise_equal_kv(eng, data):
    """Hypothesis: a prompt prefilled in random pieces beside random other prompts has the KV of its one-piece
    prefill, bit for bit, in every layer."""
    runner = eng.runner
    ids = eng.encode_chat([{"role": "user", "content": QUESTIONS[data.draw(st.integers(0, 7))] * 3}])
    cuts = data.draw(st.lists(st.integers(1, len(ids) - 1), max_size=6))
    comp = data.draw(st.lists(st.lists(st.integers(1, 5000), min_size=1, max_size=40), max_size=3))
    _, whole = recompute_prompt(runner, ids)
    split = _prefill_split(runner, ids, cuts, comp)
    table = torch.arange(-(-len(ids) // runner.block_size), dtype=torch.int64)
    for layer in range(whole.num_layers):
        for name, a, b in zip("kv", whole.layer(layer).gather(table, len(ids), torch.float32),
                              split.layer(layer).gather(table, len(ids), torch.float32)):
            assert torch.equal(a, b), f"layer {layer} {name}: max difference {float((a - b).abs().max())}"


def test_exact_audit_names_one_flipped_bit_and_passes_clean_traffic(eng):
    """On the invariant path the reuse audit's tolerance is 0: clean turns of a session report no mismatch, and
    one flipped bit (the lowest mantissa bit of one bf16 K value of a cached block) is reported with its layer
    and token."""
    from kvkeeper.diagnostics.audit import EXACT, ReuseAuditor, default_tolerance

    r = eng.runner
    assert default_tolerance(r.dtype, r.kv_format, r.weight_format, r.invariant) == (
        EXACT if not OLD else default_tolerance(r.dtype, r.kv_format, r.weight_format))
    auditor = ReuseAuditor(1.0).attach(eng)
    try:
        sessions = SessionManager(eng)
        s = sessions.open()
        for q in QUESTIONS[:3]:
            s.send(q, SamplingParams(max_tokens=8, temperature=0.0))
        s.close()
        assert auditor.total == 3 and auditor.mismatches == 0, [x.summary() for x in auditor.reports]
        ids = eng.encode_chat([{"role": "user", "content": QUESTIONS[6] * 3}])
        ns = eng.isolated_namespace("flip")
        eng.generate([ids], SamplingParams(max_tokens=1), namespace=ns)  # its full blocks stay cached
        b0, h0 = eng.pool.lookup(None, ns, ids[:16])
        b1, _ = eng.pool.lookup(h0, ns, ids[16:32])
        assert b0 is not None and b1 is not None
        layer, token, head, dim = 7, 16 + 5, 1, 3
        k = eng.kv.store.layer(layer).k.view(torch.int16)
        k[b1, token - 16, head, dim] ^= 1  # one bit of one cached K value
        try:
            seq = eng.add_request(ids + ids[-3:], SamplingParams(max_tokens=2), namespace=ns)
            eng.run_until_done([seq])
        finally:
            k[b1, token - 16, head, dim] ^= 1
        rep = next(x for x in auditor.reports if x.request_id == seq.request_id)
        assert seq.num_cached_tokens >= 32
        assert not rep.ok and (rep.layer, rep.token, rep.tensor) == (layer, token, "k"), rep.summary()
        assert 0 < rep.kv_max_abs_diff < 0.1  # one step of the last bf16 mantissa bit
    finally:
        eng.first_token_hooks.remove(auditor.on_first_token)
