"""End-to-end checks of the engine on the real embedded model (SmolLM2-135M-Instruct): against transformers on
float32 weights (the ``engine`` fixture), and against itself (reuse with recompute, a batch with its requests alone,
a small pool with a large one) on the library's default weight format (``eng``)."""

import pytest
import torch

from kvkeeper import ContextLengthError, InvalidRequestError, ModelNotFoundError, SamplingParams
from tests.utils.sessionutil import sessions_of
from tests.utils.engines import make_engine

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16)
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Photosynthesis is the process by which",
]


@pytest.fixture(scope="module")
def eng():
    """The embedded model on the library's default weight format (its GGUF blocks in place, bf16 KV), where a token
    depends only on the ids before it, bit for bit (tests/unit/engine/test_invariance.py), and a decode token costs
    13 ms of CPU against 43 ms on float32 (one thread, the 2-core AMD EPYC, quiet)."""
    return make_engine(quantization=None)


@pytest.fixture(scope="module")
def parity_prompts(engine, mt_bench):
    """Both turns of the first 6 MT-Bench questions (turn 2 after our turn-1 reply) plus raw text prompts."""
    prompts = []
    firsts = [engine.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in mt_bench[:6]]
    replies = engine.generate(firsts, GREEDY)
    for q, ids, rep in zip(mt_bench[:6], firsts, replies):
        prompts.append(ids)
        prompts.append(engine.encode_chat([
            {"role": "user", "content": q["turns"][0]},
            {"role": "assistant", "content": rep.text},
            {"role": "user", "content": q["turns"][1]},
        ]))
    prompts += [engine.tokenizer.encode(p) for p in RAW_PROMPTS]
    return prompts


def test_greedy_and_logits_match_transformers(engine, hf_reference, parity_prompts):
    assert len(parity_prompts) >= 16
    engine.capture_first_logits = True
    try:
        seqs = [engine.add_request(p, GREEDY) for p in parity_prompts]
        engine.run_until_done(seqs)
    finally:
        engine.capture_first_logits = False
    worst = 0.0
    for p, seq in zip(parity_prompts, seqs):
        out = list(seq.output_token_ids)
        # teacher forcing: one forward of the prompt and our reply; transformers' greedy choice at every position
        # of the reply equals our token there exactly when its greedy generation equals our reply (an end-of-
        # sequence token included), so this is generate()'s check in one pass instead of len(out) steps
        ids = torch.tensor([p + out[:-1]])
        with torch.no_grad():
            logits = hf_reference(ids).logits[0, len(p) - 1:].float()
        worst = max(worst, (seq.first_logits - logits[0]).abs().max().item())
        assert logits.argmax(-1).tolist() == out, f"prompt of {len(p)} tokens diverges from transformers"
    assert worst < 1e-3, f"last-position logits differ by {worst}"


def test_turn_reuse_equals_full_recompute(eng, mt_bench):
    params = SamplingParams(max_tokens=32)
    for q in mt_bench[10:13]:
        s = sessions_of(eng).open()
        prev = None
        try:
            for i, turn in enumerate(q["turns"] + ["Summarise your answers in one sentence."]):
                r = s.send(turn, params)
                if prev is None:
                    assert r.cached_tokens < r.prompt_tokens
                else:
                    # the new prompt extends the previous prompt and reply; all of it but the
                    # reply's last token (never fed back) is reused
                    history = prev.prompt_token_ids + prev.token_ids
                    assert r.prompt_token_ids[: len(history)] == history
                    assert r.cached_tokens == len(history) - 1
                # the same prompt recomputed from scratch, with no cache at all
                full = eng.generate([r.prompt_token_ids], params, namespace=eng.isolated_namespace())[0]
                assert full.cached_tokens == 0
                assert full.token_ids == r.token_ids, f"turn {i + 1} of question {q['question_id']}"
                prev = r
        finally:
            s.close()
    assert eng.pool.num_used == 0, "closed sessions must release every block"


def _first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _assert_same_or_near_tie(alone, other, label):
    """Same greedy tokens, or the first difference sits at a near-tie of the solo run (top-2 gap < 1e-3)."""
    i = _first_divergence(alone.token_ids, other.token_ids)
    if i is None:
        return
    top = alone.logprobs[i]["top"]
    gap = top[0][1] - top[1][1]
    assert gap < 1e-3 and {alone.token_ids[i], other.token_ids[i]} <= {top[0][0], top[1][0]}, (
        f"{label}: token {i} differs ({alone.token_ids[i]} vs {other.token_ids[i]}) with top-2 gap {gap}")


