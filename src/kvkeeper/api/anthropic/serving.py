"""An Anthropic Messages body on the chat path, and the output rendered as Anthropic's message or stream events.

**One conversion.**  The body becomes a :class:`~kvkeeper.api.chat.protocol.ChatCompletionRequest` (:func:`chat_body`):
``system`` (a string or text blocks, with any ``system`` messages before the first turn) the first system message;
``text`` blocks the message's text; an assistant's ``tool_use`` blocks its ``tool_calls``; a user's ``tool_result``
blocks ``tool`` messages; ``tools`` / ``tool_choice`` (``auto``, ``any`` = required, ``tool`` = named, ``none``;
``disable_parallel_tool_use``) the chat tools; ``stop_sequences`` ``stop``; ``metadata.user_id`` the access log's
user; ``output_config.format`` a JSON-schema ``response_format``.  That body then goes through
:func:`kvkeeper.api.chat.serving.chat_request`, the chat route's own rules (sampling, tools, messages, the cache namespace,
the session headers).

**Cache accounting** (:func:`usage_of`).  A block marked ``cache_control`` is a breakpoint; the prompt up to the end
of the message that holds the last breakpoint (the system prompt for ``system`` blocks and tools; the whole
conversation for the request-level ``cache_control``) is written to the cache.  ``cache_read_input_tokens`` are
the prompt tokens whose KV the request found (prefix cache or session), ``cache_creation_input_tokens`` the tokens
up to the last breakpoint that it computed, ``input_tokens`` the rest.

**Retention.**  The prompt's full blocks up to the last breakpoint's end are held in the cache for the longest
``ttl`` among the breakpoints (:func:`breakpoint_ttl`; ``engine.kv.hold_prefix``, rules in
:mod:`kvkeeper.kvcache.retention`): LRU eviction skips them until then, within the server's ``--kv-hold-share``.
"""

from __future__ import annotations

import json
import uuid

from pydantic import ValidationError

from ..common.errors import APIError
from ..common.protocol import refuse_unknown
from ..common.context import RequestContext
from ..chat.protocol import ChatCompletionRequest
from ..common.tools import ChoiceCalls, ToolUse
from .protocol import NOT_APPLIED, REFUSED, TTL_SECONDS, ContentBlock, Message, MessagesRequest

# The fields each block type may carry besides ``type`` and ``cache_control``.
_BLOCK_FIELDS = {"text": {"text", "citations"}, "tool_use": {"id", "name", "input"},
                 "tool_result": {"tool_use_id", "content", "is_error"}, "thinking": {"thinking", "signature"},
                 "redacted_thinking": {"data"}}


def check_fields(body: MessagesRequest, ctx: RequestContext, count_only: bool = False) -> list[str]:
    """The fields accepted and not applied (:data:`~.protocol.NOT_APPLIED`) after the field rules: 400 naming a
    field no schema declares (unless the server ignores them), a :data:`~.protocol.REFUSED` one, thinking
    ``enabled`` and (``count_only`` False) a missing ``max_tokens``."""
    refuse_unknown(body, ctx)
    for name, (noop, why) in REFUSED.items():
        if getattr(body, name) not in noop:
            raise APIError(400, f"{name} is not supported: {why}", param=name)
    if body.thinking is not None and body.thinking.type == "enabled":
        raise APIError(400, "thinking: this model has no reasoning mode; send {\"type\": \"disabled\"} or "
                            "{\"type\": \"adaptive\"} (a plain reply), or leave thinking out", param="thinking")
    if body.max_tokens is None and not count_only:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    given = {"context_management": body.context_management is not None, "diagnostics": body.diagnostics is not None,
             "output_config.effort": body.output_config is not None and body.output_config.effort is not None,
             "thinking": body.thinking is not None}
    return [k for k in NOT_APPLIED if given[k]]


def _block_text(i: int, j: int, b: ContentBlock) -> str:
    if b.text is None:
        raise APIError(400, f"messages.{i}.content.{j}: a text block needs its text", param=f"messages.{i}.content.{j}")
    return b.text


def _check_block(i: int, j: int, b: ContentBlock) -> None:
    where = f"messages.{i}.content.{j}"
    if b.type not in _BLOCK_FIELDS:
        raise APIError(400, f"{where}: blocks of type {b.type!r} are not supported (this server reads text, tool_use "
                            "and tool_result blocks; images and documents cannot be read by a text model)", param=where)
    extra = sorted(b.model_fields_set - _BLOCK_FIELDS[b.type] - {"type", "cache_control"})
    if extra:
        raise APIError(400, f"{where}.{extra[0]}: not a field of a {b.type} block", param=f"{where}.{extra[0]}")


