"""kvkeeper.text.lazy_tokenizer: the engine's tokenizer without importing transformers, equal to transformers'.

* encode (with and without special tokens), decode (skipping special tokens or not), token <-> id, the special
  tokens, the vocabulary and the chat template equal transformers' tokenizer of the same folder (the reference)
  on the embedded model, over fixed texts and 200 seeded random id sequences;
* attributes it does not answer (apply_chat_template, all_special_ids) come from transformers' tokenizer;
* loading it and encoding / decoding imports no transformers (a fresh interpreter);
* a folder whose config asks transformers for more (add_bos_token, another tokenizer class) does not qualify.
"""

import json
import random
import shutil

import pytest

from kvkeeper.text.lazy_tokenizer import LazyTokenizer, qualifies
from kvkeeper.text.tokenizer import load_tokenizer
from kvkeeper.weights.sources import resolve_model_path

TEXTS = ["Hello there", " leading space", "<|im_start|>user\nHi<|im_end|>\n", "naïve café 東京 🙂", "", "a\n\n\tb  c",
         "<|endoftext|>x", "The capital of France is"]


@pytest.fixture(scope="module")
def pair():
    path = resolve_model_path()
    lazy, ref = load_tokenizer(path, lazy=True), load_tokenizer(path)
    assert isinstance(lazy, LazyTokenizer)
    return lazy, ref


def test_encode_and_decode_equal_transformers(pair):
    lazy, ref = pair
    for text in TEXTS:
        for special in (True, False):
            assert lazy.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randrange(1, 12))] + [0, 1, 2]
        rng.shuffle(ids)
        for skip in (True, False):
            assert lazy.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids
        assert lazy.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
        assert lazy.convert_ids_to_tokens(ids[0]) == ref.convert_ids_to_tokens(ids[0])
        assert lazy.decode(ids[0]) == ref.decode(ids[0])


def test_tokens_specials_and_template_equal_transformers(pair):
    lazy, ref = pair
    for token in ["<|im_start|>", "Hello", "not-a-token~~~"]:
        assert lazy.convert_tokens_to_ids(token) == ref.convert_tokens_to_ids(token)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "chat_template"):
        assert getattr(lazy, name) == getattr(ref, name), name
    assert len(lazy) == len(ref) and lazy.get_vocab() == ref.get_vocab()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (lazy.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert lazy.all_special_ids == ref.all_special_ids


def test_folders_that_need_transformers_do_not_qualify(pair, tmp_path):
    lazy, _ = pair
    src = lazy.name_or_path
    for change in ({"add_bos_token": True}, {"tokenizer_class": "LlamaTokenizer"}):
        folder = tmp_path / next(iter(change))
        shutil.copytree(src, folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        assert qualifies(folder)
        cfg.update(change)
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        assert not qualifies(folder)
        assert not isinstance(load_tokenizer(folder, lazy=True), LazyTokenizer)


CHATS = [
    ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": True}),
    ([{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "  two  spaces "},
      {"role": "assistant", "content": "ok", "tool_calls": None}, {"role": "user", "content": "again"}],
     {"add_generation_prompt": True}),
    ([{"role": "user", "content": "Finish this"}, {"role": "assistant", "content": "The answer is"}],
     {"continue_final_message": True}),
    ([{"role": "user", "content": "Weather?"}],
     {"add_generation_prompt": True, "tools": [{"type": "function", "function": {
         "name": "get_weather", "description": "The weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}),
    ([{"role": "user", "content": "x"}], {"add_generation_prompt": False, "custom_variable": "seen"}),
]


def test_chat_template_renders_as_transformers_without_its_tokenizer(tmp_path):
    """apply_chat_template(tokenize=False) equals transformers' on the embedded template, including tools,
    continue_final_message, None-valued keys and extra template variables, and builds no transformers tokenizer;
    the errors are transformers' (an empty conversation, continue_final_message with a generation prompt)."""
    path = resolve_model_path()
    ref = load_tokenizer(path)
    lazy = load_tokenizer(path, lazy=True)
    for msgs, kw in CHATS:
        assert lazy.apply_chat_template(msgs, tokenize=False, **kw) == ref.apply_chat_template(msgs, tokenize=False, **kw)
    assert lazy._full is None
    for bad, kw in (([], {}), ([{"role": "user", "content": "x"}],
                               {"add_generation_prompt": True, "continue_final_message": True})):
        with pytest.raises(ValueError):
            lazy.apply_chat_template(bad, tokenize=False, **kw)
        with pytest.raises(ValueError):
            ref.apply_chat_template(bad, tokenize=False, **kw)
    # tokenize=True is the full tokenizer's
    assert lazy.apply_chat_template(CHATS[0][0], add_generation_prompt=True) == \
        ref.apply_chat_template(CHATS[0][0], add_generation_prompt=True)
    assert lazy._full is not None


def test_verification_finds_a_tokenizer_that_differs(pair, tmp_path):
    """verify() over the vocabulary and probe texts: the embedded folder against its own transformers tokenizer
    finds nothing; a copy whose tokenizer.json lowercases its input, against the original's transformers tokenizer,
    differs, so record_verification writes the differences and the copy (made non-generic) does not qualify."""
    from kvkeeper.text.lazy_tokenizer import MARKER, record_verification, verify

    lazy, ref = pair
    assert verify(lazy, ref) == []
    folder = tmp_path / "lower"
    shutil.copytree(lazy.name_or_path, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "SomeOtherTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    assert not record_verification(folder, ref)
    rec = json.loads((folder / MARKER).read_text())
    assert rec["mismatches"] and set(rec["versions"]) == {"tokenizers", "transformers"}
    assert any(m.startswith("encode(") for m in rec["mismatches"])
    assert not qualifies(folder)
    rec["mismatches"] = []
    (folder / MARKER).write_text(json.dumps(rec))
    assert qualifies(folder)  # a clean record is what qualifies the folder...
    rec["versions"]["tokenizers"] = "0.0.1"  # ...made under the installed library versions only
    (folder / MARKER).write_text(json.dumps(rec))
    assert not qualifies(folder)
