"""Responses API items: input items to the engine's chat messages, tools and ``text.format`` to the engine's
forms, and a reply's text to output items (``message`` with ``output_text``, ``function_call``).

Every function raises :class:`~kvkeeper.api.errors.APIError` (400) naming the field at fault.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

from ..sampling.structured import StructuredOutput
from .errors import APIError
from .responses_schema import FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponsesRequest
from .schemas import FunctionDefinition, FunctionName, NamedToolChoice, Tool
from .tools import ChoiceCalls, ToolUse, tool_use_of


def item_id(prefix: str) -> str:
    """A new item or response id: ``<prefix>_`` and 32 hex digits (``resp``, ``msg``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(i: int, m: MessageItem) -> str:
    if isinstance(m.content, str):
        return m.content
    return "\n".join(p.text for p in m.content)


def _arguments(i: int, c: FunctionCallItem) -> str:
    try:
        args = json.loads(c.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise APIError(400, f"input[{i}].arguments must be the JSON text of an object, as the response's "
                            "function_call item gave it", param=f"input.{i}.arguments")
    return c.arguments


def input_messages(body: ResponsesRequest, known_calls: set[str]) -> tuple[list[dict], list[dict], set[str]]:
    """(chat messages, input items as stored, call ids) of ``body.input``.  A ``function_call`` joins the
    assistant message before it (or starts one); a ``function_call_output`` becomes a ``tool`` message and must
    answer a call of ``known_calls`` (earlier responses') or of this input."""
    if isinstance(body.input, str):
        return ([{"role": "user", "content": body.input}],
                [{"type": "message", "id": item_id("msg"), "role": "user", "status": "completed",
                  "content": [{"type": "input_text", "text": body.input}]}], set())
    msgs: list[dict] = []
    calls: set[str] = set()
    for i, it in enumerate(body.input):
        if isinstance(it, MessageItem):
            msgs.append({"role": "system" if it.role == "developer" else it.role, "content": _text_of(i, it)})
        elif isinstance(it, FunctionCallItem):
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name,
                                                                      "arguments": _arguments(i, it)}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(it.call_id)
        elif isinstance(it, FunctionCallOutputItem):
            if it.call_id not in calls and it.call_id not in known_calls:
                raise APIError(400, f"input[{i}].call_id {it.call_id!r} answers no function call of this input or "
                                    "of the previous responses", param=f"input.{i}.call_id")
            msgs.append({"role": "tool", "tool_call_id": it.call_id, "content": it.output})
    if not msgs:
        raise APIError(400, "input is empty: give a string or at least one item", param="input")
    return msgs, [_stored_item(it) for it in body.input], calls


def _stored_item(it) -> dict:
    d = it.model_dump(exclude_none=True, by_alias=True)
    if isinstance(it, MessageItem):
        kind = "output_text" if it.role == "assistant" else "input_text"
        parts = [{"type": kind, "text": it.content}] if isinstance(it.content, str) else d["content"]
        d["content"] = parts
    d.setdefault("id", item_id("msg" if isinstance(it, MessageItem) else "fc" if isinstance(it, FunctionCallItem)
                                else "fco"))
    d.setdefault("status", "completed")
    return d


def tool_use_of_body(body: ResponsesRequest) -> ToolUse | None:
    """The request's :class:`~kvkeeper.api.tools.ToolUse` (tools in the chat form the engine renders), or None;
    the rules of :func:`~kvkeeper.api.tools.tool_use_of` (400 naming the field)."""
    tc = body.tool_choice
    chat = SimpleNamespace(
        tools=[Tool(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"})))
               for t in body.tools or []],
        tool_choice=NamedToolChoice(type="function", function=FunctionName(name=tc.name)) if tc is not None
        and not isinstance(tc, str) else tc, parallel_tool_calls=body.parallel_tool_calls)
    try:
        return tool_use_of(chat)
    except APIError as e:  # the chat form's names of the fields: tools.N.function.parameters
        e.param = e.param.replace(".function.", ".") if e.param else e.param
        raise


def text_format(body: ResponsesRequest) -> StructuredOutput | None:
    """The output constraint of ``text.format`` (None for plain text)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        if fmt is not None and (fmt.schema_ is not None or fmt.name is not None):
            raise APIError(400, "text.format.schema and name go with type json_schema", param="text.format")
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object", None, "text.format")
    if fmt.name is None:
        raise APIError(400, "text.format.name is missing: a json_schema format needs a name", param="text.format.name")
    return StructuredOutput("json_schema", fmt.schema_ or {"type": "object"}, "text.format")


def format_of(body: ResponsesRequest) -> dict:
    """The response object's ``text.format`` (what constrained the output)."""
    fmt = body.text.format if body.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(exclude_none=True, by_alias=True)


def message_item(text: str, mid: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": mid or item_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict, status: str = "completed") -> dict:
    """A ``function_call`` output item of a parsed call (``{"id", "function": {"name", "arguments"}}``)."""
    return {"type": "function_call", "id": item_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def output_items(text: str, tools: ToolUse | None) -> list[dict]:
    """A whole reply's output items: its text as a message (when any, or when it made no call), then its calls."""
    if tools is None or not tools.parses:
        return [message_item(text)]
    content, calls = ChoiceCalls().feed(text, True, streamed=False)
    items = [message_item(content)] if content.strip() or not calls else []
    return items + [call_item(c) for c in calls]
