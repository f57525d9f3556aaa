"""kvkeeper's Gemma chat template (``kvkeeper.text.tokenizer.GEMMA_CHAT_TEMPLATE``, for GGUF files without one):
system messages anywhere in a conversation are read, none dropped, and each request's prompt plus the reply is
the prefix of the next request's prompt (what an agent's session relies on to reuse its KV)."""

from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvkeeper.text.tokenizer import GEMMA_CHAT_TEMPLATE

# transformers renders chat templates in this environment (trim_blocks, lstrip_blocks)
_TEMPLATE = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(GEMMA_CHAT_TEMPLATE)


def render(messages, add_generation_prompt=True):
    return _TEMPLATE.render(messages=messages, bos_token="<bos>", add_generation_prompt=add_generation_prompt)


def test_leading_system_opens_the_first_user_turn():
    assert render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == (
        "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n")


def test_system_after_the_last_user_turn_is_read_not_dropped():
    """Claude Code's first request: [user, system(environment)]; the environment was dropped before the fix."""
    msgs = [{"role": "system", "content": "S0"}, {"role": "user", "content": "U1"},
            {"role": "system", "content": "ENV"}]
    assert render(msgs) == "<bos><start_of_turn>user\nS0\n\nU1\n\nENV<end_of_turn>\n<start_of_turn>model\n"


def test_system_after_a_model_turn_opens_the_next_user_turn_or_stands_alone():
    base = [{"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"},
            {"role": "system", "content": "S"}]
    assert render(base + [{"role": "user", "content": "U2"}]).endswith(
        "<start_of_turn>model\nA1<end_of_turn>\n<start_of_turn>user\nS\n\nU2<end_of_turn>\n<start_of_turn>model\n")
    assert render(base).endswith(
        "<start_of_turn>model\nA1<end_of_turn>\n<start_of_turn>user\nS<end_of_turn>\n<start_of_turn>model\n")


def test_claude_code_second_request_extends_the_first():
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Reply OK."},
             {"role": "system", "content": "# Environment\ncwd: /tmp"}]
    second = first + [{"role": "assistant", "content": "OK"}, {"role": "user", "content": "Again."}]
    assert render(second).startswith(render(first) + "OK<end_of_turn>\n")


_text = st.text(alphabet="abc xyz", min_size=1, max_size=6).map(str.strip).filter(bool)
_msg = st.builds(lambda role, text: {"role": role, "content": text},
                 st.sampled_from(["system", "user", "assistant", "tool"]), _text)


@settings(max_examples=300, deadline=None)
@given(st.lists(_msg, min_size=1, max_size=8), _text, st.lists(_msg, max_size=4))
def test_prompt_plus_reply_is_the_prefix_of_the_next_prompt(conversation, reply, later):
    """For any conversation, its prompt, the reply and the end of turn are the start of the prompt of the same
    conversation with the reply and any later messages appended; every message's text is in the prompt."""
    prompt = render(conversation)
    nxt = render(conversation + [{"role": "assistant", "content": reply}] + later)
    assert nxt.startswith(prompt + reply + "<end_of_turn>\n")
    for m in conversation:
        assert m["content"] in prompt
