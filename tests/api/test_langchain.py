"""LangChain itself against a real ``kvkeeper serve`` on 127.0.0.1 (issue 31): ``langchain-openai``'s ``ChatOpenAI``
as a LangChain user points it at an OpenAI-compatible server, on the embedded SmolLM2-135M.

* a plain turn and a streamed turn (with the usage LangChain asks for): text back, the usage counted, nothing refused;
* a tool-call round trip: ``bind_tools`` with ``tool_choice="required"`` gives a parsed call (name, JSON arguments),
  the tool's answer goes back as a ``ToolMessage`` with the AI message in the history, and the model answers;
* a call cut by ``max_tokens``: LangChain gets no ``<tool_call>`` markup in ``content`` (it would send it back in
  the history), no half call, and ``finish_reason`` ``length``, streamed or not.
"""

from __future__ import annotations

import pytest
from tests.utils.serverproc import running_server

pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("langchain") / "server.log"
    with running_server(log, "--max-model-len", "2048") as base:
        yield base


def _llm(server, **kw) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=server + "/v1", api_key="unused", temperature=0, max_retries=0,
                      timeout=120, **kw)


def test_a_plain_turn(server):
    r = _llm(server, max_tokens=16).invoke([HumanMessage("Name three colours.")])
    assert isinstance(r, AIMessage) and r.content.strip(), r
    assert r.usage_metadata["output_tokens"] > 0 and r.usage_metadata["input_tokens"] > 0, r.usage_metadata
    assert r.response_metadata["finish_reason"] in ("stop", "length"), r.response_metadata


def test_a_streamed_turn(server):
    llm = _llm(server, max_tokens=16, stream_usage=True)
    chunks = list(llm.stream([HumanMessage("Name three animals.")]))
    assert len(chunks) > 2, chunks
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert whole.content.strip(), whole
    assert whole.usage_metadata and whole.usage_metadata["output_tokens"] > 0, whole.usage_metadata
    assert "<tool_call>" not in whole.content


def test_a_tool_call_round_trip(server):
    llm = _llm(server, max_tokens=64).bind_tools([get_weather], tool_choice="required")
    history = [HumanMessage("What is the weather in Paris?")]
    ai = llm.invoke(history)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather", ai
    call = ai.tool_calls[0]
    assert isinstance(call["args"], dict) and isinstance(call["args"].get("city"), str), call
    assert "<tool_call>" not in (ai.content or ""), ai.content
    assert ai.response_metadata["finish_reason"] == "tool_calls", ai.response_metadata
    history += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = _llm(server, max_tokens=32).bind_tools([get_weather]).invoke(history)  # LangChain resends it all
    assert isinstance(answer, AIMessage) and (answer.content.strip() or answer.tool_calls), answer
    assert "<tool_call>" not in answer.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_by_max_tokens_leaves_no_markup(server, stream):
    llm = _llm(server, max_tokens=6).bind_tools([get_weather], tool_choice="required")
    msgs = [HumanMessage("What is the weather in Paris?")]
    if stream:
        chunks = list(llm.stream(msgs))
        ai = chunks[0]
        for c in chunks[1:]:
            ai += c
    else:
        ai = llm.invoke(msgs)
    assert ai.content == "", ai.content  # never the call's markup, never half of it
    assert not ai.tool_calls and not getattr(ai, "tool_call_chunks", None) and not ai.invalid_tool_calls, ai
    assert ai.response_metadata["finish_reason"] == "length", ai.response_metadata
