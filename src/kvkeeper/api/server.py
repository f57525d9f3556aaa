"""Run the OpenAI-compatible server on uvicorn (``kvkeeper serve``)."""

from __future__ import annotations

import logging

from .app import DEFAULT_MAX_BODY_BYTES, create_app
from .async_engine import AsyncEngine

log = logging.getLogger(__name__)


def run_server(engine, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 256,
               served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               log_level: str = "warning") -> None:
    """Serve ``engine`` (an :class:`LLMEngine`) until interrupted (SIGINT / SIGTERM).

    max_queue: waiting requests before new ones get 503.  max_body_bytes: larger bodies get 413.
    """
    import uvicorn

    app = create_app(AsyncEngine(engine, max_queue=max_queue), served_model_name, max_body_bytes)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level in ("info", "debug"))
