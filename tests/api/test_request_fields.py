"""The OpenAI request fields, against a real server with the official ``openai`` client: every request field
is applied or refused with a 400 that names it; sampling fields follow their references; structured
outputs, tool calls, assistant prefill, echo and prompt logprobs; the access log and gauges.

One server (the embedded SmolLM2-135M, greedy unless said) is shared by the module.  Status codes of the HTTP
layer on a fake engine: ``test_http_errors.py``; the endpoints' behaviour: ``test_openai_client.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import re
import typing
import uuid

import httpx
import pytest
from tests.utils.serverproc import running_server, wait_for_log

from kvkeeper.api.chat.protocol import ChatCompletionRequest
from kvkeeper.api.common.schemas import REFUSED
from kvkeeper.api.completions.protocol import CompletionRequest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
BANANA = "Repeat the word banana twenty times."


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("fidelity") / "server.log"


@pytest.fixture(scope="module")
def server(server_log):
    with running_server(server_log, "--max-model-len", "1024") as base:
        yield base


@pytest.fixture(scope="module")
def http(server):
    """One httpx client for the module's raw requests (``httpx.post`` builds a client, ~50 ms of CPU, per call)."""
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def _together(*calls):
    """The results of ``calls`` (callables without arguments), run at once: the server batches them, and the
    decode steps they share cost about one step's CPU.  Only for requests whose outputs no assertion compares with
    each other's bit for bit (on the float32 path the GEMM's rounding may depend on the batch)."""
    with cf.ThreadPoolExecutor(len(calls)) as ex:
        return [f.result() for f in [ex.submit(c) for c in calls]]


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


# ---- every field: applied, or refused with a 400 naming it -------------------------------------------

# field -> the test below that shows it applied
IMPLEMENTED = {
    "model": "test_openai_client.py::test_unknown_model_404", "messages": "test_openai_client.py",
    "prompt": "test_openai_client.py", "max_tokens": "test_openai_client.py",
    "max_completion_tokens": "test_openai_client.py", "temperature": "test_min_p...",
    "top_p": "test_openai_client.py", "top_k": "test_openai_client.py", "n": "test_openai_client.py::test_n2_seeded",
    "stop": "test_openai_client.py::test_stop", "seed": "test_openai_client.py", "stream": "test_openai_client.py",
    "stream_options": "test_openai_client.py", "logprobs": "test_openai_client.py::test_logprobs",
    "top_logprobs": "test_openai_client.py::test_logprobs", "ignore_eos": "test_openai_client.py",
    "cache_salt": "test_openai_client.py::test_cache_salt_isolation", "kv_compression": "test_openai_client.py",
    "return_token_ids": "test_stop_token_ids", "user": "test_access_log_line",
    "safety_identifier": "test_access_log_line", "logit_bias": "test_logit_bias",
    "presence_penalty": "test_presence_and_frequency_penalties",
    "frequency_penalty": "test_presence_and_frequency_penalties", "repetition_penalty": "test_repetition_penalty",
    "min_p": "test_min_p", "stop_token_ids": "test_stop_token_ids", "bad_words": "test_bad_words",
    "response_format": "test_json_schema_outputs_validate", "guided_json": "test_guided_fields",
    "guided_regex": "test_guided_fields", "guided_choice": "test_guided_fields",
    "guided_grammar": "test_guided_fields", "structured_outputs": "test_guided_fields",
    "prompt_logprobs": "test_prompt_logprobs_independent_of_the_cache", "tools": "test_tool_calls",
    "tool_choice": "test_tool_calls", "parallel_tool_calls": "test_tool_calls",
    "add_generation_prompt": "test_continue_final_message", "continue_final_message": "test_continue_final_message",
    "echo": "test_echo", "best_of": "test_every_field_is_applied_or_refused (best_of == n)",
    "context_policy": "test_context_server.py::test_last_policy_header_body_400_and_metrics",
    "context_budget": "test_context_server.py::test_last_policy_header_body_400_and_metrics",
    "prompt_cache_key": "test_responses_api.py::test_prompt_cache_key_scopes_the_cache",
    "prompt_cache_retention": "test_cache_retention.py::test_prompt_cache_retention_24h_holds_the_prompt_on_chat",
    "prediction": "test_speculative_server.py::test_prediction_is_used_and_counted_and_changes_nothing",
    "speculative_decoding": "test_speculative_server.py::test_prediction_is_used_and_counted_and_changes_nothing",
    "session_compression": "test_session_compression_api.py::test_a_compressed_two_turn_session_and_its_errors",
    "session_compression_ratio": "test_session_compression_api.py::test_a_compressed_two_turn_session_and_its_errors",
    "min_tokens": "test_bench_clients_server.py::test_min_tokens_masks_stop_tokens_until_reached",
    "conversation_id": "test_bench_clients_server.py::test_conversation_id_is_a_session",
}
# a value that is not the field's no-op, for each refused field
NOT_NOOP = {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "function_call": "auto",
    "functions": [{"name": "f"}], "reasoning_effort": "low", "verbosity": "low", "web_search_options": {}, "service_tier": "flex", "store": True, "metadata": {"k": "v"},
    "prompt_cache_key": "k", "prompt_cache_options": {"x": 1}, "moderation": {"x": 1},
    "suffix": "end"}


