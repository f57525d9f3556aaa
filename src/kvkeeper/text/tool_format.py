"""Tool calls as text: the tools in the prompt, calls in the output, and the grammar that constrains them.

The format is the Hermes function-calling format (NousResearch's Hermes 2 Pro; Qwen2.5's chat
template renders the same), used for chat templates that have no tool syntax of their own (the
embedded SmolLM2's has none).  The tools go into the system message (appended after a blank line
to the request's system message, or as the system message when there is none)::

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": "get_weather", "description": ..., "parameters": {...}}}
    </tools>

    For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

A call in the output (and an assistant message's ``tool_calls`` in the history, rendered back the
same way, its ``arguments`` string verbatim, so a resent reply renders to the very text the model
generated) is ``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``,
several separated by a newline; a ``tool`` message's content is wrapped in ``<tool_response>\\n...
\\n</tool_response>`` under the role ``tool``.  A template that mentions ``tools`` gets them natively
(transformers' ``tools=``, calls as ``{"type": "function", "function": {"name", "arguments": dict}}``).
"""

from __future__ import annotations

import json
import re

from ..sampling.structured import with_json_format

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def template_reads_names(template: str | None) -> bool:
    """Whether a chat template renders a message's ``name`` (``message.name`` or ``message['name']``)."""
    return bool(template) and re.search(r"""\.name\b|\[\s*['"]name['"]\s*\]""", template) is not None


def call_prefix(name: str) -> str:
    """The text of a call up to its arguments."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it; ``arguments``: the JSON text of the arguments object."""
    return f"{call_prefix(name)}{arguments}}}\n{CALL_CLOSE}"


def tools_system_text(tools: list[dict]) -> str:
    """The system-prompt block describing ``tools`` (OpenAI ``{"type": "function", "function": ...}`` dicts)."""
    return TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER


def _as_text_message(m: dict) -> dict:
    calls = m.get("tool_calls") or []
    if m["role"] == "tool":
        return {"role": "tool", "content": f"{RESPONSE_OPEN}\n{m['content']}\n{RESPONSE_CLOSE}"}
    out = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
    if calls:
        text = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
        out["content"] = f"{m['content']}\n{text}" if m.get("content") else text
    return out


def _as_native_message(m: dict) -> dict:
    out = dict(m)
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
            "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m["tool_calls"]]
    return out


