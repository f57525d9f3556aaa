"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkeeper.errors import InvalidRequestError
from kvkeeper.weights.sources import resolve_model_path
from kvkeeper.text.detokenizer import IncrementalDetokenizer
from kvkeeper.text.tokenizer import load_tokenizer

FFFD = "\ufffd"

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "👍🏽🎉",
    "你好，世界。日本語のテキスト",
    "Mixed: hello 👋 世界 café — done 🎉!",
    "L'été dernier, à Noël, nous avons mangé une crème brûlée très sucrée.",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def byte_ids(tok):
    """byte value -> id of the single-byte token (to split text into one token per byte).

    The vocabulary lacks a few bytes that never occur in UTF-8 text (0xC0, 0xC1,
    0xF5-0xFF), the lead bytes 0xF1 and 0xF2 (planes 4-11, unassigned)
    and some control characters; every byte our texts use is there.
    """
    vocab = tok.get_vocab()
    table = {b: vocab[c] for b, c in _bytes_to_unicode().items() if c in vocab}
    needed = set(range(0x20, 0x7F)) | {0x0A} | set(range(0x80, 0xC0)) | set(range(0xC2, 0xF1))
    assert needed <= table.keys(), sorted(needed - table.keys())
    return table


def stream(tok, ids, **kw):
    """Feed ids one at a time; return (detokenizer, deltas from add, delta from flush)."""
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.add(i) for i in ids]
    tail = d.flush()
    return d, deltas, tail


def check_deltas(d, deltas, tail, expected):
    out = "".join(deltas) + tail
    assert out == expected
    assert d.text == expected
    for x in deltas + [tail]:
        assert FFFD not in x
    # Emitted text only ever grows: every running concatenation is a prefix of the answer.
    acc = ""
    for x in deltas:
        acc += x
        assert expected.startswith(acc)


# -- UTF-8 safety --------------------------------------------------------------


