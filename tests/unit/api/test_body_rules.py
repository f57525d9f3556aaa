"""The body rules every endpoint shares (kvkeeper.api.common.protocol), without a server: one conversion of the
sampling fields and one tools / output-format clash rule for chat, text completions and the Responses API."""

from __future__ import annotations

import ast

import pytest
from tests.utils.paths import ROOT

from kvkeeper.api.chat.protocol import ChatCompletionRequest
from kvkeeper.api.common.errors import APIError
from kvkeeper.api.common.protocol import output_constraint, sampling_params, structured_output
from kvkeeper.api.common.schemas import refused_field
from kvkeeper.api.common.tools import tool_use_of
from kvkeeper.api.completions.protocol import CompletionRequest
from kvkeeper.api.responses.items import text_format, tool_use_of_body
from kvkeeper.api.responses.schema import RESPONSES_REFUSED, ResponsesRequest

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}
RTOOL = {"type": "function", "name": "get", "parameters": {"type": "object", "properties": {}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_a_responses_body_gets_the_same_params_as_a_chat_body_with_its_fields():
    """The Responses API's body has temperature, top_p and max_output_tokens only; everything else is the default
    a chat body leaving the field out gets."""
    resp = sampling_params(ResponsesRequest(input="hi", temperature=0.5, top_p=0.9, max_output_tokens=7), 7)
    chat = sampling_params(ChatCompletionRequest(messages=MSG, temperature=0.5, top_p=0.9, max_tokens=7), 7)
    assert len(resp) == 1 and resp == chat
    assert (resp[0].temperature, resp[0].top_p, resp[0].max_tokens, resp[0].seed) == (0.5, 0.9, 7, None)
    default = sampling_params(ResponsesRequest(input="hi"), None)[0]
    assert (default.temperature, default.top_p, default.stop, default.speculative) == (1.0, 1.0, [], True)


def test_sampling_params_of_a_completion_body_seed_each_choice_and_check_stop():
    ps = sampling_params(CompletionRequest(prompt="p", n=3, seed=10, stop="x", top_k=5), 4, logprobs=2)
    assert [p.seed for p in ps] == [10, 11, 12] and all(p.stop == ["x"] and p.top_k == 5 for p in ps)
    with pytest.raises(APIError) as e:
        sampling_params(CompletionRequest(prompt="p", stop=[str(i) for i in range(17)]), 4)
    assert e.value.param == "stop"


@pytest.mark.parametrize("body, fmt_of, tools_of, param", [
    (ChatCompletionRequest(messages=MSG, tools=[TOOL], response_format={"type": "json_object"}),
     structured_output, tool_use_of, "response_format"),
    (ChatCompletionRequest(messages=MSG, tools=[TOOL], guided_regex="a+"), structured_output, tool_use_of,
     "guided_regex"),
    (ResponsesRequest(input="hi", tools=[RTOOL], text={"format": {"type": "json_schema", "name": "x",
                                                                  "schema": SCHEMA}}),
     text_format, tool_use_of_body, "text.format"),
])
def test_one_clash_rule_for_tools_and_an_output_format(body, fmt_of, tools_of, param):
    """A JSON format beside tool_choice auto is the final answer's (the output: that JSON or calls; Codex CLI's
    --output-schema); with tool_choice required or named, and a non-JSON format with any choice, a 400."""
    fmt, tools = fmt_of(body), tools_of(body)
    assert fmt is not None and tools is not None
    json_format = fmt.kind in ("json_schema", "json_object")
    for choice in ("auto", "required"):
        tools.choice = choice
        if choice == "auto" and json_format:
            both = output_constraint(fmt, tools)
            assert (both.kind, both.param) == ("lark", param) and "%json" in both.spec and "reply | call" in both.spec
            continue
        with pytest.raises(APIError) as e:
            output_constraint(fmt, tools)
        assert (e.value.status, e.value.param) == (400, param) and "both constrain the output" in e.value.message
    assert output_constraint(fmt, None) is fmt
    assert output_constraint(None, tools).kind == "lark"
    tools.choice = "none"  # tool_choice "none": the calls constrain nothing, the format applies
    assert output_constraint(fmt, tools) is fmt


def test_refused_fields_read_dotted_names_and_skip_undeclared_ones():
    assert refused_field(ResponsesRequest(input="x", text={"verbosity": "high"}), RESPONSES_REFUSED)[0] == \
        "text.verbosity"
    assert refused_field(ResponsesRequest(input="x", text={"verbosity": "medium"}), RESPONSES_REFUSED) is None
    assert refused_field(ResponsesRequest(input="x"), RESPONSES_REFUSED) is None
    assert refused_field(CompletionRequest(prompt="p")) is None  # chat-only refused fields are not its fields
    assert refused_field(ChatCompletionRequest(messages=MSG, modalities=["audio"]))[0] == "modalities"


def test_sampling_params_are_built_in_one_place_in_api():
    """Every endpoint's SamplingParams come from protocol.sampling_params: no other module of api/ builds one."""
    api = ROOT / "src" / "kvkeeper" / "api"
    calls = []
    for path in sorted(api.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            f = node.func if isinstance(node, ast.Call) else None
            if (isinstance(f, ast.Name) and f.id == "SamplingParams") or (
                    isinstance(f, ast.Attribute) and f.attr == "SamplingParams"):
                calls.append(str(path.relative_to(api)))
    assert calls == ["common/protocol.py"]
