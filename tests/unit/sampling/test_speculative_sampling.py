"""Issue 30: with temperature > 0, speculative decoding leaves the output distribution unchanged.

On a tiny random Llama (a vocabulary of 64 tokens, so sampling is cheap), 2,000 seeded requests sample four tokens
at temperature 1 with top-k 2, once plainly and once (other seeds: independent samples) drafting from a prediction
(the greedy continuation, so drafts are often but not always accepted); the joint distribution of the four tokens
(16 outcomes; tokens 2-4 are decided by verification when drafts ride) must pass a chi-square test of homogeneity
at significance 0.001 between the two samples.  The same test with a wrong rejection rule (on rejection, draw from p
instead of the residual p with the draft removed: the draft becomes likelier than p says) must fail it: the test
has the power to see a wrong acceptance rule.  Every generator is seeded, so the outcome is fixed.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

from kvkeeper import SamplingParams
from kvkeeper.spec_decode import verify as speculative_mod
from kvkeeper.sampling import sampler as sampler_mod

from tests.utils.engines import make_engine
from tests.utils.tiny_models import tiny_llama_folder

N = 2000
ALPHA = 0.001
PROMPT = [1, 40, 23, 35, 53, 56, 30]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    eng = make_engine(str(tiny_llama_folder(tmp_path_factory.mktemp("tiny-spec"), seed=3, vocab_size=64)),
                      num_kv_blocks=512, block_size=4, max_num_seqs=128, validate_every=0)
    eng.drafter.cost.observe = lambda rows, seconds: None  # rows cost nothing: every request drafts what it can
    eng.drafter.cost.per_row = 0.0
    return eng


def _outcomes(eng, prediction: list[int] | None, seed: int) -> Counter:
    """How often each 4-token output came out of N requests seeded ``seed``, ``seed + 1``, ..."""
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True, seed=seed + i,
                             prediction=prediction) for i in range(N)]
    outs = eng.generate([PROMPT] * N, params, namespace=eng.isolated_namespace())
    return Counter(tuple(o.token_ids) for o in outs)


def _p_value(a: Counter, b: Counter) -> float:
    """Chi-square test of homogeneity of two samples of outcomes; outcomes seen fewer than 10 times in both
    samples together are pooled into one cell (the test's expected counts stay above 5)."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest = [sum(c.values()) - sum(c[k] for k in keys) for c in (a, b)]
    table = [[a[k] for k in keys] + [rest[0]], [b[k] for k in keys] + [rest[1]]]
    if rest[0] + rest[1] == 0:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table).pvalue)


def _wrong_rule(logits, p, generator, processors, draft):
    """Accepts the draft with probability p(draft) but on rejection draws from p itself, not the residual."""
    probs = sampler_mod._probs(logits.cpu(), p)
    if float(torch.rand((), generator=generator)) < float(probs[draft]):
        return draft, None
    return int(torch.multinomial(probs, 1, generator=generator).item()), None


def test_sampled_distribution_is_unchanged_and_a_wrong_rule_is_caught(tiny, monkeypatch):
    greedy = tiny.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    plain = _outcomes(tiny, None, 0)
    before = tiny.drafter.stats.num_draft_tokens, tiny.drafter.stats.num_accepted_tokens
    spec = _outcomes(tiny, greedy, N)
    drafted = tiny.drafter.stats.num_draft_tokens - before[0]
    accepted = tiny.drafter.stats.num_accepted_tokens - before[1]
    assert drafted > N and accepted > 100 and drafted - accepted > 100  # drafts accepted and rejected alike
    assert len(plain) > 8  # a distribution, not a few outcomes (16 seen)
    assert _p_value(plain, spec) > ALPHA
    monkeypatch.setattr(speculative_mod, "speculative_sample", _wrong_rule)
    assert _p_value(plain, _outcomes(tiny, greedy, 2 * N)) < ALPHA  # (seen: 9e-49; the right rule: 0.39)
