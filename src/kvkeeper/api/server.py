"""Run the OpenAI-compatible server on uvicorn (``kvkeeper serve``)."""

from __future__ import annotations

import logging

from .app import DEFAULT_MAX_BODY_BYTES, create_app
from .async_engine import AsyncEngine
from .tracing import RequestTracer, configure_tracing

log = logging.getLogger(__name__)


def run_server(engine, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 256,
               served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               log_level: str = "warning", max_new_tokens: int | None = None, trace_exporter: str = "none",
               otlp_endpoint: str | None = None, breaker=None) -> None:
    """Serve ``engine`` (an :class:`LLMEngine`) until interrupted (SIGINT / SIGTERM).

    max_queue: waiting requests before new ones get 503.  max_body_bytes: larger bodies get 413.
    max_new_tokens: cap on tokens generated per choice (None: the rest of the context).
    trace_exporter: "none", "console" or "otlp" (see :mod:`kvkeeper.api.tracing`); otlp_endpoint its URL.
    breaker: a :class:`kvkeeper.sessions.breaker.BreakerConfig` to watch KV memory (None: no breaker).
    """
    import uvicorn

    name = served_model_name or engine.model_name
    if breaker is not None:
        from ..sessions.breaker import CircuitBreaker

        CircuitBreaker(engine, breaker)
    tracer = configure_tracing(trace_exporter, otlp_endpoint)
    aeng = AsyncEngine(engine, max_queue=max_queue, max_new_tokens=max_new_tokens,
                       tracer=RequestTracer(tracer, name) if tracer is not None else None)
    app = create_app(aeng, name, max_body_bytes)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level in ("info", "debug"))
