"""``/v1/responses`` on sessions (issue 25), driven by the official ``openai`` client against a real server: a
6-turn ``previous_response_id`` conversation equal to full-history chat completions with the whole previous turn
cached, branching (shared blocks, independent replies), the function tool round trip, typed stream events,
stored / deleted / unstored responses, tenancy, refused fields, ``text.format`` and ``prompt_cache_key``.

One server (the embedded SmolLM2-135M, two API keys: tenants alice and bob) is shared by the module; replies are
greedy and short.
"""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from tests.utils.serverproc import running_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ALICE = {"Authorization": "Bearer sk-alice"}
BLOCK = 16  # tokens per KV block (the server's default)
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
LONG_PROMPT = ("Here is a long note about the history of cartography, maps, globes and the people who drew them. " * 6
               + "Summarise it in one sentence.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("responses")
    keys = d / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    with running_server(d / "server.log", "--max-model-len", "2048",
                        "--api-keys-file", str(keys)) as base:
        yield base


def _client(server, key):
    return openai.OpenAI(base_url=server + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(server):
    return _client(server, "sk-alice")


@pytest.fixture(scope="module")
def bob(server):
    return _client(server, "sk-bob")


def _create(client, input, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 12)
    return client.responses.create(model=MODEL, input=input, **kw)


def _chat(client, messages, max_tokens=12, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kw)


def _pinned_blocks(server) -> float:
    text = httpx.get(server + "/metrics", timeout=10).text
    return float(re.search(r"^kvkeeper:pinned_blocks (\S+)$", text, re.M).group(1))


def _sessions(server) -> dict[str, dict]:
    return {s["id"]: s for s in httpx.get(server + "/v1/sessions", headers=ALICE, timeout=10).json()["data"]}


def test_six_turns_equal_full_history_chat_with_the_previous_turn_cached(alice):
    questions = ["Name a colour.", "Name an animal.", "Name a fruit.", "Name a city.", "Name a planet.",
                 "Name a tree."]
    history, prev = [], None
    for k, q in enumerate(questions):
        r = _create(alice, q, previous_response_id=prev.id if prev else None)
        history.append({"role": "user", "content": q})
        chat = _chat(alice, history)
        assert r.output_text == chat.choices[0].message.content, k
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                chat.usage.completion_tokens), k
        if prev is not None:  # the whole previous prompt and reply, but its last token (never run through the model)
            assert r.usage.input_tokens_details.cached_tokens == prev.usage.input_tokens + prev.usage.output_tokens - 1
        history.append({"role": "assistant", "content": r.output_text})
        prev = r
    assert alice.responses.retrieve(prev.id).output_text == prev.output_text


def test_branches_share_blocks_and_reply_as_independent_chats(server, alice):
    first = "My name is Ada and I live in Oslo. Say hello."
    r1 = _create(alice, first, max_output_tokens=20)
    before = _pinned_blocks(server)
    qa, qb = "What is my name?", "Where do I live?"
    ra = _create(alice, qa, previous_response_id=r1.id)
    mid = _pinned_blocks(server)
    rb = _create(alice, qb, previous_response_id=r1.id)
    after = _pinned_blocks(server)
    listed = _sessions(server)
    shared = (r1.usage.input_tokens + r1.usage.output_tokens - 1) // BLOCK  # r1's full blocks
    assert shared >= 2
    # each branch pins r1's full blocks by reference: only its own blocks are new in the pool
    assert mid - before == listed[ra.id]["blocks"] - shared
    assert after - mid == listed[rb.id]["blocks"] - shared
    base = [{"role": "user", "content": first}, {"role": "assistant", "content": r1.output_text}]
    for r, q in ((ra, qa), (rb, qb)):
        chat = _chat(alice, base + [{"role": "user", "content": q}])
        assert r.output_text == chat.choices[0].message.content
        assert r.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1
    # a third turn on branch b never sees branch a's tokens: it equals the chat of b's own history
    rb2 = _create(alice, "Say it again.", previous_response_id=rb.id)
    chat = _chat(alice, base + [{"role": "user", "content": qb}, {"role": "assistant", "content": rb.output_text},
                                {"role": "user", "content": "Say it again."}])
    assert rb2.output_text == chat.choices[0].message.content
    assert rb2.usage.input_tokens_details.cached_tokens == rb.usage.input_tokens + rb.usage.output_tokens - 1


def test_function_tool_round_trip_reuses_the_kv(alice):
    r1 = _create(alice, "What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=False, max_output_tokens=48)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments), dict)
    r2 = _create(alice, [{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp_c": 21}'}],
                 previous_response_id=r1.id, tools=TOOLS, max_output_tokens=16)
    assert r2.status in ("completed", "incomplete") and r2.output[0].type == "message"
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1
    with pytest.raises(openai.BadRequestError) as ei:
        _create(alice, [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}],
                previous_response_id=r1.id, tools=TOOLS)
    assert ei.value.body["param"] == "input.0.call_id"
    with alice.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, temperature=0,
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=48) as st:
        kinds = [e.type for e in st]
        final = st.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [(o.type, o.name, o.arguments) for o in final.output] == [(c.type, c.name, c.arguments) for c in calls]


def test_stream_events_equal_the_stored_response(alice):
    q = "Name two colours."
    whole = _create(alice, q, store=False)
    with alice.responses.stream(model=MODEL, input=q, temperature=0, max_output_tokens=12) as st:
        events = list(st)
        final = st.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if final.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.output_text == whole.output_text and events[0].response.id == final.id
    assert alice.responses.retrieve(final.id).output_text == final.output_text


def test_deleted_and_unstored_responses_are_gone_with_their_sessions(server, alice):
    r = _create(alice, "Say yes.")
    assert r.id in _sessions(server)
    items = alice.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == ["Say yes."]
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    assert r.id not in _sessions(server)
    u = _create(alice, "Say no.", store=False)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(u.id)
    assert u.id not in _sessions(server)
    kept = _create(alice, "Say maybe.")
    cont = _create(alice, "Again.", previous_response_id=kept.id, store=False)  # continues, then its fork is closed
    assert cont.usage.input_tokens_details.cached_tokens == kept.usage.input_tokens + kept.usage.output_tokens - 1
    assert cont.id not in _sessions(server) and kept.id in _sessions(server)


def test_another_tenants_response_is_not_found(alice, bob):
    r = _create(alice, "A secret: 4711.")
    for call in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.delete(r.id),
                 lambda: bob.responses.input_items.list(r.id),
                 lambda: _create(bob, "What was the secret?", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.responses.retrieve(r.id).id == r.id


@pytest.mark.parametrize("extra,param", [
    ({"background": True}, "background"), ({"frobnicate": 1}, "frobnicate"),
    ({"prompt_cache_retention": "7d"}, "prompt_cache_retention"), ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "description": "d"}}},
     "text.format.description"),
    ({"input": [{"role": "user", "content": "hi", "colour": "red"}]}, "input.0.colour"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_unapplied_fields_are_refused_by_name(server, extra, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
    r = httpx.post(server + "/v1/responses", json=body, headers=ALICE, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": "hi"},
                   headers={**ALICE, "X-Session-ID": "s1"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-ID"


def test_instructions_and_json_schema_format(alice):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    r = _create(alice, "Pick a colour.", instructions="Answer in JSON.", max_output_tokens=24,
                text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert json.loads(r.output_text)["colour"] in ("red", "blue")
    assert r.instructions == "Answer in JSON." and r.text.format.type == "json_schema"
    chat = _chat(alice, [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Pick a colour."}],
                 max_tokens=24, response_format={"type": "json_schema", "json_schema": {"name": "pick",
                                                                                        "schema": schema}})
    assert chat.choices[0].message.content == r.output_text


def test_prompt_cache_key_scopes_the_cache(alice, bob):
    key, other = f"k-{uuid.uuid4().hex}", f"k-{uuid.uuid4().hex}"
    msgs = [{"role": "user", "content": LONG_PROMPT}]

    def cached(client, k, route="chat"):
        if route == "chat":
            return _chat(client, msgs, 2, extra_body={"prompt_cache_key": k}).usage.prompt_tokens_details.cached_tokens
        r = _create(client, LONG_PROMPT, store=False, max_output_tokens=2, prompt_cache_key=k)
        return r.usage.input_tokens_details.cached_tokens

    assert cached(alice, key) == 0
    assert cached(alice, key) > 0 and cached(alice, key, "responses") > 0  # one entry on both routes
    assert cached(alice, other) == 0 and cached(bob, key) == 0  # another key, another tenant's same key


def test_session_fork_route_shares_blocks_and_continues_both(server, alice):
    sid = f"conv-{uuid.uuid4().hex[:8]}"
    msgs = [{"role": "user", "content": "My name is Ada and I live in Oslo. Say hello."}]
    r1 = _chat(alice, msgs, 20, extra_headers={"X-Session-ID": sid})
    fork = httpx.post(f"{server}/v1/sessions/{sid}/fork", params={"id": sid + "-b"}, headers=ALICE, timeout=30)
    assert fork.status_code == 200, fork.text
    assert fork.json()["shared_blocks"] == (r1.usage.total_tokens - 1) // BLOCK and fork.json()["turns"] == 1
    msgs.append({"role": "assistant", "content": r1.choices[0].message.content})
    for s, q in ((sid, "What is my name?"), (sid + "-b", "Where do I live?")):
        r = _chat(alice, msgs + [{"role": "user", "content": q}], extra_headers={"X-Session-ID": s})
        assert r.usage.prompt_tokens_details.cached_tokens == r1.usage.total_tokens - 1
        assert r.choices[0].message.content == _chat(alice, msgs + [{"role": "user", "content": q}]).choices[
            0].message.content
    again = httpx.post(f"{server}/v1/sessions/{sid}/fork", params={"id": sid + "-b"}, headers=ALICE, timeout=30)
    assert again.status_code == 409 and again.json()["error"]["param"] == "id"
    other = httpx.post(f"{server}/v1/sessions/{sid}/fork", headers={"Authorization": "Bearer sk-bob"}, timeout=30)
    assert other.status_code == 404


def test_conversation_holds_its_items_and_their_kv(server, alice, bob):
    conv = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                      metadata={"topic": "names"})
    assert conv.metadata == {"topic": "names"} and alice.conversations.retrieve(conv.id).id == conv.id
    r1 = _create(alice, "Say hello to me.", conversation=conv.id, max_output_tokens=16)
    r2 = _create(alice, "What is my name?", conversation=conv.id, store=False)
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1
    chat = _chat(alice, [{"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "Say hello to me."},
                         {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "What is my name?"}])
    assert r2.output_text == chat.choices[0].message.content and r2.conversation.id == conv.id
    items = alice.conversations.items.list(conv.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "My name is Ada."), ("user", "Say hello to me."), ("assistant", r1.output_text),
        ("user", "What is my name?"), ("assistant", r2.output_text)]
    assert alice.conversations.items.retrieve(items[2].id, conversation_id=conv.id).id == items[2].id
    added = alice.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Hi."}])
    assert [i.content[0].text for i in added.data] == ["Hi."]
    alice.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert len(alice.conversations.items.list(conv.id).data) == 5
    for call in (lambda: bob.conversations.retrieve(conv.id), lambda: bob.conversations.items.list(conv.id),
                 lambda: _create(bob, "What is my name?", conversation=conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as ei:
        _create(alice, "x", conversation=conv.id, previous_response_id=r1.id)
    assert ei.value.body["param"] == "conversation"
    assert conv.id in _sessions(server)
    alice.conversations.delete(conv.id)
    assert conv.id not in _sessions(server)
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(conv.id)