def _result_text(i: int, j: int, b: ContentBlock) -> str:
    if b.tool_use_id is None:
        raise APIError(400, f"messages.{i}.content.{j}.tool_use_id: a tool_result names the tool_use it answers",
                       param=f"messages.{i}.content.{j}.tool_use_id")
    c = b.content
    return c if isinstance(c, str) else "\n".join(t.text for t in c or [])


def _user(i: int, m: Message) -> list[dict]:
    """A user turn's chat messages: its tool results as tool messages, its text as one user message."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out, texts = [], []
    for j, b in enumerate(m.content):
        _check_block(i, j, b)
        if b.type == "tool_result":
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(i, j, b)})
        elif b.type == "text":
            texts.append(_block_text(i, j, b))
        else:
            raise APIError(400, f"messages.{i}.content.{j}: a {b.type} block belongs to an assistant message",
                           param=f"messages.{i}.content.{j}")
    return out + ([{"role": "user", "content": "\n".join(texts)}] if texts or not out else [])


def _assistant(i: int, m: Message) -> dict:
    """An assistant turn: its text, its tool_use blocks as tool calls (thinking blocks dropped)."""
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    texts, calls = [], []
    for j, b in enumerate(m.content):
        _check_block(i, j, b)
        if b.type == "text":
            texts.append(_block_text(i, j, b))
        elif b.type == "tool_use":
            if b.id is None or b.name is None or b.input is None:
                raise APIError(400, f"messages.{i}.content.{j}: a tool_use block needs id, name and input",
                               param=f"messages.{i}.content.{j}")
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif b.type == "tool_result":
            raise APIError(400, f"messages.{i}.content.{j}: a tool_result block belongs to a user message",
                           param=f"messages.{i}.content.{j}")
    return {"role": "assistant", "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})}


def _marked(m: Message) -> bool:
    return not isinstance(m.content, str) and any(b.cache_control is not None for b in m.content)


def _system(body: MessagesRequest) -> tuple[list[str], bool, int]:
    """(system texts, whether one is a breakpoint, how many leading ``system`` messages they took)."""
    s = body.system
    texts = [s] if isinstance(s, str) else [b.text for b in s or []]
    marked = not isinstance(s, str) and any(b.cache_control is not None for b in s or [])
    marked |= any(t.cache_control is not None for t in body.tools or [])
    lead = 0
    while lead < len(body.messages) and body.messages[lead].role == "system":
        m = body.messages[lead]
        texts.append(m.content if isinstance(m.content, str) else "\n".join(
            _block_text(lead, j, b) for j, b in enumerate(m.content) if _check_block(lead, j, b) is None))
        marked |= _marked(m)
        lead += 1
    return texts, marked, lead


def chat_messages(body: MessagesRequest) -> tuple[list[dict], int]:
    """(chat messages, the index of the message the last cache breakpoint ends; -1: none).  400 naming the block
    for an unsupported block type, a field of another block type, or a block in the wrong role's message."""
    texts, marked, lead = _system(body)
    out = [{"role": "system", "content": "\n\n".join(texts)}] if texts else []
    last = 0 if marked and out else -1
    for i, m in enumerate(body.messages[lead:], lead):
        if m.role == "user":
            out += _user(i, m)
        elif m.role == "assistant":
            out.append(_assistant(i, m))
        else:
            out.append({"role": "system", "content": m.content if isinstance(m.content, str) else "\n".join(
                _block_text(i, j, b) for j, b in enumerate(m.content) if _check_block(i, j, b) is None)})
        last = len(out) - 1 if _marked(m) else last
    if body.cache_control is not None:  # automatic caching: the breakpoint moves with the conversation's end
        last = len(out) - 1
    return out, last


def deferred_tools(body: MessagesRequest) -> list[str]:
    """The names of the tools marked ``defer_loading`` (not offered to the model: this server runs no tool search,
    the only way Anthropic's API brings a deferred tool into the context)."""
    return [t.name for t in body.tools or [] if t.defer_loading]