def _wire_names(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_every_field_is_applied_or_refused(server):
    from openai.types import completion_create_params as cp
    from openai.types.chat import completion_create_params as ccp

    openai_chat = set(typing.get_type_hints(ccp.CompletionCreateParamsBase)) | {"stream"}
    openai_cmpl = set(typing.get_type_hints(cp.CompletionCreateParamsBase)) | {"stream"}
    assert openai_chat <= _wire_names(ChatCompletionRequest), openai_chat - _wire_names(ChatCompletionRequest)
    assert openai_cmpl <= _wire_names(CompletionRequest), openai_cmpl - _wire_names(CompletionRequest)
    jobs = []  # (path, field, refused body, body with the field's no-op value)
    for model, path, base in ((ChatCompletionRequest, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                              (CompletionRequest, "/v1/completions", {"prompt": "hi", "max_tokens": 1})):
        for name in sorted(_wire_names(model)):
            if name in IMPLEMENTED:
                continue
            assert name in REFUSED, f"{name} is neither implemented nor refused"
            jobs.append((path, name, {**base, name: NOT_NOOP[name]}, {**base, name: REFUSED[name][0][-1]}))
    # one client for all (a new one per call costs ~50 ms of CPU), the requests several at once (the server
    # batches them); each answer is checked on its own
    with httpx.Client(base_url=server, timeout=180) as http, cf.ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda j: (http.post(j[0], json=j[2]), http.post(j[0], json=j[3])), jobs))
        for (path, name, _, _), (refused, noop) in zip(jobs, answers, strict=True):
            err = _error(refused)
            assert err["param"] == name and "not supported" in err["message"], err
            assert noop.status_code == 200, (path, name, noop.text)  # bounds, not timings: a loaded CI machine
        err = _error(http.post("/v1/completions", json={"prompt": "hi", "best_of": 2}))
    assert err["param"] == "best_of"


