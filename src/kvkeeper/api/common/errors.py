"""OpenAI-style error bodies, the exceptions the HTTP layer raises, and the server's default limits behind two of
them (the body size of a 413, the waiting queue of a 503).

Every error a client sees has the shape ``{"error": {"message", "type", "param", "code"}}``
(the OpenAI API's), with one of these statuses:

* 400 ``invalid_request_error``: bad parameters (also pydantic validation errors, which
  FastAPI would answer with 422), a prompt that does not fit the context window
  (code ``context_length_exceeded``, the message gives the numbers).
* 404 ``not_found_error``: unknown model (code ``model_not_found``), session or route.
* 401 ``authentication_error``: API keys are configured and the request has none, or a wrong one
  (code ``invalid_api_key``); 403 ``permission_error``: an admin route asked with a tenant's key.
* 409 ``invalid_request_error``: the session has a turn in flight (code ``session_busy``).
* 413 ``invalid_request_error``: a request body over the size limit.
* 429 ``rate_limit_error``: the caller's tenant is at its limit of open sessions or pinned KV blocks
  (code ``tenant_quota_exceeded``), with ``Retry-After`` (seconds).
* 503 ``server_overloaded``: the waiting queue is full (code ``queue_full``) or the KV circuit breaker
  is degraded and refuses new sessions (code ``kv_memory_short``), with a ``Retry-After`` header (seconds).
* 500 ``server_error``: anything unexpected; the client gets a generic message, the
  stack trace goes to the server log only.
"""

from __future__ import annotations

from typing import Any

from ...errors import (ContextLengthError, KVKeeperError, ModelNotFoundError, OverloadedError, QuotaExceededError,
                       SessionBusyError, SessionNotFoundError)

# The server's default limits (ServerConfig and the command line's ``serve`` options read them: this module imports
# FastAPI only inside install_error_handlers, so that a ServerConfig is built without it).
DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: larger request bodies get 413 (ServerConfig.max_body_bytes)
DEFAULT_MAX_QUEUE = 256  # requests that may wait before new ones get 503 (ServerConfig.max_queue)


class APIError(Exception):
    """An error to send to the client as an OpenAI-style body with HTTP ``status``.

    headers: extra response headers (e.g. ``Retry-After`` in seconds).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class QueueFullError(APIError):
    """The bounded waiting queue is full: 503 with ``Retry-After`` (seconds)."""

    def __init__(self, max_queue: int, retry_after_s: int = 1):
        super().__init__(503, f"the server is overloaded: {max_queue} requests are already waiting; retry later",
                         type="server_overloaded", code="queue_full", headers={"Retry-After": str(retry_after_s)})


class BodyTooLargeError(APIError):
    """The request body exceeds the server's limit: 413."""

    def __init__(self, limit_bytes: int):
        super().__init__(413, f"request body is larger than {limit_bytes} bytes", code="request_too_large")


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_kvkeeper_error(e: KVKeeperError, prompt_param: str = "messages") -> APIError:
    """Map an engine error to its HTTP status: 400 for bad input, 404 for unknown model or session.

    prompt_param: the request field holding the prompt, named by a context-length error (``messages`` for chat,
    ``prompt`` for text completions)."""
    if isinstance(e, OverloadedError):
        return APIError(503, str(e), type="server_overloaded", code="kv_memory_short",
                        headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, QuotaExceededError):
        return APIError(429, str(e), type="rate_limit_error", code="tenant_quota_exceeded",
                        headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param=prompt_param, code="context_length_exceeded")
    if isinstance(e, SessionBusyError):
        return APIError(409, str(e), code="session_busy")
    if isinstance(e, SessionNotFoundError):
        return APIError(404, str(e), type="not_found_error", code="session_not_found")
    if isinstance(e, ModelNotFoundError):
        return APIError(404, str(e), type="not_found_error", param="model", code="model_not_found")
    return APIError(400, str(e), param=getattr(e, "param", None))


_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded"}


def validation_body(e) -> dict:
    """A pydantic validation error as one 400 body naming the first field at fault."""
    msgs, param = [], None
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            msgs.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', 'decode error')}")
            continue
        where = ".".join(loc)
        if not where:  # the body itself: empty, not JSON-typed, or JSON but not an object
            msgs.append(f"the request body must be a JSON object of the request's fields, sent with "
                        f"Content-Type: application/json ({err.get('msg')})")
            continue
        param = param or where
        msgs.append(f"{where}: {err.get('msg')}")
    return error_body("; ".join(msgs) or "invalid request", param=param)


def install_error_handlers(app, engine_dead: type[Exception]) -> None:
    """OpenAI-style bodies for every error; no stack trace reaches a client (500s are logged).

    engine_dead: the exception type meaning the engine thread is gone (a 500).
    """
    import logging

    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    log = logging.getLogger("kvkeeper.api")

    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def kvk_error(request, e: KVKeeperError):
        a = from_kvkeeper_error(e, "prompt" if request.url.path.rstrip("/").endswith("/v1/completions") else "messages")
        return JSONResponse(a.body(), status_code=a.status, headers=a.headers)

    async def validation_error(request, e: RequestValidationError):
        return JSONResponse(validation_body(e), status_code=400)

    async def http_error(request, e: StarletteHTTPException):
        typ = _STATUS_TYPES.get(e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error")
        return JSONResponse(error_body(str(e.detail), typ), status_code=e.status_code, headers=e.headers)

    async def dead(request, e: Exception):
        log.error("request failed: %s", e)
        return JSONResponse(error_body("the engine failed; see the server log", "server_error"), status_code=500)

    async def internal(request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error; see the server log", "server_error"), status_code=500)

    for exc, handler in ((APIError, api_error), (KVKeeperError, kvk_error), (RequestValidationError, validation_error),
                         (StarletteHTTPException, http_error), (engine_dead, dead), (Exception, internal)):
        app.add_exception_handler(exc, handler)