def _tools(body: MessagesRequest) -> dict:
    offered = [t for t in body.tools or [] if not t.defer_loading]
    if not offered:
        tc = body.tool_choice
        return {"tool_choice": "none"} if tc is not None and tc.type == "none" else {}
    out: dict = {"tools": [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description is not None else {}),
        "parameters": t.input_schema}} for t in offered]}
    tc = body.tool_choice
    if tc is not None:
        if tc.type == "tool" and tc.name is None:
            raise APIError(400, "tool_choice.name: type \"tool\" names the tool to call", param="tool_choice.name")
        out["tool_choice"] = ({"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or
                              {"type": "function", "function": {"name": tc.name}})
        if tc.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def chat_body(body: MessagesRequest, max_tokens: int | None) -> tuple[ChatCompletionRequest, int]:
    """(the chat body of ``body``, the index of its last breakpoint's message or -1), ``max_tokens`` as given."""
    msgs, last = chat_messages(body)
    d = {"messages": msgs, "stream": body.stream, **_tools(body)}
    for k, v in (("model", body.model), ("max_tokens", max_tokens), ("temperature", body.temperature),
                 ("top_p", body.top_p), ("top_k", body.top_k), ("stop", body.stop_sequences),
                 ("user", body.metadata.user_id if body.metadata is not None else None)):
        if v is not None:
            d[k] = v
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        d["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.json_schema}}
    try:
        return ChatCompletionRequest.model_validate(d), last
    except ValidationError as e:  # a value the chat path cannot take (its first error, named as the chat field)
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{where}: {err.get('msg')} (as the chat request this body becomes)", param=where) from None


def usage_of(prompt: int, cached: int, output: int | None, breakpoint_end: int) -> dict:
    """Anthropic's usage of a request: ``prompt`` tokens of which ``cached`` were read from the cache,
    ``breakpoint_end`` tokens up to the last breakpoint (0: none)."""
    write = max(0, min(breakpoint_end, prompt) - cached)
    out = {"input_tokens": prompt - cached - write, "cache_creation_input_tokens": write,
           "cache_read_input_tokens": cached}
    return out if output is None else {**out, "output_tokens": output}


def breakpoint_ttl(body: MessagesRequest) -> float | None:
    """Seconds the prefix up to the last breakpoint is held in the cache (:mod:`kvkeeper.kvcache.retention`): the
    longest ``ttl`` of the body's ``cache_control`` marks (system blocks, tools, message blocks, the request-level
    one; :data:`~.protocol.TTL_SECONDS`, "5m" when a mark names none); None without a breakpoint."""
    marks = [b.cache_control for b in body.system or [] if not isinstance(body.system, str)]
    marks += [t.cache_control for t in body.tools or []] + [body.cache_control]
    marks += [b.cache_control for m in body.messages if not isinstance(m.content, str) for b in m.content]
    ttls = [TTL_SECONDS[c.ttl or "5m"] for c in marks if c is not None]
    return max(ttls, default=None)


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class Rendered:
    """One reply as Anthropic's content blocks, built as its text arrives: ``feed`` returns the stream events
    (``(name, data)``) that the new text makes (a text block opened on the first text, closed before a tool_use
    block or at the end; a tool_use block whole, its input as one ``input_json_delta``, as each call's closing tag
    arrives); ``blocks`` is the message's ``content`` so far."""

    def __init__(self, tools: ToolUse | None):
        self.calls = ChoiceCalls() if tools is not None and tools.parses else None
        self.blocks: list[dict] = []
        self.text_open = False
        self.usage = None  # the engine's Usage once the request finished (its cache_miss: the response header)

    def _close_text(self) -> list[tuple[str, dict]]:
        if not self.text_open:
            return []
        self.text_open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _text(self, text: str) -> list[tuple[str, dict]]:
        ev = []
        if not self.text_open:
            self.blocks.append({"type": "text", "text": ""})
            self.text_open = True
            ev.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                               "content_block": {"type": "text", "text": ""}}))
        self.blocks[-1]["text"] += text
        return ev + [("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                              "delta": {"type": "text_delta", "text": text}})]

    def _tool_use(self, call: dict) -> list[tuple[str, dict]]:
        ev, i, fn = self._close_text(), len(self.blocks), call["function"]
        self.blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])})
        start = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
        return ev + [("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}),
                     ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                         "type": "input_json_delta", "partial_json": fn["arguments"]}}),
                     ("content_block_stop", {"type": "content_block_stop", "index": i})]

    def feed(self, text: str, final: bool) -> list[tuple[str, dict]]:
        content, calls = self.calls.feed(text, final) if self.calls is not None else (text, [])
        ev = self._text(content) if content else []
        for c in calls:
            ev += self._tool_use(c)
        return ev + (self._close_text() if final else [])

    def stop_reason(self, reason: str | None, stop_string: str | None) -> str:
        """Anthropic's ``stop_reason`` of the engine's finish reason."""
        if reason == "length":
            return "max_tokens"
        if self.calls is not None and self.calls.count:
            return "tool_use"
        return "stop_sequence" if stop_string is not None else "end_turn"
