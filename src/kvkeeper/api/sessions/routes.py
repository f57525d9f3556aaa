"""Session endpoints: list, close, offload and fork the caller's sessions.

Every handler resolves the caller's tenant (:func:`kvkeeper.api.common.auth.caller`) and sees only that
tenant's sessions: another tenant's id answers 404 exactly as an unknown one and touches nothing.
The work runs on the engine thread (``AsyncEngine.call``).
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Depends, Request

from ..common.auth import Caller, caller
from ..common.context import managed_sessions, owned_session
from ..common.errors import APIError

router = APIRouter()


@router.get("/v1/sessions")
async def list_sessions(request: Request, who: Caller = Depends(caller)):
    sessions = managed_sessions(request)

    def ls(_):
        return [{**s.info(), "object": "session"} for s in sessions.of_tenant(who.tenant)]

    return {"object": "list", "data": await request.app.state.engine.call(ls)}


@router.delete("/v1/sessions/{sid}")
async def delete_session(sid: str, request: Request, who: Caller = Depends(caller)):
    sessions = managed_sessions(request)
    blocks = await request.app.state.engine.call(lambda _: sessions.close(owned_session(sessions, who.tenant, sid).id))
    return {"id": sid, "object": "session", "deleted": True, "freed_blocks": blocks}


@router.post("/v1/sessions/{sid}/offload")
async def offload_session(sid: str, request: Request, tier: str = "host", who: Caller = Depends(caller)):
    sessions = managed_sessions(request)

    def off(_):
        s = owned_session(sessions, who.tenant, sid)
        return s.offload(tier), s.tier

    freed, now = await request.app.state.engine.call(off)
    return {"id": sid, "object": "session", "tier": now, "freed_blocks": freed}


@router.post("/v1/sessions/{sid}/fork")
async def fork_session(sid: str, request: Request, id: str | None = None, who: Caller = Depends(caller)):
    """A new session continuing ``sid`` copy-on-write (``?id=NEW``, default ``sess-<hex>``): the full blocks
    shared (one more reference each), the partial last block copied (kvkeeper.sessions.fork)."""
    sessions = managed_sessions(request)
    if id is not None and not re.fullmatch(r"[A-Za-z0-9._:\-]{1,128}", id):
        raise APIError(400, "id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", param="id")

    def fork(_):
        src = owned_session(sessions, who.tenant, sid)
        if id is not None and sessions.find(who.tenant, id) is not None:
            raise APIError(409, f"session {id!r} is already open: fork under another id", param="id")
        sessions.check_quota(who.tenant, who.quota, opening=True)
        s = sessions.fork(src, id, who.tenant)
        shared = len(set(s.kv.block_table) & set(src.kv.block_table)) if s.kv is not None and src.kv else 0
        return {**s.info(), "object": "session", "forked_from": sid, "shared_blocks": shared}

    return await request.app.state.engine.call(fork)
