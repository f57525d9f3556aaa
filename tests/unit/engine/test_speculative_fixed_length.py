"""``--speculative-config`` ``"adaptive": false``: every draft is ``num_speculative_tokens`` long whatever the step
timings and the acceptance estimate, so the counts depend on the tokens only (the suite's Predicted Outputs test
runs this way); a value other than true / false is refused naming the field."""

from __future__ import annotations

import pytest

from kvkeeper.spec_decode.config import parse_speculative_config
from kvkeeper.spec_decode.drafter import Drafter
from kvkeeper.spec_decode.metrics import SpecState
from kvkeeper.errors import InvalidRequestError


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("hits,misses", [(0.0, 10.0), (1.0, 1.0), (10.0, 0.0)])
def test_fixed_length_ignores_the_cost_model_and_the_estimate(batch, hits, misses):
    fixed = Drafter(parse_speculative_config('{"num_speculative_tokens": 6, "adaptive": false}'))
    adaptive = Drafter(parse_speculative_config('{"num_speculative_tokens": 6}'))
    for d in (fixed, adaptive):
        for rows, seconds in ((1, 0.02), (4, 0.5), (9, 30.0)):  # any timings, a loaded machine's included
            d.cost.observe(rows, seconds)
    assert fixed.length(SpecState(hits, misses), batch) == 6
    assert adaptive.length(SpecState(0.0, 10.0), 64) == 0  # the adaptive drafter would draft nothing here


def test_fixed_length_is_named_in_the_load_line_and_a_bad_value_is_refused():
    assert "fixed length" in parse_speculative_config('{"adaptive": false}').describe()
    assert "adaptive" in parse_speculative_config("{}").describe()
    with pytest.raises(InvalidRequestError, match="adaptive must be true or false") as e:
        parse_speculative_config('{"adaptive": 1}')
    assert e.value.param == "speculative_config.adaptive"