def test_tokenizer_really_splits_characters(tok):
    """Guard: without this the round-trip tests could not fail."""
    for text in ["👍🏽🎉", "你好，世界。日本語のテキスト"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert any(FFFD in tok.decode([i]) for i in ids), text


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas, tail = stream(tok, ids)
    check_deltas(d, deltas, tail, tok.decode(ids, skip_special_tokens=True))
    assert d.text == text
    assert d.token_ids == ids
    assert not d.stopped and d.stop_string is None


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_one_token_per_byte(tok, byte_ids, text):
    ids = [byte_ids[b] for b in text.encode("utf-8")]
    d, deltas, tail = stream(tok, ids)
    check_deltas(d, deltas, tail, text)
    assert tail == ""  # every character was complete before the end


def test_emoji_held_until_complete(tok):
    ids = tok.encode("👍", add_special_tokens=False)
    assert len(ids) >= 2
    d = IncrementalDetokenizer(tok)
    assert [d.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "👍"


def test_incomplete_tail_dropped_at_flush(tok):
    ids = tok.encode("ok👍", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    out = "".join(d.add(i) for i in ids[:-1]) + d.flush()
    assert out == "ok"
    assert d.text == "ok"
    assert d.flush() == ""
    with pytest.raises(RuntimeError):
        d.add(ids[-1])


def test_prompt_context_not_in_output(tok):
    prompt = tok.encode("Tell me about 日本", add_special_tokens=False)
    ids = tok.encode(" Paris is nice 🎉.", add_special_tokens=False)
    d, deltas, tail = stream(tok, ids, prompt_token_ids=prompt)
    check_deltas(d, deltas, tail, " Paris is nice 🎉.")


def test_prompt_ending_inside_a_character(tok, byte_ids):
    prompt = [byte_ids[b] for b in "ab日".encode()[:-1]]  # last character cut
    ids = tok.encode("hello", add_special_tokens=False)
    d, deltas, tail = stream(tok, ids, prompt_token_ids=prompt)
    check_deltas(d, deltas, tail, "hello")


def test_special_tokens(tok):
    ids = tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_id]
    d, deltas, tail = stream(tok, ids)
    check_deltas(d, deltas, tail, "Hi there")
    d, deltas, tail = stream(tok, ids, skip_special_tokens=False)
    check_deltas(d, deltas, tail, "Hi there" + tok.eos_token)
    d, deltas, tail = stream(tok, ids, skip_special_tokens=False, stop=[tok.eos_token])
    check_deltas(d, deltas, tail, "Hi there")
    assert d.stop_string == tok.eos_token


# -- stop strings --------------------------------------------------------------


def test_stop_spanning_tokens(tok):
    text = "The answer is forty-two. END OF ANSWER and more text after it"
    stop = "END OF ANSWER"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    # the stop string really spans several tokens
    assert not any(stop in p for p in pieces)
    d, deltas, tail = stream(tok, ids, stop=[stop])
    expected = text[: text.index(stop)]
    check_deltas(d, deltas, tail, expected)
    assert d.stopped and d.stop_string == stop
    assert tail == ""
    # no delta ever leaked a prefix of the stop string
    assert not any("END" in x for x in deltas)


def test_stop_spanning_held_text_and_split_character(tok):
    text = "你好，世界。日本語のテキスト"
    stop = "界。日"  # 界 is split over three tokens
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas, tail = stream(tok, ids, stop=[stop])
    check_deltas(d, deltas, tail, "你好，世")
    assert d.stopped and d.stop_string == stop


def test_partial_stop_prefix_released(tok):
    """Text that looked like the start of a stop string is emitted once it is not."""
    text = "abc END OF LINE xyz"
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas, tail = stream(tok, ids, stop=["END OF ANSWER"])
    check_deltas(d, deltas, tail, text)
    assert not d.stopped and d.stop_string is None


def test_partial_stop_prefix_released_at_flush(tok):
    text = "waiting for the END OF"
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas, tail = stream(tok, ids, stop=["END OF ANSWER"])
    assert "".join(deltas) == "waiting for the "  # "END OF" held as a possible stop
    assert tail == "END OF"
    check_deltas(d, deltas, tail, text)


def test_stop_inside_one_token(tok):
    ids = tok.encode("Say hello world", add_special_tokens=False)
    hello = [i for i in ids if tok.decode([i]) == " hello"]
    assert hello, "expected a single ' hello' token"
    d, deltas, tail = stream(tok, ids, stop=["ell"])
    check_deltas(d, deltas, tail, "Say h")
    assert d.stopped and d.stop_string == "ell"


def test_multiple_stops_earliest_wins(tok):
    text = "one two three four five"
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas, tail = stream(tok, ids, stop=["four", "two", "five"])
    check_deltas(d, deltas, tail, "one ")
    assert d.stop_string == "two"


def test_overlapping_stops_first_completed_wins(tok):
    ids = tok.encode("xx abcd yy", add_special_tokens=False)
    d, deltas, tail = stream(tok, ids, stop=["abcd", "bc"])
    assert d.text == "xx a" and d.stop_string == "bc"


def test_after_stop_add_returns_empty(tok):
    ids = tok.encode("alpha STOP beta gamma", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    outs, stopped = [], []
    for i in ids:
        outs.append(d.add(i))
        stopped.append(d.stopped)
    k = stopped.index(True)
    assert k < len(ids) - 1  # tokens did come after the stop
    assert all(x == "" for x in outs[k + 1 :])
    assert d.flush() == ""
    assert d.text == "alpha "
    assert d.token_ids == ids


def test_no_stop_flush_returns_all(tok):
    text = "Nothing special here, just text."
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas, tail = stream(tok, ids, stop=["###", "Nothing specia!"])
    check_deltas(d, deltas, tail, text)
    assert not d.stopped


@pytest.mark.parametrize("bad", [[""], ["ok", ""], "STOP", [3]])
def test_invalid_stop(tok, bad):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, stop=bad)
    with pytest.raises(InvalidRequestError):
        IncrementalDetokenizer(tok, stop=bad)


# -- property test -------------------------------------------------------------

ALPHABET = st.sampled_from(
    list("abc xyz.,!'\n")
    + list("éèàüöçñ")
    + list("你好世界日本語の")
    + ["👍", "🎉", "🏽", "😀", "🚀"]
)


@st.composite
def text_and_stop(draw):
    text = draw(st.text(ALPHABET, min_size=1, max_size=30))
    i = draw(st.integers(0, len(text) - 1))
    j = draw(st.integers(i + 1, min(len(text), i + 6)))
    stop = text[i:j]
    if draw(st.booleans()):  # sometimes a stop string that may not occur at all
        stop = draw(st.text(ALPHABET, min_size=1, max_size=4))
    per_byte = draw(st.booleans())
    return text, stop, per_byte


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=text_and_stop())
def test_property_stream_equals_cut_decode(tok, byte_ids, case):
    text, stop, per_byte = case
    if per_byte:
        ids = [byte_ids[b] for b in text.encode("utf-8")]
    else:
        ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    k = full.find(stop)
    expected = full if k < 0 else full[:k]
    d, deltas, tail = stream(tok, ids, stop=[stop])
    check_deltas(d, deltas, tail, expected)
    assert d.stopped == (k >= 0)
    assert d.stop_string == (stop if k >= 0 else None)
