"""The typed server-sent events of a streamed ``/v1/responses`` request (OpenAI's Responses streaming events).

Order: ``response.created``, ``response.in_progress``; per output item ``response.output_item.added``, then for
a message ``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, for a function call ``response.function_call_arguments.delta`` and ``.done``;
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when the reply was cut by
``max_output_tokens``, ``response.failed`` when it failed).  Every event has ``type`` and a ``sequence_number``
(0, 1, ...).  With ``stream_options.include_obfuscation`` true, every ``*.delta`` event also has ``obfuscation``:
random URL-safe characters that pad the delta to the next multiple of :data:`OBFUSCATION_BLOCK` characters (at
least one), so that an event's size does not give away its delta's length (OpenAI's mitigation).
With tools, text that may open a call is held back until it is known to be text or a whole call.
"""

from __future__ import annotations

import json
import secrets

from ..common.tools import ChoiceCalls, ToolUse
from .items import call_item, message_item


OBFUSCATION_BLOCK = 32  # characters: a delta plus its padding is a multiple of this


def obfuscation(delta: str) -> str:
    """Random URL-safe padding for ``delta``: 1 to :data:`OBFUSCATION_BLOCK` characters, ``len(delta) + len(pad)``
    a multiple of the block."""
    n = OBFUSCATION_BLOCK - len(delta) % OBFUSCATION_BLOCK
    return secrets.token_urlsafe(n)[:n]


class ResponseEvents:
    """Turns a reply's text deltas into events; ``items`` are the output items so far, ``raw`` the whole text.
    obfuscate: pad every delta event (``stream_options.include_obfuscation``)."""

    def __init__(self, tools: ToolUse | None, obfuscate: bool = False):
        self.obfuscate = obfuscate
        self.seq = 0
        self.items: list[dict] = []
        self.raw = ""
        self.calls = ChoiceCalls() if tools is not None and tools.parses else None
        self.tools = tools
        self._open: int | None = None  # output index of the message being streamed

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        if self.obfuscate and kind.endswith(".delta"):
            data["obfuscation"] = obfuscation(fields.get("delta", ""))
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def feed(self, text: str, final: bool) -> list[str]:
        """The events of ``text`` (the next delta); ``final``: the reply ended (every open item is closed)."""
        self.raw += text
        content, calls = (text, []) if self.calls is None else self.calls.feed(text, final, streamed=False)
        out = self._text(content) if content else []
        for c in calls:
            out += self._close() + self._call(c)
        if final:
            if not self.items:
                out += self._text("")
            out += self._close()
        return out

    def _text(self, delta: str) -> list[str]:
        out = []
        if self._open is None:
            item = message_item("", status="in_progress")
            self._open, self.items = len(self.items), self.items + [item]
            out += [self.event("response.output_item.added", output_index=self._open, item={**item, "content": []}),
                    self.event("response.content_part.added", item_id=item["id"], output_index=self._open,
                               content_index=0, part=item["content"][0])]
        item = self.items[self._open]
        item["content"][0]["text"] += delta
        if delta:
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._open,
                                  content_index=0, delta=delta, logprobs=[]))
        return out

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        i, self._open = self._open, None
        item = self.items[i]
        item["status"] = "completed"
        part = item["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=i, item=item)]

    def _call(self, call: dict) -> list[str]:
        item = call_item(call, tools=self.tools)
        i = len(self.items)
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=i,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                           delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=i, item=item)]
