"""Sampling features on the real model, against references in plain torch on transformers' own logits.

The engine decodes a batch of greedy requests, each with one feature (and one plain request,
which must be unchanged by its neighbours).  transformers' model then scores each output in one
forward pass, and at every step the plain-torch reference of the feature (the same formulas as
tests/unit/sampling/test_sampling_processors.py) is applied to its logits: the engine's token must be the
reference's argmax (up to a 1e-3 near-tie, the two implementations' float noise).  The prompt
logprobs of the engine (``prompt_logprobs``) equal transformers' log-softmax at every position.
"""

from __future__ import annotations

import pytest
import torch

from kvkeeper import SamplingParams
from tests.unit.sampling.test_sampling_processors import ref_bad_words, ref_logit_bias, ref_penalties

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Repeat the word banana twenty times."}]
N = 16


def _cases(engine, first: int):
    word = engine.inputs.word_ids("banana")
    return {
        "plain": (SamplingParams(max_tokens=N), lambda l, o, p: l),
        "logit_bias -100": (SamplingParams(max_tokens=N, logit_bias={first: -100.0}),
                            lambda l, o, p: ref_logit_bias(l, {first: -100.0})),
        "logit_bias +100": (SamplingParams(max_tokens=N, logit_bias={28: 100.0}),
                            lambda l, o, p: ref_logit_bias(l, {28: 100.0})),
        "presence": (SamplingParams(max_tokens=N, presence_penalty=2.0), lambda l, o, p: ref_penalties(l, o, p, 2, 0, 1)),
        "frequency": (SamplingParams(max_tokens=N, frequency_penalty=1.5),
                      lambda l, o, p: ref_penalties(l, o, p, 0, 1.5, 1)),
        "repetition": (SamplingParams(max_tokens=N, repetition_penalty=1.3),
                       lambda l, o, p: ref_penalties(l, o, p, 0, 0, 1.3)),
        "bad_words": (SamplingParams(max_tokens=N, bad_words=["banana"]), lambda l, o, p: ref_bad_words(l, o, word)),
    }


def test_each_feature_decodes_as_its_reference_on_transformers_logits(engine, hf_reference):
    prompt = engine.encode_chat(PROMPT)
    first = engine.generate([prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    cases = _cases(engine, first)
    outs = dict(zip(cases, engine.generate([prompt] * len(cases), [p for p, _ in cases.values()])))
    plain = outs["plain"].token_ids
    for name, (params, ref) in cases.items():
        got = outs[name].token_ids
        if name != "plain":
            assert got != plain, f"{name} changed nothing"
        with torch.no_grad():
            logits = hf_reference(torch.tensor([prompt + got])).logits[0].float()
        for t, tok in enumerate(got):
            adj = ref(logits[len(prompt) - 1 + t], got[:t], prompt)
            assert adj[tok] >= adj.max() - 1e-3, f"{name}: step {t} picked {tok}, the reference {int(adj.argmax())}"
    assert outs["logit_bias +100"].token_ids == [28] * N  # +100 forces the token
    assert first not in outs["logit_bias -100"].token_ids[:1]  # -100 removes it
    for w in engine.inputs.word_ids("banana"):
        ids = outs["bad_words"].token_ids
        assert not any(ids[i:i + len(w)] == w for i in range(len(ids))), "a banned word was generated"


def test_prompt_logprobs_equal_transformers(engine, hf_reference):
    ids = engine.tokenizer.encode("The history of cartography spans many centuries, from clay tablets to satellites.")
    seq = engine.add_request(ids, SamplingParams(max_tokens=1, prompt_logprobs=3))
    engine.run_until_done([seq])
    with torch.no_grad():
        ref = torch.log_softmax(hf_reference(torch.tensor([ids])).logits[0].float(), -1)
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        e = seq.prompt_logprobs[p]
        assert e["token_id"] == ids[p] and abs(e["logprob"] - float(ref[p - 1, ids[p]])) < 1e-3
        assert abs(e["rank"] - (int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1)) <= 1  # +-1: near-ties
        assert [t for t, _ in e["top"]] == torch.topk(ref[p - 1], 3).indices.tolist()
