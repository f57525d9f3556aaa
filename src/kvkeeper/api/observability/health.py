"""How the server is doing, open to every client (no key): ``GET`` / ``HEAD /health`` (200 while the engine thread
runs, else 503) and ``GET /metrics`` (Prometheus text: :mod:`kvkeeper.api.engine_client.metrics`; ``HEAD /metrics``:
200, its headers and no body)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine_client.metrics import CONTENT_TYPE

public_router = APIRouter()  # /health and /metrics: open to every client


@public_router.get("/health")
async def health(request: Request):
    if not request.app.state.engine.alive:
        return JSONResponse({"status": "error", "detail": "the engine thread is not running"}, status_code=503)
    return {"status": "ok"}


@public_router.head("/health", include_in_schema=False)  # load balancers' probes (one OpenAPI operation: GET)
async def health_head(request: Request):
    return await health(request)


@public_router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.engine.metrics.render(), media_type=CONTENT_TYPE)


@public_router.head("/metrics", include_in_schema=False)  # scrapers' and load balancers' probes: 200, no body
async def metrics_head(request: Request):
    return Response(media_type=CONTENT_TYPE)
