"""Logits processors and the batched sampler against plain-torch reference implementations (no model).

Each reference is written from its source (OpenAI's penalty formula, CTRL's repetition penalty as
transformers applies it, min-p as vLLM applies it, vLLM's bad words), one row at a time; the
processors run batched, mixed with rows that have none (which must come out untouched).
"""

from __future__ import annotations

import pytest
import torch

from kvkeeper.errors import InvalidRequestError
from kvkeeper.sampling.params import SamplingParams
from kvkeeper.sampling.processors import apply_processors, build_processors
from kvkeeper.sampling.sampler import _filter, prompt_logprob_entries, sample

V = 64


def ref_logit_bias(logits, bias):
    out = logits.clone()
    for t, b in bias.items():
        out[t] += b
    return out


def ref_penalties(logits, output, prompt, presence, frequency, repetition):
    out = logits.clone()
    if repetition != 1:  # CTRL (Keskar et al. 2019) as transformers' RepetitionPenaltyLogitsProcessor
        for t in set(prompt) | set(output):
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):  # OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        c = output.count(t)
        out[t] -= c * frequency + presence
    return out


def ref_bad_words(logits, output, words):
    out = logits.clone()
    for w in words:
        if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1]):
            out[w[-1]] = float("-inf")
    return out


def _run(params: SamplingParams, prompt: list[int], output: list[int], bad=None):
    procs = build_processors(params, prompt, V, bad)
    for t in output:
        procs.accept(t)
    return procs


CASES = [
    (SamplingParams(logit_bias={3: -100.0, 7: 100.0, 9: 2.5}), lambda l, o, p: ref_logit_bias(l, {3: -100, 7: 100, 9: 2.5})),
    (SamplingParams(presence_penalty=1.5), lambda l, o, p: ref_penalties(l, o, p, 1.5, 0, 1)),
    (SamplingParams(frequency_penalty=-0.7), lambda l, o, p: ref_penalties(l, o, p, 0, -0.7, 1)),
    (SamplingParams(repetition_penalty=1.8), lambda l, o, p: ref_penalties(l, o, p, 0, 0, 1.8)),
    (SamplingParams(repetition_penalty=0.6, presence_penalty=0.5, frequency_penalty=0.25),
     lambda l, o, p: ref_penalties(l, o, p, 0.5, 0.25, 0.6)),
]


def test_each_processor_equals_its_reference_batched_with_plain_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * len(CASES) + 1, V, generator=g) * 3  # case k in row 2k, plain rows between
    prompt = [1, 2, 3, 5, 8]
    outputs = [[int(x) for x in torch.randint(0, V, (12,), generator=g)] for _ in range(logits.shape[0])]
    procs = [None] * logits.shape[0]
    for k, (params, _) in enumerate(CASES):
        procs[2 * k] = _run(params, prompt, outputs[2 * k])
    got = apply_processors(logits, procs)
    assert set(got) == {i for i, p in enumerate(procs) if p is not None}
    for k, (_, ref) in enumerate(CASES):
        i = 2 * k
        torch.testing.assert_close(got[i], ref(logits[i], outputs[i], prompt), rtol=0, atol=1e-5)


def test_bad_words_ban_the_last_token_after_the_others():
    words = [[5], [10, 11], [20, 21, 22]]
    logits = torch.zeros(3, V)
    outs = [[1, 10], [20, 21], [20, 2]]
    procs = [_run(SamplingParams(bad_words=["x"]), [], o, words) for o in outs]
    got = apply_processors(logits, procs)
    for i, o in enumerate(outs):
        assert torch.equal(got[i], ref_bad_words(logits[i], o, words))
    assert got[0][11] == float("-inf") and got[1][22] == float("-inf") and got[2][22] == 0 and got[2][5] == float("-inf")


