"""Tool calling over the chat endpoint: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

The tools are rendered into the prompt by the engine (:mod:`kvkeeper.text.tool_format`: the chat
template's own syntax, or the documented Hermes system-prompt format); the calls are constrained by
a grammar built from each function's JSON schema (:func:`kvkeeper.text.tool_format.call_grammar`):

* ``none``: no call is constrained or parsed (the tools are still in the prompt, as vLLM does);
* ``auto`` (the default with tools): free text, but every ``<tool_call>`` the model opens must be a
  valid call of a given function;
* ``required``: the output is one call or more, nothing else;
* ``{"type": "function", "function": {"name": ...}}``: calls of that function only.

``parallel_tool_calls`` (default true) false allows one call at most.  Calls come back as
``message.tool_calls`` (streamed: ``delta.tool_calls``, one complete call per delta as each call's
closing tag arrives) with ``finish_reason`` ``tool_calls``; the text outside calls is the content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from ...sampling.structured import StructuredOutput
from ...text.tool_format import CallParser, call_grammar, format_or_calls_grammar
from .errors import APIError


@dataclass
class ToolUse:
    """A request's tools: OpenAI tool dicts (for the prompt), the choice and whether calls may be parallel."""

    tools: list[dict]
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None
    parallel: bool = True
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)  # a namespace's function's name -> (namespace, name)

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def structured(self) -> StructuredOutput | None:
        """The grammar of the calls (None for ``none``)."""
        if self.choice == "none":
            return None
        fns = [t["function"] for t in self.tools if self.choice != "named" or t["function"]["name"] == self.name]
        return StructuredOutput("lark", call_grammar(fns, self.choice != "auto", self.parallel), "tool_choice")

    def structured_or_json(self, schema: dict, param: str) -> StructuredOutput:
        """``auto`` beside a JSON output format (the request field ``param``): the grammar of an output that is
        either one JSON value of ``schema`` or calls of the tools."""
        fns = [t["function"] for t in self.tools]
        return StructuredOutput("lark", format_or_calls_grammar(schema, fns, self.parallel), param)


def tool_use_of(body) -> ToolUse | None:
    """The request's :class:`ToolUse` (``body``: a chat body, or the Responses API's tools as
    :func:`kvkeeper.api.responses.items.tool_use_of_body` gives them: ``tools``, ``tool_choice``,
    ``parallel_tool_calls``), or None without tools; 400 for a choice or option without tools,
    duplicate function names or a named function that is not among the tools."""
    if not body.tools:
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(body, name) is not None and not (name == "tool_choice" and body.tool_choice == "none"):
                raise APIError(400, f"{name} needs tools: give the functions the model may call in tools",
                               param=name)
        return None
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools]
    for i, t in enumerate(tools):
        params = t["function"].get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise APIError(400, f"a function's parameters must be a JSON schema of an object (its arguments), got "
                           f"type {params.get('type')!r}", param=f"tools.{i}.function.parameters")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two functions have the same name", param="tools")
    tc = body.tool_choice or "auto"
    use = ToolUse(tools, tc if isinstance(tc, str) else "named", None, body.parallel_tool_calls is not False)
    if not isinstance(tc, str):
        use.name = tc.function.name
        if use.name not in names:
            raise APIError(400, f"tool_choice names {use.name!r}, which is not among the tools ({', '.join(names)})",
                           param="tool_choice")
    return use


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChoiceCalls:
    """Splits one choice's text into content and tool calls, streamed or whole."""

    parser: CallParser = field(default_factory=CallParser)
    count: int = 0

    def _calls(self, calls: list[tuple[str, str]], streamed: bool) -> list[dict]:
        out = []
        for name, args in calls:
            out.append({**({"index": self.count} if streamed else {}), "id": _call_id(), "type": "function",
                        "function": {"name": name, "arguments": args}})
            self.count += 1
        return out

    def feed(self, text: str, final: bool, streamed: bool = True) -> tuple[str, list[dict]]:
        """(content, calls) released by ``text``; ``final``: the choice ended.  Calls are ``delta.tool_calls``
        entries (with ``index``) when ``streamed``, else ``message.tool_calls`` entries."""
        content, calls = self.parser.feed(text)
        if final:
            rest, more = self.parser.flush()
            content, calls = content + rest, calls + more
        return content, self._calls(calls, streamed)


def finish_with_calls(reason: str | None, calls: ChoiceCalls) -> str | None:
    """``tool_calls`` for a choice that stopped after calling tools, else the reason as is."""
    return "tool_calls" if reason == "stop" and calls.count else reason
