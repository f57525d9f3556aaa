"""Anthropic's Messages API (issue 45) driven by the official ``anthropic`` client against a real server: a 4-turn
agent-style conversation with ``cache_control`` breakpoints (cache reads cover the previous turn, ``input_tokens``
excludes them), the stream events in order through the client's own stream helper, ``count_tokens`` equal to a
request's three input counts, a tool_use / tool_result round trip, the fields Claude Code sends served and the
others refused by name, ``x-api-key`` and Bearer keys; and a Codex-shaped ``/v1/responses`` request served.

One server (the embedded SmolLM2-135M, two API keys: tenants alice and bob) is shared by the module; replies are
greedy and short.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.utils.serverproc import running_server

from kvkeeper.api.anthropic.protocol import MessagesRequest
from kvkeeper.api.anthropic.serving import chat_body, check_fields, deferred_tools, usage_of
from kvkeeper.api.common.context import RequestContext
from kvkeeper.api.common.errors import APIError

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CTX = 1024  # small, so that a prompt near the context (max_tokens clamped) stays cheap
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
SYSTEM = ("You are a coding agent working in a repository. Answer briefly. " * 6).strip()
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EPHEMERAL = {"type": "ephemeral"}
GREEDY = {"temperature": 0}  # the anthropic SDK 2.10 has no temperature parameter; older clients send the field


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("anthropic")
    keys = d / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    with running_server(d / "server.log", "--max-model-len", str(CTX),
                        "--api-keys-file", str(keys)) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="sk-alice", max_retries=0, timeout=600)


def _user(text: str, mark: bool = True) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text, **({"cache_control": EPHEMERAL} if mark else {})}]}


def _total(u) -> int:
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_four_turns_read_the_previous_turn_from_the_cache(client):
    """Breakpoints on the system prompt and the last user block, the session named as Claude Code names it: from
    turn 2 the cache reads cover the whole previous prompt and ``input_tokens`` is what was not read or written."""
    sid = str(uuid.uuid4())
    system = [{"type": "text", "text": f"{sid} {SYSTEM}", "cache_control": EPHEMERAL}]
    msgs, prev_total = [], None
    for turn, q in enumerate(["List three fruits.", "Which one is red?", "Name a vegetable.", "Say goodbye."]):
        for m in msgs:  # only the last user block is a breakpoint (as Claude Code moves it)
            if m["role"] == "user":
                m["content"] = [{k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]]
        msgs.append(_user(q))
        counted = client.messages.count_tokens(model=MODEL, system=system, messages=msgs).input_tokens
        r = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system=system, messages=msgs,
                                   extra_headers={"X-Claude-Code-Session-Id": sid})
        u = r.usage
        assert r.stop_reason in ("end_turn", "max_tokens") and r.content[0].type == "text"
        if turn == 0:
            assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > 0
            assert _total(u) == counted  # a fresh session's prompt is the template's tokens
        else:
            assert u.cache_read_input_tokens >= prev_total, (turn, u, prev_total)
            assert u.input_tokens == _total(u) - u.cache_read_input_tokens - u.cache_creation_input_tokens
            assert u.input_tokens < _total(u) - prev_total + 16  # the new turn's text, not the whole prompt
            assert abs(_total(u) - counted) <= 2  # the session reuses the reply's own tokens
        prev_total = _total(u)
        msgs.append({"role": "assistant", "content": r.content[0].text})


def test_count_tokens_equals_the_three_input_counts(client):
    body = dict(model=MODEL, system=[{"type": "text", "text": f"{uuid.uuid4()} {SYSTEM}", "cache_control": EPHEMERAL}],
                messages=[_user("Count to three.")])
    counted = client.messages.count_tokens(**body).input_tokens
    u = client.messages.create(max_tokens=4, extra_body=GREEDY, **body).usage
    assert counted == _total(u) and u.cache_read_input_tokens == 0
    assert 0 < u.input_tokens < 8  # after the breakpoint: the assistant turn's opening tokens only
    again = client.messages.create(max_tokens=4, extra_body=GREEDY, **body).usage  # the prefix cache, full blocks
    assert again.cache_read_input_tokens >= counted - 16 and _total(again) == counted


def test_stream_events_parse_in_order(client, server):
    kw = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "Tell me a story."}])
    with client.messages.stream(**kw) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    plain = client.messages.create(**kw)
    raw = [t for t in types if t not in ("text",)]  # "text" is the helper's own event beside each text delta
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    body = raw[1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"} and len(body) >= 3
    assert final.content[0].text == plain.content[0].text and final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens > 0
    raw_body = {"model": MODEL, "max_tokens": 4, "messages": kw["messages"], "stream": True}
    r = httpx.post(server + "/v1/messages", json=raw_body,
                   headers={"x-api-key": "sk-alice"}, timeout=600)
    names = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]  # the raw stream has Anthropic's ping after message_start


def test_tool_use_and_tool_result_round_trip(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[WEATHER], messages=msgs,
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    calls = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    assert isinstance(calls[0].input, dict) and isinstance(calls[0].input.get("city"), str)
    with client.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[WEATHER], messages=msgs,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "input_json_delta" in deltas and streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"][0] == calls[0].input
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                           "content": "Sunny, 24 degrees."}]}]
    after = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, tools=[WEATHER], messages=msgs)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use") and after.content
    with pytest.raises(anthropic.BadRequestError) as e:  # a result that answers no call
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    assert "tool_call_id" in str(e.value)


def test_claude_code_fields_are_served(client, server):
    """What Claude Code sends: ?beta=true and anthropic-beta, thinking adaptive, context_management,
    output_config.effort, metadata.user_id, system blocks with cache_control, a system message inside messages,
    request-level cache_control and diagnostics; max_tokens over the context left is clamped and said so."""
    long = "The repository holds many files. " * 130
    r = client.beta.messages.with_raw_response.create(
        model=MODEL, max_tokens=32000, betas=["interleaved-thinking-2025-05-14"],
        system=[{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}],
        messages=[{"role": "system", "content": "Session context."}, _user(long + "Reply with one word.")],
        thinking={"type": "adaptive"}, metadata={"user_id": "user_abc"},
        extra_body={"temperature": 0, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
                    "output_config": {"effort": "high"}, "cache_control": EPHEMERAL, "diagnostics": {}},
        extra_headers={"X-Claude-Code-Session-Id": str(uuid.uuid4())})
    msg = r.parse()
    asked, served = r.headers["X-KVKeeper-Max-Tokens-Clamped"].split(" -> ")
    assert int(asked) == 32000 and int(served) == CTX - _total(msg.usage)
    assert msg.usage.output_tokens <= int(served)
    assert set(r.headers["X-KVKeeper-Not-Applied"].split(", ")) == {
        "context_management", "diagnostics", "output_config.effort", "thinking"}
    assert msg.usage.input_tokens < 8  # request-level cache_control: a breakpoint at the conversation's end


@pytest.mark.parametrize("extra, param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                                                 "image/png", "data": "AAAA"}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "colour": "red"}]}]},
     "messages.0.content.0.colour"),
])
def test_fields_not_applied_are_refused_by_name(server, extra, param):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": "sk-alice"}, timeout=600)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"], err


def test_a_body_that_is_not_json_is_an_anthropic_400(server):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(server + path, content=b"\x1c\xff{", headers={"x-api-key": "sk-alice",
                                                                      "content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_keys_x_api_key_and_bearer(server, client):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server, auth_token="sk-bob", max_retries=0, timeout=600)
    r = httpx.post(server + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=600)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    sid = str(uuid.uuid4())  # one session id, two tenants: bob's request does not read alice's session
    body = dict(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=[_user(SYSTEM)],
                extra_headers={"X-Claude-Code-Session-Id": sid})
    client.messages.create(**body)
    assert client.messages.create(**body).usage.cache_read_input_tokens > 0
    assert bearer.messages.create(**body).usage.cache_read_input_tokens == 0  # bob's first request, by Bearer


SHELL = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
         "required": ["command"], "additionalProperties": False}
READ = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False, "parameters": SHELL},
    {"type": "namespace", "name": "mcp__fs__", "description": "The file system server",
     "tools": [{"type": "function", "name": "read_file", "description": "Reads a file", "strict": False,
                "parameters": READ}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "description": "Applies a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
]


def _codex_body(sid: str, input_items: list[dict], **kw) -> dict:
    """What Codex CLI sends on /v1/responses (wire_api = "responses")."""
    return {"model": MODEL, "instructions": "You are a coding agent. Be brief.", "input": input_items,
            "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": sid,
            "client_metadata": {"session_id": sid}, "max_output_tokens": 12, "temperature": 0, **kw}


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_codex_request_is_served(server):
    """Codex's fields served: namespace tools flattened, hosted tools not offered and named in a header, role
    developer, reasoning.summary / include / client_metadata accepted; with store false the session-id header keeps
    the session's KV, so the second request reads the whole first one from the cache."""
    sid = str(uuid.uuid4())
    h = {"Authorization": "Bearer sk-alice", "session-id": sid}
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    r = httpx.post(server + "/v1/responses", json=_codex_body(sid, items), headers=h, timeout=600)
    assert r.status_code == 200, r.text
    assert r.headers["X-KVKeeper-Tools-Not-Offered"] == "web_search, custom:apply_patch"
    done = _sse_events(r.text)[-1]
    assert done["type"] in ("response.completed", "response.incomplete"), done  # incomplete: max_output_tokens
    first = done["response"]["usage"]
    items += [it for it in done["response"]["output"]] + [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now the tests."}]}]
    r2 = httpx.post(server + "/v1/responses", json=_codex_body(sid, items), headers=h, timeout=600)
    assert r2.status_code == 200, r2.text
    second = _sse_events(r2.text)[-1]["response"]["usage"]
    assert second["input_tokens_details"]["cached_tokens"] >= first["input_tokens"], (first, second)


def test_a_namespace_function_is_called_by_its_name_and_namespace(server):
    sid = str(uuid.uuid4())
    h = {"Authorization": "Bearer sk-alice"}
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read README.md"}]}]
    body = _codex_body(sid, items, stream=False, max_output_tokens=64,
                       tool_choice={"type": "function", "name": "mcp__fs__read_file"})
    r = httpx.post(server + "/v1/responses", json=body, headers=h, timeout=600)
    assert r.status_code == 200, r.text
    calls = [it for it in r.json()["output"] if it["type"] == "function_call"]
    assert calls and calls[0]["name"] == "read_file" and calls[0]["namespace"] == "mcp__fs__", r.json()
    items += [calls[0], {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "# kvkeeper"}]
    r = httpx.post(server + "/v1/responses", json=_codex_body(sid, items, stream=False), headers=h, timeout=600)
    assert r.status_code == 200, r.text


@given(st.integers(1, 10**6), st.data())
def test_usage_splits_the_prompt_in_three(prompt, data):
    """read + written + input is the prompt, each at least 0; nothing is written past the breakpoint or twice."""
    cached = data.draw(st.integers(0, prompt))
    bp = data.draw(st.integers(0, 2 * prompt))
    u = usage_of(prompt, cached, 3, bp)
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == prompt
    assert min(u.values()) >= 0 and u["cache_read_input_tokens"] == cached and u["output_tokens"] == 3
    assert u["cache_creation_input_tokens"] == max(0, min(bp, prompt) - cached)


def test_the_body_becomes_the_chat_request():
    """Blocks to chat messages (system blocks and a leading system message joined; tool_use to tool_calls;
    tool_result to tool messages before the user's text), tool_choice any to required, the last breakpoint's
    message; a tool_use in a user message is refused by name."""
    body = MessagesRequest.model_validate({
        "max_tokens": 8, "stop_sequences": ["END"], "system": [{"type": "text", "text": "A"}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "system", "content": "B"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                       {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "text", "text": "and?", "cache_control": EPHEMERAL},
                                                  {"type": "tool_result", "tool_use_id": "t1", "content": [
                                                      {"type": "text", "text": "sunny"}]}]}]})
    chat, last = chat_body(body, 8)
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [{"id": "t1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "content": "sunny", "tool_call_id": "t1"}, {"role": "user", "content": "and?"}]
    assert last == 4 and chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.max_tokens == 8 and chat.tools[0].function.parameters == WEATHER["input_schema"]
    bad = body.model_copy(update={"messages": [MessagesRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "get_weather", "input": {}}]}]}).messages[0]]})
    with pytest.raises(APIError) as e:
        chat_body(bad, 8)
    assert e.value.param == "messages.0.content.0"


