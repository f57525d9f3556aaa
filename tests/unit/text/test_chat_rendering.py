"""Conversations with tools and assistant prefill through the library's door (LLMEngine.render_chat,
Session.begin_turn), on the embedded model: what the server's chat requests run on."""

from __future__ import annotations

import json

import pytest

from kvkeeper import InvalidRequestError, SamplingParams
from kvkeeper.text.tool_format import call_text, tools_system_text
from tests.utils.sessionutil import sessions_of

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_render_chat_options(engine):
    msgs = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Waves upon the"}]
    text = engine.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nWaves upon the")
    assert engine.render_chat(msgs[:1], add_generation_prompt=False).endswith("Write a haiku.<|im_end|>\n")
    with pytest.raises(InvalidRequestError) as ei:
        engine.render_chat(msgs, add_generation_prompt=True, continue_final_message=True)
    assert ei.value.param == "continue_final_message"
    with pytest.raises(InvalidRequestError) as ei:  # SmolLM2's template renders no participant names
        engine.render_chat([{"role": "user", "content": "hi", "name": "bob"}])
    assert ei.value.param == "messages.0.name"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    text = engine.render_chat([{"role": "user", "content": "Weather in Oslo?"},
                               {"role": "assistant", "content": "", "tool_calls": [call]},
                               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n" + tools_system_text([WEATHER]) + "<|im_end|>")
    assert (f"<|im_start|>assistant\n{call_text('get_weather', json.dumps({'city': 'Oslo'}))}<|im_end|>\n"
            "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>") in text


def test_a_continued_message_is_recorded_as_one_message(engine):
    s = sessions_of(engine).open()
    try:
        msgs = [{"role": "user", "content": "Write a haiku about the sea."},
                {"role": "assistant", "content": "Waves upon the"}]
        seq = s.begin_turn(messages=msgs, params=SamplingParams(max_tokens=6), add_generation_prompt=False,
                           continue_final_message=True)
        engine.run_until_done([seq])
        assert s.messages == [msgs[0], {"role": "assistant", "content": "Waves upon the" + seq.text}]
        # the next turn resends the whole message: the session continues from its own tokens
        nxt = s.begin_turn(messages=s.messages + [{"role": "user", "content": "Another one."}],
                           params=SamplingParams(max_tokens=2))
        assert nxt.num_handed_over >= len(seq.token_ids) - 1
        engine.run_until_done([nxt])
    finally:
        s.close()
