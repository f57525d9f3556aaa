"""Tool calls as text (kvkeeper.text.tool_format): prompt rendering, output parsing, the call grammar."""

from __future__ import annotations

import json
import random

import pytest

from kvkeeper.errors import InvalidRequestError
from kvkeeper.sampling.structured import GrammarCompiler, StructuredOutput
from kvkeeper.text.tool_format import (CallParser, call_grammar, call_text, format_or_calls_grammar, prepare_messages,
                                       split_calls, template_has_tools, tools_system_text)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_tools_go_into_the_system_message_and_calls_render_verbatim():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":  "Paris"}'}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": '{"t": 18}', "tool_call_id": "call_1"}]
    out, extra = prepare_messages(msgs, [WEATHER], native=False)
    assert extra == {}
    assert out[0]["content"] == "Be brief.\n\n" + tools_system_text([WEATHER])
    assert json.dumps(WEATHER) in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call_text("get_weather", '{"city":  "Paris"}')}
    assert out[3] == {"role": "tool", "content": '<tool_response>\n{"t": 18}\n</tool_response>'}
    no_system, _ = prepare_messages(msgs[1:2], [WEATHER], native=False)
    assert no_system[0] == {"role": "system", "content": tools_system_text([WEATHER])}
    native, extra = prepare_messages(msgs, [WEATHER], native=True)
    assert extra == {"tools": [WEATHER]} and native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert template_has_tools("{% if tools %}x{% endif %}") and not template_has_tools("{{ messages }}")


def test_streamed_parsing_equals_whole_parsing_for_any_chunking():
    text = ("Let me check. " + call_text("get_weather", '{"city": "Paris"}') + "\n"
            + call_text("add", '{"a": 1, "b": 2}') + "\nDone <tool_call>\n{broken}\n</tool_call> <tool")
    content, calls = split_calls(text)
    assert calls == [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]
    assert content == "Let me check.Done"  # markup that never became a call is dropped, never content
    rng = random.Random(0)
    for _ in range(50):
        p, got, got_calls, i = CallParser(), "", [], 0
        while i < len(text):
            j = i + rng.randint(1, 9)
            c, k = p.feed(text[i:j])
            got, got_calls, i = got + c, got_calls + k, j
        c, k = p.flush()
        assert (got + c, got_calls + k) == (content, calls)
    assert split_calls('<tool_call>\n{"name": "x", "arguments": {"q": 1.50}}\n</tool_call>')[1] == [("x", '{"q": 1.50}')]
    # another layout: the arguments object re-serialised
    assert split_calls('<tool_call>{"name":"x","arguments":{"q":1.50}}</tool_call>')[1] == [("x", '{"q": 1.5}')]
    assert split_calls("plain text  ") == ("plain text", [])


@pytest.fixture(scope="module")
def grammars():
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    return tok, GrammarCompiler(tok, 49152, tok.eos_token_id)


def _accepts(tok, matcher, text: str) -> bool:
    m = matcher.deep_copy()
    ids = tok.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("required,parallel", [(True, True), (True, False), (False, True), (False, False)])
def test_call_grammar(grammars, required, parallel):
    tok, gc = grammars
    m = gc.matcher(StructuredOutput("lark", call_grammar([WEATHER["function"], ADD["function"]], required, parallel),
                                    "tool_choice"))
    one, two = call_text("get_weather", '{"city": "Paris"}'), call_text("add", '{"a": 1, "b": 2}')
    assert _accepts(tok, m, one)
    assert _accepts(tok, m, one + "\n" + two) == parallel
    assert _accepts(tok, m, "Hello there.") == (not required)  # auto: free text
    assert _accepts(tok, m, "Sure. " + one) == (not required)
    assert not _accepts(tok, m, call_text("get_weather", '{"town": "Paris"}'))  # wrong arguments
    assert not _accepts(tok, m, call_text("nope", "{}"))  # unknown function
    assert not _accepts(tok, m, call_text("get_weather", '{"city":"Paris"}'))  # not the canonical layout


