"""``/v1/conversations`` (OpenAI's Conversations API): items the server holds, continued by ``/v1/responses``
with ``conversation``.

::

    POST   /v1/conversations                          {"items": [...], "metadata": {...}}: a new conversation
    GET    /v1/conversations/{id}                     the conversation object
    POST   /v1/conversations/{id}                     {"metadata": {...}}: new metadata
    DELETE /v1/conversations/{id}                     forget it and close its session (its KV freed)
    GET    /v1/conversations/{id}/items               its items (?order=asc|desc, default desc; limit 1-100; after)
    POST   /v1/conversations/{id}/items               {"items": [...]}: append items
    GET    /v1/conversations/{id}/items/{item_id}     one item
    DELETE /v1/conversations/{id}/items/{item_id}     remove one item (the next turn reuses the KV up to it)

How a conversation keeps its KV: :mod:`kvkeeper.api.responses.conversation_store`.  Every route sees only the caller's
tenant's conversations: another tenant's id is a 404 exactly as an unknown one.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ..common.auth import Caller, caller
from ..common.context import request_context
from ..common.errors import APIError
from ..common.protocol import refuse_unknown
from .conversation_store import Conversation
from .deps import Paging, close_sessions, conversation_store
from .items import input_messages, item_id, item_page, public
from .schema import ConversationCreate, ConversationUpdate, ItemsCreate, ResponsesRequest

router = APIRouter()  # included behind the caller dependency (kvkeeper.api.common.auth)


def _add(c: Conversation, items: list, request: Request, who: Caller, body) -> list[dict]:
    """Append ``items`` (parsed input items) to ``c``; their rules as a response's input (400 naming the item)."""
    refuse_unknown(body, request_context(request, who))
    if not items:
        return []
    _, stored, calls = input_messages(ResponsesRequest.model_construct(input=items), c.call_ids, "items")
    c.items += stored
    c.call_ids |= calls
    return stored


def _item(c: Conversation, iid: str) -> int:
    for i, it in enumerate(c.items):
        if it["id"] == iid:
            return i
    raise APIError(404, f"conversation {c.id!r} has no item {iid!r}", type="not_found_error", code="item_not_found")


@router.post("/v1/conversations")
async def create_conversation(body: ConversationCreate, request: Request, who: Caller = Depends(caller)):
    c = Conversation(item_id("conv"), who.tenant, metadata=body.metadata or {})
    _add(c, body.items or [], request, who, body)
    conversation_store(request).save(c)
    return c.obj()


@router.get("/v1/conversations/{cid}")
async def get_conversation(cid: str, request: Request, who: Caller = Depends(caller)):
    return conversation_store(request).get(who.tenant, cid).obj()


@router.post("/v1/conversations/{cid}")
async def update_conversation(cid: str, body: ConversationUpdate, request: Request, who: Caller = Depends(caller)):
    refuse_unknown(body, request_context(request, who))
    store = conversation_store(request)
    c = store.get(who.tenant, cid)
    c.metadata = body.metadata
    store.save(c)
    return c.obj()


@router.delete("/v1/conversations/{cid}")
async def delete_conversation(cid: str, request: Request, who: Caller = Depends(caller)):
    conversation_store(request).delete(who.tenant, cid)
    await close_sessions(request, who.tenant, [cid])
    return {"id": cid, "object": "conversation.deleted", "deleted": True}


@router.get("/v1/conversations/{cid}/items")
async def list_items(cid: str, request: Request, paging: Paging = Depends(), who: Caller = Depends(caller)):
    return paging.page(conversation_store(request).get(who.tenant, cid).items)


@router.post("/v1/conversations/{cid}/items")
async def add_items(cid: str, body: ItemsCreate, request: Request, who: Caller = Depends(caller)):
    store = conversation_store(request)
    c = store.get(who.tenant, cid)
    added = _add(c, body.items, request, who, body)
    store.save(c)
    return item_page(added, "asc", len(added), None)


@router.get("/v1/conversations/{cid}/items/{iid}")
async def get_item(cid: str, iid: str, request: Request, who: Caller = Depends(caller)):
    c = conversation_store(request).get(who.tenant, cid)
    return public(c.items[_item(c, iid)])


@router.delete("/v1/conversations/{cid}/items/{iid}")
async def delete_item(cid: str, iid: str, request: Request, who: Caller = Depends(caller)):
    store = conversation_store(request)
    c = store.get(who.tenant, cid)
    del c.items[_item(c, iid)]
    store.save(c)
    return c.obj()
