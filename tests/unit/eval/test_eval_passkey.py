"""Passkey retrieval prompts and the ``kvkeeper eval passkey`` command."""

from __future__ import annotations


import pytest

from kvkeeper.eval.passkey import FILLER, answer_key, build_prompt, needle


@pytest.fixture(scope="module")
def tokenizer():
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path())


def test_answer_key_takes_the_first_five_digit_number():
    assert answer_key(" 68220. Remember") == 68220
    assert answer_key(" 6822") is None and answer_key("no digits") is None
    assert answer_key(" 12 34567") is None  # digits split by a space are not one number
    assert answer_key("123456") == 12345


@pytest.mark.parametrize("length", [300, 1000, 4000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_length_and_needle_depth(tokenizer, length, depth):
    ids = build_prompt(tokenizer, length, depth, 54321)
    assert length - 40 <= len(ids) <= length + 5
    text = tokenizer.decode(ids)
    before, after = text.split(needle(54321).strip())
    n_before, n_after = before.count(FILLER.strip()), after.count(FILLER.strip())
    total = n_before + n_after
    assert abs(n_before - depth * total) <= 1
    assert text.rstrip().endswith("The pass key is")
