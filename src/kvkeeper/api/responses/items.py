"""Responses API items: input items to the engine's chat messages, tools and ``text.format`` to the engine's
forms, and a reply's text to output items (``message`` with ``output_text``, ``function_call``).

Every function raises :class:`~kvkeeper.api.common.errors.APIError` (400) naming the field at fault.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

from ...sampling.structured import StructuredOutput
from ..common.errors import APIError
from ..common.schemas import FunctionDefinition, FunctionName, NamedToolChoice, Tool
from ..common.tools import ChoiceCalls, ToolUse, tool_use_of
from .schema import (FunctionCallItem, FunctionCallOutputItem, FunctionTool, HostedTool, MessageItem, NamespaceTool,
                     ResponsesRequest, qualified_name)


def item_id(prefix: str) -> str:
    """A new item or response id: ``<prefix>_`` and 32 hex digits (``resp``, ``msg``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _arguments(i: int, c: FunctionCallItem, field: str) -> None:
    try:
        args = json.loads(c.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise APIError(400, f"{field}[{i}].arguments must be the JSON text of an object, as the response's "
                            "function_call item gave it", param=f"{field}.{i}.arguments")


def input_messages(body: ResponsesRequest, known_calls: set[str], field: str = "input"
                   ) -> tuple[list[dict], list[dict], set[str]]:
    """(chat messages, input items as stored, call ids) of ``body.input`` (see :func:`messages_of_items`); a
    ``function_call_output`` must answer a call of ``known_calls`` (the conversation's so far) or of this input.
    ``field``: the body field the items came in (named in errors)."""
    if isinstance(body.input, str):
        items = [{"type": "message", "id": item_id("msg"), "role": "user", "status": "completed",
                  "content": [{"type": "input_text", "text": body.input}]}]
        return messages_of_items(items), items, set()
    calls: set[str] = set()
    for i, it in enumerate(body.input):
        if isinstance(it, FunctionCallItem):
            _arguments(i, it, field)
            calls.add(it.call_id)
        elif isinstance(it, FunctionCallOutputItem) and it.call_id not in calls and it.call_id not in known_calls:
            raise APIError(400, f"{field}[{i}].call_id {it.call_id!r} answers no function call of these items or "
                                "of the conversation", param=f"{field}.{i}.call_id")
    if not body.input:
        raise APIError(400, f"{field} is empty: give at least one item", param=field)
    items = [_stored_item(it) for it in body.input]
    return messages_of_items(items), items, calls


def messages_of_items(items: list[dict]) -> list[dict]:
    """The chat messages of stored items: a message's text parts joined by newlines (``developer`` read as
    ``system``); a ``function_call`` joins the assistant message before it (or starts one); a
    ``function_call_output`` is a ``tool`` message.  The items of one reply of the model (``_reply``: its
    response id) are its reply as generated (``_raw`` on the first of them: the KV's own text), while that first
    item is there."""
    msgs: list[dict] = []
    skip = None
    for it in items:
        if skip is not None and it.get("_reply") == skip:
            continue
        if "_raw" in it:
            msgs.append({"role": "assistant", "content": it["_raw"]})
            skip = it["_reply"]
            continue
        if it["type"] == "message":
            msgs.append({"role": "system" if it["role"] == "developer" else it["role"],
                         "content": "\n".join(p["text"] for p in it["content"])})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": qualified_name(it.get("namespace"), it["name"]), "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return msgs


def reply_items(output: list[dict], raw: str, rid: str) -> list[dict]:
    """A response's output items as a conversation keeps them: marked as one reply (``_reply``), the first
    carrying the reply as generated (``_raw``)."""
    return [{**it, "_reply": rid, **({"_raw": raw} if i == 0 else {})} for i, it in enumerate(output)]


def public(item: dict) -> dict:
    """An item as served: without the keys only the server reads (``_raw``, ``_reply``)."""
    return {k: v for k, v in item.items() if not k.startswith("_")}


def item_page(items: list[dict], order: str, limit: int, after: str | None) -> dict:
    """A list object of ``items`` (``order`` "asc" or "desc"; at most ``limit``, after the item ``after``);
    400 naming ``after`` when it is no item of the list."""
    items = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise APIError(400, f"after: {after!r} is no item of this list", param="after")
        items = items[ids.index(after) + 1:]
    page = [public(it) for it in items[:limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


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


def _offered(body: ResponsesRequest) -> tuple[list[FunctionTool], dict[str, tuple[str, str]]]:
    """The functions offered to the model (a namespace's flattened, named by
    :func:`~kvkeeper.api.responses.schema.qualified_name`) and the qualified name -> (namespace, name) map."""
    out, names = [], {}
    for t in body.tools or []:
        if isinstance(t, FunctionTool):
            out.append(t)
        elif isinstance(t, NamespaceTool):
            for f in t.tools:
                q = qualified_name(t.name, f.name)
                names[q] = (t.name, f.name)
                out.append(f.model_copy(update={"name": q}))
    return out, names


def tools_not_offered(body: ResponsesRequest) -> list[str]:
    """The hosted tools of the request (not offered to the model): ``type`` or ``type:name``."""
    return [t.type if t.name is None else f"{t.type}:{t.name}" for t in body.tools or [] if isinstance(t, HostedTool)]


def tool_use_of_body(body: ResponsesRequest) -> ToolUse | None:
    """The request's :class:`~kvkeeper.api.common.tools.ToolUse` (tools in the chat form the engine renders:
    functions, namespaces' functions), or None (no tools, or hosted tools only: those are not offered); the rules of
    :func:`~kvkeeper.api.common.tools.tool_use_of` (400 naming the field)."""
    tc = body.tool_choice
    offered, names = _offered(body)
    if not offered and body.tools:
        return None
    chat = SimpleNamespace(
        tools=[Tool(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"})))
               for t in offered],
        tool_choice=NamedToolChoice(type="function", function=FunctionName(name=tc.name)) if tc is not None
        and not isinstance(tc, str) else tc, parallel_tool_calls=body.parallel_tool_calls)
    try:
        use = tool_use_of(chat)
    except APIError as e:  # the chat form's names of the fields: tools.N.function.parameters
        e.param = e.param.replace(".function.", ".") if e.param else e.param
        raise
    if use is not None:
        use.namespaces = names
    return use


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


def call_item(call: dict, status: str = "completed", tools: ToolUse | None = None) -> dict:
    """A ``function_call`` output item of a parsed call (``{"id", "function": {"name", "arguments"}}``); a call of a
    namespace's function (``tools.namespaces``) has that function's own ``name`` and its ``namespace``."""
    name = call["function"]["name"]
    ns, name = tools.namespaces.get(name, (None, name)) if tools is not None else (None, name)
    return {"type": "function_call", "id": item_id("fc"), "call_id": call["id"], "name": name,
            **({"namespace": ns} if ns is not None else {}), "arguments": call["function"]["arguments"],
            "status": status}


def output_items(text: str, tools: ToolUse | None) -> list[dict]:
    """A whole reply's output items: its text as a message (when any, or when it made no call), then its calls."""
    if tools is None or not tools.parses:
        return [message_item(text)]
    content, calls = ChoiceCalls().feed(text, True, streamed=False)
    items = [message_item(content)] if content.strip() or not calls else []
    return items + [call_item(c, tools=tools) for c in calls]
