"""One ``/v1/responses`` request from its body to its stored response: the engine's request (a session turn
when the response is stored or continues one), the response object, and what is kept afterwards.

**Responses are session turns.**  A response that is stored (``store``, the default) or that continues an
earlier one (``previous_response_id``) runs as a turn of a session named by its own id
(:mod:`kvkeeper.sessions`).  Continuing from response P first forks P's session copy-on-write
(:meth:`~kvkeeper.sessions.manager.SessionManager.fork`): the new turn's prompt is P's token ids followed by
the new input's, and P's KV is handed over whole (``cached_tokens``: P's prompt and reply but its last token,
whose KV was never computed).  Branching is the same fork from an older response: the branches share their
common blocks and never see each other's tokens.  A response that is not stored has its session closed once
it is done, unless a session header (:data:`~kvkeeper.api.common.context.SESSION_HEADERS`: Codex CLI's
``session-id``) or ``client_metadata.session_id`` names a session: then an unstored response is a turn of that
session, which keeps its KV for the next request (an agent resending its whole input each turn, ``store: false``).  ``instructions`` are the first (system) message of this request only, as OpenAI's: they are not
carried over to the next response, so a client that sends the same instructions each time keeps the prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..common.context import SESSION_ID_RE, RequestContext
from ..common.errors import APIError
from ..common.protocol import (cache_namespace, check_body, output_constraint, sampling_params,
                               retention_of, session_compression)
from ..common.streams import GenerationRequest, Usage
from ..common.tools import ToolUse
from .conversation_store import Conversation, ConversationStore
from .items import format_of, input_messages, item_id, messages_of_items, text_format, tool_use_of_body
from .schema import RESPONSES_REFUSED, ResponsesRequest
from .store import ResponseStore, StoredResponse


@dataclass
class ResponseRun:
    """A request in flight: its id, body, the response it continues (``prev``) or the conversation it adds to,
    the messages before its input (``before``) and the call ids in them (``known_calls``), its new messages and
    input items, the engine's request (``gen``), its tools, and whether a session of its own id backs it
    (``session``; a conversation's turn runs on the conversation's session instead)."""

    id: str
    body: ResponsesRequest
    model: str
    tenant: str | None
    prev: StoredResponse | None
    conversation: Conversation | None
    before: list[dict]
    known_calls: set[str]
    new_messages: list[dict]
    items: list[dict]
    calls: set[str]
    gen: GenerationRequest
    tools: ToolUse | None
    session: bool
    created_at: int

    def obj(self, status: str, output: list[dict], usage: Usage | None, error: dict | None = None) -> dict:
        """The response object (OpenAI's ``Response``)."""
        b = self.body
        tools = [t.model_dump(exclude_none=True) for t in b.tools or []]
        tc = b.tool_choice.model_dump() if b.tool_choice is not None and not isinstance(b.tool_choice, str) else (
            b.tool_choice or ("auto" if tools else "none"))
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "instructions": b.instructions, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "previous_response_id": b.previous_response_id, "store": b.store,
                "max_output_tokens": b.max_output_tokens, "temperature": 1.0 if b.temperature is None else b.temperature,
                "top_p": 1.0 if b.top_p is None else b.top_p, "text": {"format": format_of(b)}, "tools": tools,
                "tool_choice": tc, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "truncation": "disabled", "metadata": b.metadata or {}, "usage": _usage(usage),
                "prompt_cache_key": b.prompt_cache_key, "prompt_cache_retention": b.prompt_cache_retention,
                "user": b.user, "safety_identifier": b.safety_identifier,
                "conversation": {"id": self.conversation.id} if self.conversation is not None else None}

    def stored(self, obj: dict, raw: str) -> StoredResponse:
        """What is kept of a finished response: the conversation through it ends with the reply as generated
        (its tool calls as text: the KV's own tokens, so the next turn extends it exactly)."""
        history = self.before + self.new_messages + [{"role": "assistant", "content": raw}]
        return StoredResponse(self.id, self.tenant, obj, self.items, history, self.known_calls | self.output_calls(obj))

    def output_calls(self, obj: dict) -> set[str]:
        """The call ids of this input and of the reply's function calls."""
        return self.calls | {it["call_id"] for it in obj["output"] if it["type"] == "function_call"}