def prepare_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> tuple[list[dict], dict]:
    """(messages, extra keyword arguments) for ``apply_chat_template``.

    messages: dicts with ``role``, ``content`` and, for assistant calls, OpenAI's ``tool_calls`` (each
    ``{"id", "type", "function": {"name", "arguments": JSON text}}``); native: the template renders tools.
    """
    if native:
        return [_as_native_message(m) for m in messages], ({"tools": tools} if tools else {})
    msgs = [_as_text_message(m) for m in messages]
    if tools:
        block = tools_system_text(tools)
        if msgs and msgs[0]["role"] == "system":
            first = msgs[0]["content"]
            msgs[0] = {**msgs[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            msgs.insert(0, {"role": "system", "content": block})
    return msgs, {}


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of the text between a call's tags, or None when it is not a call.

    The arguments are the generated text itself when the call has the canonical layout
    (:func:`call_text`), else the arguments object re-serialised.
    """
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    head = call_prefix(obj["name"])[len(CALL_OPEN) + 1:]
    if body.startswith(head) and body.endswith("}"):
        raw = body[len(head):-1]
        try:
            if json.loads(raw) == args:
                return obj["name"], raw
        except ValueError:
            pass
    return obj["name"], json.dumps(args, ensure_ascii=False)


class CallParser:
    """Splits generated text into content and calls as it streams in.

    feed(text) -> (content, calls) released so far; flush() -> the rest at the end.  Text that may be
    the start of ``<tool_call>`` is held back; a call is released when a closing tag arrives after which
    it parses.  Markup is never content: :meth:`flush` drops an opened call that never parsed (e.g. cut by
    ``max_tokens``) and an opening tag cut short (``<t`` ... ``<tool_call``).  Whitespace around calls is dropped,
    as is trailing whitespace.
    """

    def __init__(self):
        self.buf = ""
        self.after_call = False

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        self.buf += text
        content, calls = "", []
        while True:
            start = self.buf.find(CALL_OPEN)
            if start < 0:
                keep = _held_back(self.buf)
                content += self._content(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return content, calls
            before = self.buf[:start].rstrip()
            content += self._content(before)
            self.buf = self.buf[len(before):]  # the whitespace before the tag stays until the call is known
            end, call = self._first_call()
            if call is None:  # no closing tag yet ends a parsable call: wait (flush releases it as content)
                return content, calls
            calls.append(call)
            self.after_call = True
            self.buf = self.buf[end:]

    def _first_call(self) -> tuple[int, tuple[str, str] | None]:
        """(end, call) of the call opening ``buf``: the first ``</tool_call>`` after which the text parses
        (a closing tag inside a JSON string of the arguments is part of them), else (-1, None)."""
        end = self.buf.find(CALL_CLOSE)
        while end >= 0:
            end += len(CALL_CLOSE)
            call = parse_call(self.buf[:end].strip()[len(CALL_OPEN): -len(CALL_CLOSE)].strip())
            if call is not None:
                return end, call
            end = self.buf.find(CALL_CLOSE, end)
        return -1, None

    def _content(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text

    def flush(self) -> tuple[str, list[tuple[str, str]]]:
        rest, self.buf = self.buf.rstrip(), ""
        start = rest.find(CALL_OPEN)
        if start >= 0:  # a call cut short (max_tokens) or one that never parsed: markup, never content
            rest = rest[:start].rstrip()
        elif len(rest.lstrip()) > 1 and CALL_OPEN.startswith(rest.lstrip()):  # the tag itself cut short
            rest = ""
        return self._content(rest), []


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` to hold: trailing whitespace plus a partial ``<tool_call>``."""
    n = 0
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            n = k
            break
    body = text[: len(text) - n]
    return n + len(body) - len(body.rstrip())


def split_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of a whole output, exactly as :class:`CallParser` streams them."""
    p = CallParser()
    c1, calls = p.feed(text)
    c2, _ = p.flush()
    return c1 + c2, calls


def _call_rule(head: str, parameters: dict | None) -> str:
    """A Lark rule body: the literal ``head``, the arguments (their JSON schema) and the call's end."""
    schema = with_json_format({"type": "object", **(parameters or {})})  # arguments are always an object
    return f"{json.dumps(head)} %json {json.dumps(schema)} {json.dumps('}' + chr(10) + CALL_CLOSE)}"


def _calls_rules(top: str, functions: list[dict], parallel: bool) -> str:
    """Lark rules: ``top`` is one call of ``functions`` (several, one a line, if ``parallel``), nothing else."""
    alts = " | ".join(_call_rule(call_prefix(f["name"]), f.get("parameters")) for f in functions)
    seq = 'call ("\\n" call)*' if parallel else "call"
    return f"{top}: {seq}\ncall: {alts}\n"


def call_grammar(functions: list[dict], required: bool, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for calls of ``functions`` (``{"name", "parameters"}`` dicts).

    required: the output is calls only (at least one); else free text in which every ``<tool_call>``
    must be a valid call (llguidance's lazy trigger, as its ``StructTag``).  parallel: several calls
    allowed, else at most one (nothing follows it).  Each call's arguments follow its function's schema.
    """
    if required:
        return _calls_rules("start", functions, parallel)
    tags = [f"tag_{i}" for i in range(len(functions))]
    lines = ["%llguidance {}", ("start: (" + " | ".join(tags) + ")* tag_end") if parallel else
             "start: tag_end | " + " | ".join(tags), "tag_end: TAG_TEXT", "TAG_TEXT: /(.|\\n)*/"]
    for tag, f in zip(tags, functions):
        body = _call_rule(call_prefix(f["name"])[len(CALL_OPEN):], f.get("parameters"))
        lines += [f"{tag}_trig[lazy]: TAG_TEXT {json.dumps(CALL_OPEN)}", f"{tag}: {tag}_trig {body}"]
    return "\n".join(lines) + "\n"


def format_or_calls_grammar(schema: dict, functions: list[dict], parallel: bool) -> str:
    """A Lark grammar for tool_choice ``auto`` with a JSON output format (OpenAI's ``text.format`` /
    ``response_format`` beside tools, as Codex CLI's ``--output-schema`` sends them): the output is either one JSON
    value of ``schema`` (the final answer) or calls of ``functions`` as :func:`call_grammar` with ``required``
    gives them (``parallel``: several calls allowed)."""
    reply = f"reply: %json {json.dumps(with_json_format(schema))}\n"
    return "start: reply | calls\n" + reply + _calls_rules("calls", functions, parallel)
