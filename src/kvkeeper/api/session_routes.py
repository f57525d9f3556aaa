"""Session and KV admin endpoints: list, close and offload sessions; dump a session's KV; the breaker's state.

Every handler runs its work on the engine thread (``AsyncEngine.call``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..diagnostics.kvdump import dump_session, to_bytes
from .errors import APIError

router = APIRouter()


def _sessions(request: Request):
    sessions = request.app.state.engine.sessions
    if sessions is None:
        raise APIError(404, "this server keeps no sessions", type="not_found_error", code="session_not_found")
    return sessions


@router.get("/v1/sessions")
async def list_sessions(request: Request):
    sessions = _sessions(request)

    def ls(_):
        return [{**s.info(), "object": "session"} for s in sessions]

    return {"object": "list", "data": await request.app.state.engine.call(ls)}


@router.delete("/v1/sessions/{sid}")
async def delete_session(sid: str, request: Request):
    sessions = _sessions(request)
    blocks = await request.app.state.engine.call(lambda _: sessions.close(sid))
    return {"id": sid, "object": "session", "deleted": True, "freed_blocks": blocks}


@router.post("/v1/sessions/{sid}/offload")
async def offload_session(sid: str, request: Request, tier: str = "host"):
    sessions = _sessions(request)

    def off(_):
        freed = sessions.offload(sid, tier)
        return freed, sessions.get(sid).tier

    freed, now = await request.app.state.engine.call(off)
    return {"id": sid, "object": "session", "tier": now, "freed_blocks": freed}


@router.get("/admin/kv/dump")
async def kv_dump(request: Request, session: str, layers: str | None = None, start: int | None = None,
                  end: int | None = None):
    """A session's K/V as a safetensors file (kvkeeper.diagnostics.kvdump), built on the engine thread."""
    sessions = _sessions(request)
    data = await request.app.state.engine.call(lambda _: to_bytes(*dump_session(sessions, session, layers, start, end)))
    return Response(content=data, media_type="application/octet-stream",
                    headers={"Content-Disposition": 'attachment; filename="kv-dump.safetensors"'})


@router.get("/admin/breaker")
async def breaker_state(request: Request):
    br = request.app.state.engine.breaker
    if br is None:
        return {"tier": 0, "enabled": False}
    return await request.app.state.engine.call(lambda _: br.snapshot())