def _usage(u: Usage | None) -> dict | None:
    if u is None:
        return None
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.cache_write_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def check_response_body(body: ResponsesRequest, ctx: RequestContext) -> str | None:
    """The LoRA adapter ``body.model`` names (None: the base model; 404 for a model not served), after the
    refused (:data:`~kvkeeper.api.responses.schema.RESPONSES_REFUSED`) and unknown fields (400 naming them):
    :func:`~kvkeeper.api.common.protocol.check_body`'s rules."""
    lora = check_body(body, ctx, RESPONSES_REFUSED)
    if ctx.session_id is not None and (body.store or body.previous_response_id or body.conversation):
        raise APIError(400, "X-Session-ID does not apply to a stored response (its own session turn, continued with "
                            "previous_response_id) nor to one that continues a response or a conversation; with "
                            "store: false it names the session the request is a turn of", param="X-Session-ID")
    return lora


def _before(body: ResponsesRequest, tenant: str | None, store: ResponseStore, conversations: ConversationStore):
    """(the previous response, the conversation, the messages before the input, their call ids); 404 for an
    unknown ``previous_response_id`` or ``conversation``, 400 for both at once."""
    if body.previous_response_id is not None and body.conversation is not None:
        raise APIError(400, "previous_response_id and conversation both name what the input continues: give one",
                       param="conversation")
    if body.previous_response_id is not None:
        prev = store.get(tenant, body.previous_response_id, "previous_response_id")
        return prev, None, prev.history, prev.call_ids
    if body.conversation is not None:
        cid = body.conversation if isinstance(body.conversation, str) else body.conversation.id
        conv = conversations.get(tenant, cid, "conversation")
        return None, conv, messages_of_items(conv.items), set(conv.call_ids)
    return None, None, [], set()


def plan_response(body: ResponsesRequest, ctx: RequestContext, store: ResponseStore, conversations: ConversationStore,
                  rid: str) -> ResponseRun:
    """The run of ``body``: every rule checked (APIError naming the field; 404 for an unknown
    ``previous_response_id`` or ``conversation``), the prompt's messages (instructions, the conversation so far,
    the new input)."""
    lora = check_response_body(body, ctx)
    prev, conv, before, known = _before(body, ctx.tenant, store, conversations)
    msgs, items, calls = input_messages(body, known)
    tools = tool_use_of_body(body)
    params = sampling_params(body, body.max_output_tokens, structured=output_constraint(text_format(body), tools))
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    session = conv is None and (body.store or prev is not None)
    agent = None if session or conv is not None else ctx.session_id or _metadata_session(body)
    ns = cache_namespace(body, ctx)
    policy, budget = ctx.context_policy, ctx.context_budget
    if not session and conv is None and agent is None and (policy is not None or budget is not None):
        raise APIError(400, "X-Context-Policy / X-Context-Budget apply to a conversation's turns: store the response "
                            "(store: true), continue one or add to a conversation", param="X-Context-Policy")
    if not session and conv is None and agent is None and (ctx.session_compression is not None
                                         or ctx.session_compression_ratio is not None):
        raise APIError(400, "X-Session-Compression / X-Session-Compression-Ratio apply to a conversation's turns: store "
                            "the response (store: true), continue one or add to a conversation",
                       param="X-Session-Compression")
    gen = GenerationRequest(rid, params, messages=system + before + msgs,
                            chat={"tools": tools.tools} if tools is not None else {}, namespace=ns, lora=lora,
                            session_id=conv.id if conv else rid if session else agent, tenant=ctx.tenant,
                            quota=ctx.quota, session_priority=ctx.session_priority,
                            context=None if policy is None and budget is None else (policy, budget),
                            session_compression=session_compression(ctx.session_compression,
                                                                    ctx.session_compression_ratio),
                            retention=retention_of(body.prompt_cache_retention))
    return ResponseRun(rid, body, body.model or ctx.served.name, ctx.tenant, prev, conv, before, known, msgs, items,
                       calls, gen, tools, session, int(time.time()))


def _metadata_session(body: ResponsesRequest) -> str | None:
    """Codex CLI's ``client_metadata.session_id`` (None without); 400 unless 1 to 128 characters of
    ``A-Z a-z 0-9 . _ : -`` (a session id's, as the session headers')."""
    sid = (body.client_metadata or {}).get("session_id")
    if sid is not None and not SESSION_ID_RE.match(sid):
        raise APIError(400, "client_metadata.session_id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
                       param="client_metadata.session_id")
    return sid


def new_response_id() -> str:
    return item_id("resp")
