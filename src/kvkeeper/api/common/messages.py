"""Chat messages of a request body to the engine's message dicts (``/v1/chat/completions`` and ``/tokenize``).

Raises :class:`~kvkeeper.api.common.errors.APIError` (400) naming the message field at fault.
"""

from __future__ import annotations

import json

from .errors import APIError
from .schemas import ChatMessage


def _content(i: int, m: ChatMessage) -> str:
    c = m.content
    if c is None:
        if m.role != "assistant":
            raise APIError(400, f"messages[{i}].content is missing", param=f"messages.{i}.content")
        return ""
    if isinstance(c, str):
        return c
    parts = []
    for j, p in enumerate(c):
        if p.type != "text" or p.text is None:
            raise APIError(400, f"messages[{i}].content[{j}] has type {p.type!r}; only text parts "
                                "({'type': 'text', 'text': ...}) are supported", param=f"messages.{i}.content.{j}")
        parts.append(p.text)
    return "\n".join(parts)


def _refuse_message_fields(i: int, m: ChatMessage) -> None:
    for name, why in (("refusal", "a refusal cannot be part of the history; send it as content"),
                      ("audio", "audio is not supported"),
                      ("function_call", "the deprecated functions API is not supported; use tool_calls")):
        if getattr(m, name) is not None:
            raise APIError(400, f"messages[{i}].{name} is not supported: {why}", param=f"messages.{i}.{name}")
    if m.annotations:
        raise APIError(400, f"messages[{i}].annotations are not supported (this server cites nothing); drop them",
                       param=f"messages.{i}.annotations")
    if m.tool_calls and m.role != "assistant":
        raise APIError(400, f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                       param=f"messages.{i}.tool_calls")


def _tool_calls(i: int, m: ChatMessage, seen_ids: set[str]) -> list[dict]:
    out = []
    for j, c in enumerate(m.tool_calls or []):
        try:
            args = json.loads(c.function.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be the JSON text of an "
                                "object, as a response's tool call gave it", param=f"messages.{i}.tool_calls.{j}")
        if c.id is not None:
            seen_ids.add(c.id)
        out.append({"id": c.id, "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments}})
    return out


def messages_of(messages: list[ChatMessage]) -> list[dict]:
    """``{"role", "content"}`` dicts (text parts joined by newlines, ``developer`` read as ``system``), with an
    assistant's ``tool_calls``, a tool message's ``tool_call_id`` (which must answer an earlier call) and a
    ``name`` when given (the engine refuses it when the chat template has no names)."""
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        _refuse_message_fields(i, m)
        d = {"role": "system" if m.role == "developer" else m.role, "content": _content(i, m)}
        if m.tool_calls:
            d["tool_calls"] = _tool_calls(i, m, call_ids)
        if m.role == "tool":
            if m.tool_call_id is None or m.tool_call_id not in call_ids:
                raise APIError(400, f"messages[{i}].tool_call_id must be the id of a tool call of an earlier "
                                    f"assistant message, got {m.tool_call_id!r}", param=f"messages.{i}.tool_call_id")
            d["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id is not None:
            raise APIError(400, f"messages[{i}].tool_call_id belongs to tool messages only",
                           param=f"messages.{i}.tool_call_id")
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out