@pytest.mark.parametrize("body,param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages.0.colour"),
    ({"stream_options": {"include_usage": True, "chunk_size": 3}, "stream": True}, "stream_options.chunk_size"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name"),  # no names in the template
    ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages.0.refusal"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "call_9"}]}, "messages.0.tool_call_id"),
    ({"stream_options": {"include_obfuscation": True}, "stream": True}, "stream_options.include_obfuscation"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: it would do nothing
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": "a cat",
                                                                 "schema": {"type": "object"}}}},
     "response_format.json_schema.description"),
    ({"tools": [{"type": "function", "function": {"name": "ping", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"seed": 2**70}, "seed"), ({"seed": 2**63 - 1, "n": 2, "temperature": 1}, "seed"),
])
def test_unknown_and_unusable_fields_are_named(http, body, param):
    full = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **body}
    err = _error(http.post("/v1/chat/completions", json=full))
    assert err["param"] == param, err


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"not-an-id": 1}), ("logit_bias", {"35716": -101}), ("logit_bias", {"49152": 1}),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("min_p", 1.5), ("stop_token_ids", [-1]), ("stop_token_ids", [49152]), ("bad_words", [""]),
    ("prompt_logprobs", 21), ("top_logprobs", 21), ("guided_regex", "(["), ("guided_choice", []),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
    ("tool_choice", "required"),  # without tools
])
def test_out_of_range_values_are_400_naming_the_field(http, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    err = _error(http.post("/v1/chat/completions", json=body))
    assert err["param"].split(".")[0] == field, err


# ---- sampling fields against their references ---------------------------------------------------------


def test_logit_bias(client):
    plain = _chat(client, BANANA, max_tokens=8, logprobs=True, top_logprobs=2)
    first = plain.choices[0].logprobs.content[0]
    tid = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"prompt": first.token}).json()["tokens"]
    assert len(tid) == 1
    banned = _chat(client, BANANA, max_tokens=8, logprobs=True, top_logprobs=2, logit_bias={str(tid[0]): -100})
    # -100 removes the greedy token: the next most likely one (raw logprobs) is picked instead
    assert banned.choices[0].logprobs.content[0].token == first.top_logprobs[1].token
    forced = _chat(client, BANANA, max_tokens=6, logit_bias={"28": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [28] * 6  # +100 forces the token every time


def _penalised(entries, presence: float, frequency: float) -> list[str]:
    """The reference pick at each step: OpenAI's formula on the raw top logprobs (a per-row shift of the logits)."""
    out, picks = [], []
    for e in entries:
        scores = {t.token: t.logprob - frequency * out.count(t.token) - (presence if t.token in out else 0)
                  for t in e.top_logprobs}
        picks.append(max(scores, key=scores.get))
        out.append(e.token)
    return picks


def test_presence_and_frequency_penalties(client):
    kws = ({"presence_penalty": 2.0}, {"frequency_penalty": 1.5})
    plain, *penalised = _together(lambda: _chat(client, BANANA, max_tokens=16), *[
        lambda kw=kw: _chat(client, BANANA, max_tokens=16, logprobs=True, top_logprobs=20, **kw) for kw in kws])
    plain = plain.choices[0].message.content
    for kw, r in zip(kws, penalised, strict=True):
        entries = r.choices[0].logprobs.content
        assert r.choices[0].message.content != plain
        assert [e.token for e in entries] == _penalised(entries, kw.get("presence_penalty", 0),
                                                        kw.get("frequency_penalty", 0))


def test_repetition_penalty(client):
    plain, rep = (r.choices[0].message.content for r in _together(
        lambda: _chat(client, BANANA, max_tokens=24),
        lambda: _chat(client, BANANA, max_tokens=24, extra_body={"repetition_penalty": 1.3})))
    assert plain.lower().count("banana") > rep.lower().count("banana")  # exact reference: test_sampling_reference.py


def test_min_p(client):
    """Every sampled token passes vLLM's min-p rule at the temperature: lp - lp_max >= T * ln(min_p)."""
    t, mp = 1.5, 0.3
    kw = dict(max_tokens=16, temperature=t, seed=11, n=4, logprobs=True, top_logprobs=20)
    r, free = _together(lambda: _chat(client, "Write a sentence about the sea.", **kw, extra_body={"min_p": mp}),
                        lambda: _chat(client, "Write a sentence about the sea.", **kw))
    gaps = [e.logprob - e.top_logprobs[0].logprob for c in r.choices for e in c.logprobs.content]
    assert min(gaps) >= t * math.log(mp) - 1e-4
    assert min(e.logprob - e.top_logprobs[0].logprob for c in free.choices for e in c.logprobs.content) < t * math.log(mp)


def test_stop_token_ids(client):
    plain = _chat(client, BANANA, max_tokens=12, extra_body={"return_token_ids": True}).choices[0]
    ids = plain.model_extra["token_ids"]
    stop = ids[3]
    cut = _chat(client, BANANA, max_tokens=12, extra_body={"return_token_ids": True, "stop_token_ids": [stop]}).choices[0]
    assert cut.model_extra["token_ids"] == ids[: ids.index(stop) + 1] and cut.finish_reason == "stop"
    # the stop token's id is returned, its text is not (vLLM)
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(MODEL))
    assert cut.message.content == tok.decode(ids[: ids.index(stop)], skip_special_tokens=True)


def test_constraints_that_exclude_every_token_fail_only_their_own_request(server, client):
    body = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 10, "guided_choice": ["yes"],
            "bad_words": ["yes"]}
    with cf.ThreadPoolExecutor(1) as ex:
        other = ex.submit(lambda: _chat(client, "Count from one to fifty.", max_tokens=40,
                                        extra_body={"ignore_eos": True}))
        for temperature in (0, 1):
            r = httpx.post(server + "/v1/chat/completions", json={**body, "temperature": temperature}, timeout=60)
            assert r.status_code == 400 and "no token is allowed" in r.json()["error"]["message"], r.text
        assert other.result().choices[0].finish_reason == "length"