def test_processors_change_the_pick_and_rows_without_them_are_untouched():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [0.0, 5.0, 1.0, 0.0]])
    logits = torch.nn.functional.pad(logits, (0, V - 4))
    banned = SamplingParams(logit_bias={1: -100.0})
    plain = SamplingParams()
    procs = [build_processors(banned, [], V), build_processors(plain, [], V)]
    assert procs[1] is None  # no processors at all: the fast path
    before = logits.clone()
    ids, _ = sample(logits, [banned, plain], [None, None], procs)
    assert ids == [2, 1]  # -100 removes the best token; the plain row keeps it
    assert torch.equal(logits, before)  # the raw logits (hooks, logprobs) are never changed
    forced = SamplingParams(logit_bias={3: 100.0})
    assert sample(logits, [forced], [None], [build_processors(forced, [], V)])[0] == [3]


def ref_min_p(logits, min_p):
    probs = torch.softmax(logits, -1)
    return torch.where(probs >= min_p * probs.max(), logits, torch.full_like(logits, float("-inf")))


def test_min_p_filter_equals_reference():
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        logits = torch.randn(V, generator=g) * 2
        for mp in (0.05, 0.3, 0.9):
            assert torch.equal(_filter(logits, 0, 1.0, mp), ref_min_p(logits, mp))
    # a sampled token always passes the filter (vLLM order: temperature, then min_p)
    logits = torch.randn(V, generator=g)
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=3)
    from kvkeeper.sampling.sampler import make_generator
    gen = make_generator(p)
    allowed = torch.isfinite(ref_min_p(logits, 0.5)).nonzero().flatten().tolist()
    for _ in range(30):
        assert sample(logits[None], [p], [gen])[0][0] in allowed


def test_prompt_logprob_entries_equal_log_softmax_and_rank():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, V, generator=g)
    targets = [3, 9, 0, 63]
    got = prompt_logprob_entries(logits, targets, 2)
    lp = torch.log_softmax(logits, -1)
    for e, row, t in zip(got, lp, targets):
        assert e["token_id"] == t and e["logprob"] == pytest.approx(float(row[t]), abs=1e-6)
        assert e["rank"] == int((row > row[t]).sum()) + 1
        assert [i for i, _ in e["top"]] == torch.topk(row, 2).indices.tolist()


@pytest.mark.parametrize("kw,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"stop_token_ids": [-2]}, "stop_token_ids"), ({"bad_words": [" "]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_out_of_range_values_name_their_field(kw, param):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kw)
    assert ei.value.param == param


def test_a_tiny_temperature_samples_greedily_instead_of_crashing():
    # schemathesis sent temperature 6.25e-270: logits / T overflowed (T is 0 in float32) and
    # torch.multinomial raised on NaN probabilities, failing the engine step (a 500)
    import torch

    from kvkeeper.sampling.params import SamplingParams
    from kvkeeper.sampling.sampler import make_generator, sample

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t, seed=1) for t in (6.25e-270, 1e-6, 1e-4)]
    ids, _ = sample(logits, params, [make_generator(p) for p in params])
    assert ids == logits.argmax(-1).tolist()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    """vLLM's min_tokens: EOS (unless ignore_eos) and stop_token_ids are -inf for the first min_tokens tokens, and
    untouched after; other tokens never; min_tokens above max_tokens is refused naming it."""
    eos, stop = [2, 5], [9]
    logits = torch.randn(3, V)
    procs = [build_processors(SamplingParams(min_tokens=2, stop_token_ids=stop), [1], V, eos_token_ids=eos),
             None,
             build_processors(SamplingParams(min_tokens=1, ignore_eos=True, stop_token_ids=stop), [1], V,
                              eos_token_ids=eos)]
    for step in range(3):
        got = apply_processors(logits, procs)
        masked0 = [t for t in range(V) if got[0][t] == float("-inf")]
        assert masked0 == (sorted(eos + stop) if step < 2 else []), step
        assert torch.equal(got[0][[t for t in range(V) if t not in eos + stop]],
                           logits[0, [t for t in range(V) if t not in eos + stop]])
        assert [t for t in range(V) if got[2][t] == float("-inf")] == (stop if step < 1 else [])  # EOS ignored
        assert 1 not in got  # the row without processors is untouched
        for p in (procs[0], procs[2]):
            p.accept(7)
    assert build_processors(SamplingParams(min_tokens=0), [1], V, eos_token_ids=eos) is None
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert e.value.param == "min_tokens"