@pytest.mark.parametrize("parallel", [True, False])
def test_format_or_calls_grammar(grammars, parallel):
    """tool_choice auto beside a JSON output format (Codex CLI's --output-schema): one JSON value of the format (the
    final answer, compact) or calls, nothing else."""
    tok, gc = grammars
    schema = {"type": "object", "properties": {"answer": {"enum": ["OK"]}}, "required": ["answer"],
              "additionalProperties": False}
    m = gc.matcher(StructuredOutput("lark", format_or_calls_grammar(schema, [WEATHER["function"], ADD["function"]],
                                                                    parallel), "text.format"))
    one, two = call_text("get_weather", '{"city": "Paris"}'), call_text("add", '{"a": 1, "b": 2}')
    assert _accepts(tok, m, '{"answer": "OK"}')
    assert _accepts(tok, m, one)
    assert _accepts(tok, m, one + "\n" + two) == parallel
    assert not _accepts(tok, m, '{"answer": "no"}')  # not the format
    assert not _accepts(tok, m, '{"answer":"OK"}')  # not the compact layout
    assert not _accepts(tok, m, "Hello there.")  # free text is neither
    assert not _accepts(tok, m, '{"answer": "OK"}' + one)  # the answer ends the output
    assert not _accepts(tok, m, call_text("get_weather", '{"town": "Paris"}'))


def test_bad_grammars_name_their_field(grammars):
    _, gc = grammars
    for so in (StructuredOutput("regex", "([", "guided_regex"), StructuredOutput("json_schema", {"type": "foo"},
                                                                                 "response_format"),
               StructuredOutput("choice", [], "guided_choice"), StructuredOutput("grammar", "start: (", "guided_grammar")):
        with pytest.raises(InvalidRequestError) as ei:
            gc.matcher(so)
        assert ei.value.param == so.param


def test_a_closing_tag_inside_an_argument_string_belongs_to_the_arguments():
    args = '{"s": "a</tool_call>b"}'
    text = "Calling. " + call_text("f", args) + " after"
    assert split_calls(text) == ("Calling.after", [("f", args)])
    p, got, got_calls = CallParser(), "", []
    for ch in text:  # streamed a character at a time: the same split
        c, k = p.feed(ch)
        got, got_calls = got + c, got_calls + k
    c, k = p.flush()
    assert (got + c, got_calls + k) == ("Calling.after", [("f", args)])


def test_a_grammar_compiled_again_is_reused_and_its_matchers_are_independent(grammars):
    tok, gc = grammars
    so = StructuredOutput("regex", "(yes|no) then (red|blue)", "guided_regex")
    a, b = gc.matcher(so), gc.matcher(so)
    assert a is not b and gc.matcher(StructuredOutput("regex", "(yes|no) then (red|blue)", "guided_regex")) is not a
    ids = tok.encode("yes then red", add_special_tokens=False)
    assert a.try_consume_tokens(ids) == len(ids) and a.is_accepting()
    assert not b.is_accepting() and b.try_consume_tokens(tok.encode("no then blue", add_special_tokens=False)) > 0
    assert len(gc._compiled) >= 1  # one pristine matcher kept per grammar text


def test_grammars_compile_in_worker_threads(grammars):
    """The server compiles a request's grammar in a worker thread (the engine thread then finds it kept)."""
    import concurrent.futures as cf

    tok, gc = grammars
    so = StructuredOutput("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}},
                                          "required": ["n"]}, "response_format")
    with cf.ThreadPoolExecutor(4) as ex:
        ms = list(ex.map(lambda _: gc.matcher(so), range(8)))
    assert len({id(m) for m in ms}) == 8
    ids = tok.encode('{"n": 12}', add_special_tokens=False)
    assert all(m.try_consume_tokens(ids) == len(ids) and m.is_accepting() for m in ms)
    assert sum(1 for g in gc._compiled if '"n"' in g) == 1