def test_bad_words(server, client):
    words = ["banana", "Banana"]
    spellings = [httpx.post(server + "/tokenize", json={"prompt": w}).json()["tokens"] for w in words]
    spellings += [httpx.post(server + "/tokenize", json={"prompt": " " + w}).json()["tokens"] for w in words]

    def has(ids):
        return any(ids[i:i + len(w)] == w for w in spellings for i in range(len(ids)))

    plain, banned = (r.choices[0] for r in _together(
        lambda: _chat(client, BANANA, max_tokens=16, extra_body={"return_token_ids": True}),
        lambda: _chat(client, BANANA, max_tokens=16, extra_body={"return_token_ids": True, "bad_words": words})))
    assert has(plain.model_extra["token_ids"]) and not has(banned.model_extra["token_ids"])


# ---- structured outputs ----------------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"animal": {"enum": ["cat", "dog", "bird"]}, "legs": {"type": "integer"},
     "colours": {"type": "array", "items": {"enum": ["black", "white", "orange", "grey"]}, "minItems": 1,
                 "maxItems": 3}}, "required": ["animal", "legs", "colours"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "location": {
        "type": "object", "properties": {"country": {"type": "string", "maxLength": 20},
                                         "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]}},
        "required": ["country", "continent"], "additionalProperties": False}}, "required": ["city", "location"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {"type": "number",
     "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "rating": {"enum": [1, 2, 3, 4, 5]}}, "required": ["title", "tags", "rating"], "additionalProperties": False},
]
PROMPTS = [
    ["Describe a person.", "Who wrote Hamlet?", "Invent a character for a story.", "Describe your best friend."],
    ["Describe a cat.", "Describe a dog.", "Describe a parrot.", "What pet should I get?"],
    ["Where is Paris?", "Tell me about Tokyo.", "Where is Nairobi?", "Describe Sydney."],
    ["Is the earth round?", "Is water wet?", "Can fish fly?", "Is 7 a prime number?"],
    ["Review a film you like.", "Review the book Dune.", "Rate a pizza.", "Review a song."],
]


def _json_request(client, prompt, schema, stream):
    kw = dict(max_tokens=96, response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema, "strict": True}})
    if not stream:
        r = _chat(client, prompt, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = list(_chat(client, prompt, stream=True, **kw))
    return ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            [c.choices[0].finish_reason for c in chunks if c.choices][-1])