def test_batch_invariance(eng, mt_bench):
    prompts = [eng.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in mt_bench[20:28]]
    assert len({len(p) for p in prompts}) >= 6, "prompts of different lengths"
    params = SamplingParams(max_tokens=12, logprobs=2)
    alone = [eng.generate([p], params, namespace=eng.isolated_namespace())[0] for p in prompts]
    sched = eng.scheduler
    saved = (sched.enable_chunked_prefill, sched.max_num_batched_tokens, eng.validate_every)
    eng.validate_every = 0  # the test itself holds raw pool blocks, which no block table owns
    try:
        for chunked, budget in ((True, 64), (True, 512), (False, 512)):
            sched.enable_chunked_prefill, sched.max_num_batched_tokens = chunked, budget
            # move the blocks: hold a varying number of blocks so the batch lands elsewhere in the pool
            held = eng.pool.allocate(17 if chunked else 113)
            try:
                order = list(range(len(prompts)))[::-1]
                outs = eng.generate([prompts[i] for i in order], params, namespace=eng.isolated_namespace())
            finally:
                eng.pool.free_all(held)
            for i, out in zip(order, outs):
                _assert_same_or_near_tie(alone[i], out, f"prompt {i}, chunked={chunked}, budget={budget}")
    finally:
        sched.enable_chunked_prefill, sched.max_num_batched_tokens, eng.validate_every = saved
    assert eng.pool.num_used == 0


def test_preemption_small_pool_completes_with_same_outputs(eng, mt_bench):
    prompts = [eng.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in mt_bench[30:35]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    big = eng.generate(prompts, params, namespace=eng.isolated_namespace())
    need = sum(-(-(len(p) + 24) // 16) for p in prompts)
    small = make_engine(num_kv_blocks=max(len(max(prompts, key=len)) // 16 + 4, need // 3), max_num_batched_tokens=128,
                        quantization=None)
    assert small.pool.num_blocks < need
    outs = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0, "the pool was meant to be too small for all requests at once"
    for b, s in zip(big, outs):
        assert s.finish_reason == "length" and s.error is None
        assert s.token_ids == b.token_ids
    assert small.pool.num_used == 0
    small.pool.check_invariants()


def test_request_that_can_never_fit_fails_cleanly():
    eng = make_engine(num_kv_blocks=4, block_size=16)
    out = eng.generate(["word " * 100], SamplingParams(max_tokens=4))[0]
    assert out.finish_reason == "error" and "KV blocks" in out.error and "raise the KV budget" in out.error
    assert eng.pool.num_used == 0


def test_bad_input_errors(engine):
    n = engine.context_length
    with pytest.raises(ContextLengthError) as e:
        engine.generate([[100] * (n + 5)])
    assert str(n + 5) in str(e.value) and str(n) in str(e.value)
    with pytest.raises(ModelNotFoundError) as e:
        make_engine("no-such-model")
    assert "smollm2-135m-instruct" in str(e.value)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.encode_chat([])
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate([""])
    s = sessions_of(engine).open()
    with pytest.raises(InvalidRequestError, match="empty"):
        s.send("   ")
    assert s.messages == []
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    s.close()
    assert engine.pool.num_used == 0


def test_seeded_sampling_is_reproducible_across_batches(engine):
    p = engine.encode_chat([{"role": "user", "content": "Tell me a short joke."}])
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    a = engine.generate([p], params)[0]
    b = engine.generate([p, engine.tokenizer.encode("Hello"), p], [params, SamplingParams(max_tokens=5), params])
    assert a.token_ids == b[0].token_ids == b[2].token_ids
    c = engine.generate([p], SamplingParams(max_tokens=20, temperature=0.9, seed=99))[0]
    assert c.token_ids != a.token_ids


def test_stop_strings_and_max_tokens(engine):
    p = engine.encode_chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    full = engine.generate([p], SamplingParams(max_tokens=40))[0]
    assert "5" in full.text
    cut = engine.generate([p], SamplingParams(max_tokens=40, stop=["5"]))[0]
    assert cut.finish_reason == "stop" and "5" not in cut.text and full.text.startswith(cut.text)
    short = engine.generate([p], SamplingParams(max_tokens=3))[0]
    assert short.finish_reason == "length" and short.completion_tokens == 3


def test_bfloat16_engine_runs_close_to_fp32(engine):
    p = engine.tokenizer.encode("The capital of France is")
    engine.capture_first_logits = True
    bf = make_engine(dtype="bfloat16", num_kv_blocks=64)
    bf.capture_first_logits = True
    try:
        ref = engine.add_request(p, SamplingParams(max_tokens=1))
        engine.run_until_done([ref])
        got = bf.add_request(p, SamplingParams(max_tokens=1))
        bf.run_until_done([got])
    finally:
        engine.capture_first_logits = False
    assert bf.kv.store[0].k.dtype == torch.bfloat16
    assert bf.kv.bytes_per_token * 2 == engine.kv.bytes_per_token
    assert got.output_token_ids == ref.output_token_ids
    diff = (got.first_logits - ref.first_logits).abs().max().item()
    assert 0 < diff < 1.0, diff  # bf16 differs from fp32, but only by rounding