def test_claude_code_2_1_fields_are_accepted():
    """What Claude Code 2.1.337 sent that was refused (tests/agents/ runs it): ``thinking.display`` "omitted" (a
    400: it retried without it) and a tool marked ``defer_loading`` (its placeholder for tool search), and its
    ``--effort`` offers ``xhigh``.  Accepted; a deferred tool is not offered to the model (no tool search here)."""
    placeholder = {"name": "DeferredToolPlaceholder", "description": "never call this tool",
                   "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
    body = MessagesRequest.model_validate({
        "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, placeholder],
        "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "xhigh"}})
    assert check_fields(body, RequestContext(served=None)) == ["output_config.effort", "thinking"]
    chat, _ = chat_body(body, 8)
    assert [t.function.name for t in chat.tools] == ["get_weather"]
    assert deferred_tools(body) == ["DeferredToolPlaceholder"]
    only_deferred = body.model_copy(update={"tools": body.tools[1:]})
    assert chat_body(only_deferred, 8)[0].tools is None and deferred_tools(only_deferred) == ["DeferredToolPlaceholder"]
    with pytest.raises(ValueError):  # display is one of Anthropic's two values
        MessagesRequest.model_validate({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                                        "thinking": {"type": "adaptive", "display": "verbose"}})


def test_the_session_headers_are_a_configurable_list():
    from types import SimpleNamespace

    from starlette.requests import Request

    from kvkeeper.api.common.context import SESSION_HEADERS, session_header

    def req(headers: dict, names=None) -> Request:
        app = SimpleNamespace(state=SimpleNamespace(session_headers=names))
        return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
                        "app": app})

    assert SESSION_HEADERS == ("X-Session-ID", "X-Claude-Code-Session-Id", "session-id")
    assert session_header(req({"X-Claude-Code-Session-Id": "cc-1"})) == "cc-1"
    assert session_header(req({"session-id": "codex-1", "X-Session-ID": "mine"})) == "mine"  # the list's order
    assert session_header(req({"session-id": "codex-1"}, ("X-Session-ID",))) is None  # --session-headers X-Session-ID
    assert session_header(req({"X-Foo": "f"}, ("X-Foo",))) == "f"
    with pytest.raises(APIError) as e:
        session_header(req({"session-id": "a b"}))
    assert e.value.param == "session-id"