def test_json_schema_outputs_validate(client):
    jobs = [(p, s, stream) for s, ps in zip(SCHEMAS, PROMPTS) for p in ps for stream in (False, True)]
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda j: _json_request(client, *j), jobs))
    assert len(jobs) == 40
    for (prompt, schema, stream), (text, reason) in zip(jobs, results):
        assert reason == "stop", (prompt, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_outputs_parse(client):
    prompts = ["Describe a cat.", "List three colours.", "Give me a recipe.", "What is the weather like?",
               "Describe a car."]
    with cf.ThreadPoolExecutor(5) as ex:
        rs = list(ex.map(lambda p: _chat(client, p, max_tokens=96, response_format={"type": "json_object"}), prompts))
    for r in rs:
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content


def test_guided_fields(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    choices = ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}})
    jsons = ({"guided_json": schema}, {"structured_outputs": {"json": schema}})
    phone, grammar, *rest = (r.choices[0].message.content for r in _together(  # each answer checked on its own
        lambda: _chat(client, "Give me a phone number.", max_tokens=16,
                      extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"}),
        lambda: _chat(client, "Pick a colour.", extra_body={"guided_grammar": 'root ::= "red" | "green" | "blue"'}),
        *[lambda body=body: _chat(client, "Is the sky blue?", extra_body=body) for body in choices],
        *[lambda body=body: _chat(client, "A number?", extra_body=body) for body in jsons]))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone)
    assert grammar in ("red", "green", "blue")
    for text in rest[:len(choices)]:
        assert text in ("yes", "no")
    for text in rest[len(choices):]:
        jsonschema.validate(json.loads(text), schema)
    with pytest.raises(openai.BadRequestError):  # two constraints at once
        _chat(client, "x", response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})


# ---- tool calls ------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"], "additionalProperties": False}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def test_tool_calls(client):
    h = {"X-Session-ID": f"tools-{uuid.uuid4().hex[:8]}"}
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = list(msgs)
    r1, named, none = _together(  # three independent first turns at once (the server batches them)
        lambda: client.chat.completions.create(model=MODEL, messages=first, tools=[WEATHER, TIME],
                                               tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                               temperature=0, extra_headers=h),
        lambda: client.chat.completions.create(model=MODEL, messages=first, tools=[WEATHER, TIME], max_tokens=64,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               parallel_tool_calls=False, temperature=0),
        lambda: client.chat.completions.create(model=MODEL, messages=first, tools=[WEATHER], tool_choice="none",
                                               max_tokens=8, temperature=0))
    c = r1.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    ncall = named.choices[0].message.tool_calls[0]
    assert ncall.function.name == "get_time"
    jsonschema.validate(json.loads(ncall.function.arguments), SCHEMA_OF["get_time"])
    # second turn: the tool's result; the session continues from its own tokens (the call renders as generated)
    msgs += [c.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], max_tokens=24,
                                        temperature=0, extra_headers=h)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.total_tokens - 1 > 0
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_streamed_tool_calls_equal_the_whole_response(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather and time in Rome?"}], tools=[WEATHER, TIME],
              tool_choice="required", max_tokens=96, temperature=0, parallel_tool_calls=True)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, reasons = [], []
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices:
            calls += ch.choices[0].delta.tool_calls or []
            reasons.append(ch.choices[0].finish_reason)
    assert [(t.function.name, t.function.arguments) for t in calls] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert calls and [t.index for t in calls] == list(range(len(calls))) and reasons[-1] == whole.finish_reason
    for t in calls:
        jsonschema.validate(json.loads(t.function.arguments), SCHEMA_OF[t.function.name])


# ---- assistant prefill, echo, prompt logprobs ----------------------------------------------------------


def test_continue_final_message(client):
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}, {"role": "assistant", "content": "Waves upon the"}]
    ext = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, extra_body=ext)
    ids = r.model_extra["prompt_token_ids"]
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(MODEL))  # transformers' tokenizer and chat template: the reference
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("assistant\nWaves upon the")  # inside the message: no end-of-turn marker
    assert ids == tok.encode(rendered, add_special_tokens=False)
    raw = client.completions.create(model=MODEL, prompt=rendered, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert raw.choices[0].model_extra["prompt_token_ids"] == ids and raw.choices[0].text == r.choices[0].message.content
    with pytest.raises(openai.BadRequestError):  # continuing needs add_generation_prompt false
        client.chat.completions.create(model=MODEL, messages=msgs, extra_body={"continue_final_message": True})


def test_echo(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  echo=True, logprobs=2)
    c, plain = r.choices[0], client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                       temperature=0)
    assert c.text == "The capital of France is" + plain.choices[0].text
    lp = c.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(lp.tokens).startswith("The capital of France is") and lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and lp.text_offset[1] == len(lp.tokens[0])


