"""Moving a session between servers: export it as one checksummed file, import it on a server of the same model.

::

    GET  /v1/sessions/{id}/export                 the caller's session as a file (kvkeeper.sessions.portable)
    POST /admin/sessions/import?id=NEW&tenant=T   body: such a file; opens it as tenant T's session (admin key)

An import is an operator's action (an admin key; every caller of a server without keys): the file's KV enters the
pool and the prefix cache of the owning tenant's namespace as it is, so it must come from a server the operator
trusts.  A file of another model revision or KV settings, or a corrupted one, is refused with a 400 that says
what differs, and nothing is imported.  The body is within ``--max-body-bytes`` (default 4 MiB: raise it for
long sessions, about 23 KB per token for the embedded model's bf16 KV).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ...sessions.portable import export_session, import_session
from ..common.auth import Caller, admin_caller, caller
from ..common.context import managed_sessions, owned_session

router = APIRouter()  # behind the caller dependency, as /v1/sessions
admin_router = APIRouter()  # served with the /admin routes (on --admin-port when given)


@router.get("/v1/sessions/{sid}/export")
async def export(sid: str, request: Request, who: Caller = Depends(caller)):
    sessions = managed_sessions(request)
    data = await request.app.state.engine.call(
        lambda _: export_session(sessions, owned_session(sessions, who.tenant, sid)))
    return Response(data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{sid}.kvksession"'})


@admin_router.post("/admin/sessions/import")
async def import_(request: Request, id: str | None = None, tenant: str | None = None,
                  who: Caller = Depends(admin_caller)):
    sessions = managed_sessions(request)
    data = await request.body()
    owner = tenant if tenant is not None else who.tenant

    def do(_):
        s = import_session(sessions, data, id, owner)
        return {**s.info(), "object": "session", "tenant": s.tenant}

    return await request.app.state.engine.call(do)
