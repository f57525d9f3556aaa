"""Passkey retrieval prompts and the ``kvkeeper eval passkey`` command."""

from __future__ import annotations

import json
import subprocess
import sys

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


@pytest.mark.slow
def test_eval_passkey_cli():
    out = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "passkey", "--lengths", "300", "--depths",
                          "0", "1", "--trials", "2", "--policy", "snapkv", "--ratio", "0.5", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["trials"] == 4 and r["policy"] == "snapkv" and len(r["cells"]) == 2
    assert 0.0 <= r["accuracy"] <= 1.0 and all(c["trials"] == 2 for c in r["cells"])
    bad = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "eval", "passkey", "--depths", "1.5"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "depths must be in [0, 1]" in bad.stderr