def test_each_logprobs_field_keeps_its_own_count(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=2, temperature=0, echo=True,
                                  logprobs=1, extra_body={"prompt_logprobs": 5})
    c = r.choices[0]
    assert c.logprobs.top_logprobs[0] is None
    assert all(1 <= len(t) <= 2 for t in c.logprobs.top_logprobs[1:])  # its top 1, plus the token itself
    assert all(5 <= len(d) <= 6 for d in c.model_extra["prompt_logprobs"][1:])
    r = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=2, temperature=0, echo=True,
                                  logprobs=5, extra_body={"prompt_logprobs": 0})
    assert all(len(d) == 1 for d in r.choices[0].model_extra["prompt_logprobs"][1:])
    # the sampled token is always among its top_logprobs (OpenAI: up to logprobs + 1 entries)
    s = client.completions.create(model=MODEL, prompt="Once upon a time", logprobs=1, max_tokens=12, temperature=1.5,
                                  seed=4).choices[0].logprobs
    assert all(t in top and len(top) <= 2 for t, top in zip(s.tokens, s.top_logprobs))


def test_prompt_logprobs_independent_of_the_cache(server):
    # On the default path (GGUF blocks in place, bf16 KV), which the module's server runs (the suite's default),
    # every kernel route is batch invariant, so the logprobs of a prompt are equal bit for bit cold, after a prefix
    # hit and batched with other prompts (on the float32 path torch's GEMM rounding depends on the number of rows in
    # the batch on some CPUs: seen on an Intel Xeon with MKL, 3.05e-5 on these logprobs, as documented).  A salt of
    # its own keeps the module's other requests out of its cache.
    # The client waits as long as the slowest CPU needs: without AVX-512 the C++ kernels run their portable scalar
    # path, where each of these 49-token prompts takes about 30 s on a 2-core AMD EPYC (the wait bounds a hang only).
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=900)
    prompt = "The history of cartography spans many centuries, from clay tablets to satellite images. " * 3
    salt = {"cache_salt": f"plp-{uuid.uuid4().hex}"}

    def score():
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 2, **salt})
        plp = r.choices[0].model_extra["prompt_logprobs"]
        assert plp[0] is None and len(plp) == r.usage.prompt_tokens
        return [(k, v["logprob"], v["rank"]) for d in plp[1:] for k, v in sorted(d.items())]

    cold = score()
    warm_up = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=salt)
    assert warm_up.usage.prompt_tokens_details.cached_tokens > 0  # the prefix is in the cache now
    warm = score()
    with cf.ThreadPoolExecutor(4) as ex:  # batched with each other and with another prompt, in any order
        other = ex.submit(lambda: client.completions.create(model=MODEL, prompt="Other words " * 40, max_tokens=8))
        batched = list(ex.map(lambda _: score(), range(3)))
        other.result()
    for got in [warm] + batched:
        assert got == cold  # token ids, logprobs (bit for bit) and ranks


# ---- access log, gauges ---------------------------------------------------------------------------------


def test_access_log_line(client, server_log):
    r = _chat(client, "Say hi.", max_tokens=3, user="alice-42")
    u = r.usage
    line = (f'"POST /v1/chat/completions" 200 prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} '
            f"cached_tokens={u.prompt_tokens_details.cached_tokens} ms=")
    wait_for_log(server_log, lambda text: any(line in ln and "user='alice-42'" in ln for ln in text.splitlines())
                 and re.search(r'access 127\.0\.0\.1:\d+ "GET /health" 200 prompt_tokens=- ', text))


def _gauge(base: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([-+0-9.eE]+)$", httpx.get(base + "/metrics").text, re.M)
    return float(m.group(1))


def test_gauges_are_published_before_the_response(server, client):
    for _ in range(4):
        sid = f"g-{uuid.uuid4().hex[:8]}"
        before = _gauge(server, "kvkeeper:sessions_open")
        _chat(client, "Hi", max_tokens=1, extra_headers={"X-Session-ID": sid})
        assert _gauge(server, "kvkeeper:sessions_open") == before + 1
        assert _gauge(server, "kvkeeper:pinned_blocks") > 0
        assert httpx.delete(f"{server}/v1/sessions/{sid}").status_code == 200
        assert _gauge(server, "kvkeeper:sessions_open") == before
