"""``/v1/responses`` (OpenAI's Responses API on sessions): create, retrieve, delete, list input items.

::

    POST   /v1/responses                       a response; stream=true: typed SSE events (api/responses/events.py)
    GET    /v1/responses/{id}                  a stored response
    DELETE /v1/responses/{id}                  forget it and close its session (its KV freed)
    GET    /v1/responses/{id}/input_items      its input items (?order=asc|desc, default desc; limit 1-100; after)

How a response runs as a session turn: :mod:`kvkeeper.api.responses.run`.  Every route sees only the caller's
tenant's responses: another tenant's id is a 404 exactly as an unknown one.
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..common.access_log import record_usage
from ..common.auth import Caller, caller
from ..common.context import request_context
from ..common.errors import error_body
from ..common.rendering import clamped_header, collect
from ..common.streams import EngineDeadError, RequestStream, Usage
from .deps import Paging, close_sessions, conversation_store, response_store
from .events import ResponseEvents
from .items import output_items, reply_items, tools_not_offered
from .run import ResponseRun, new_response_id, plan_response
from .schema import ResponsesRequest

router = APIRouter()  # included behind the caller dependency (kvkeeper.api.common.auth)


async def _fork_previous(request: Request, run: ResponseRun) -> None:
    """Open the run's session as a fork of the previous response's (when that session is still open; else the
    run's turn opens a fresh session and recomputes what the prefix cache does not hold)."""
    sessions = request.app.state.engine.sessions
    if run.prev is None or not run.session or sessions is None:
        return

    def fork(_):
        src = sessions.find(run.tenant, run.prev.id)
        sessions.check_quota(run.tenant, run.gen.quota, opening=True)
        if src is not None and src.turn is None:
            sessions.fork(src, run.id, run.tenant)

    await request.app.state.engine.call(fork)


async def _finish(request: Request, run: ResponseRun, raw: str, reason: str | None, usage: Usage | None,
                  output: list[dict]) -> dict:
    """The final response object; stored (with its session) when asked and it ran to its end, else its
    session closed."""
    status = {"stop": "completed", "length": "incomplete"}.get(reason, "failed")
    obj = run.obj(status, output, usage, None if status != "failed" else
                  {"code": "server_error", "message": f"the response ended: {reason}"})
    conv = run.conversation
    if conv is not None and status != "failed":  # the input and the reply join the conversation
        conv.items += run.items + reply_items(output, raw, run.id)
        conv.call_ids |= run.output_calls(obj)
        conversation_store(request).save(conv)
    if run.body.store and status != "failed":
        dropped = response_store(request).put(run.stored(obj, raw))
        await close_sessions(request, run.tenant, [d.id for d in dropped])
    elif run.session:
        await close_sessions(request, run.tenant, [run.id])
    return obj


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, who: Caller = Depends(caller)):
    aeng = request.app.state.engine
    run = plan_response(body, request_context(request, who), response_store(request), conversation_store(request),
                        new_response_id())
    record_usage(request.scope, user=body.user or body.safety_identifier)
    await _fork_previous(request, run)
    try:
        s = await aeng.submit(run.gen)
    except BaseException:
        if run.session:
            await close_sessions(request, run.tenant, [run.id])
        raise
    hosted = tools_not_offered(body)  # hosted tools this server cannot run: not offered to the model, named here
    headers = {"X-KVKeeper-Tools-Not-Offered": ", ".join(hosted)} if hosted else {}
    headers |= clamped_header([run.gen], s.prompt_token_ids, aeng.served.max_model_len)
    if body.stream:
        return StreamingResponse(_events(request, run, s), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    try:
        got = await collect(request, s, 1)
    except BaseException:
        if run.session:
            await close_sessions(request, run.tenant, [run.id])
        raise
    text = got.texts[0]
    return JSONResponse(await _finish(request, run, text, got.reasons[0], got.usage, output_items(text, run.tools)),
                        headers=headers)


async def _events(request: Request, run: ResponseRun, s: RequestStream) -> AsyncIterator[str]:
    opts = run.body.stream_options
    ev = ResponseEvents(run.tools, bool(opts is not None and opts.include_obfuscation))
    reason, usage, done = None, None, False
    try:
        start = run.obj("in_progress", [], None)
        yield ev.event("response.created", response=start)
        yield ev.event("response.in_progress", response=start)
        async for out in s:
            for d in out.deltas:
                if d.finish_reason == "error":
                    yield ev.event("error", code="request_failed", message=d.error or "the request failed",
                                   param=None)
                    yield ev.event("response.failed", response=await _finish(request, run, ev.raw, "error", None,
                                                                            ev.items))
                    done = True
                    return
                reason = d.finish_reason or reason
                for e in ev.feed(d.text, d.finish_reason is not None):
                    yield e
            if out.finished:
                usage = out.usage
                record_usage(request.scope, usage)
        final = await _finish(request, run, ev.raw, reason, usage, ev.items)
        done = True
        yield ev.event("response.completed" if final["status"] == "completed" else "response." + final["status"],
                       response=final)
    except EngineDeadError:
        yield ev.event("error", **error_body("the engine failed; see the server log", "server_error")["error"])
    finally:
        s.abort()  # no-op when finished; frees the blocks when the client went away
        if not done and run.session:
            await close_sessions(request, run.tenant, [run.id])


@router.get("/v1/responses/{rid}")
async def get_response(rid: str, request: Request, who: Caller = Depends(caller)):
    return response_store(request).get(who.tenant, rid).body


@router.get("/v1/responses/{rid}/input_items")
async def list_input_items(rid: str, request: Request, paging: Paging = Depends(), who: Caller = Depends(caller)):
    return paging.page(response_store(request).get(who.tenant, rid).input_items)


@router.delete("/v1/responses/{rid}")
async def delete_response(rid: str, request: Request, who: Caller = Depends(caller)):
    response_store(request).delete(who.tenant, rid)
    await close_sessions(request, who.tenant, [rid])
    return {"id": rid, "object": "response", "deleted": True}
