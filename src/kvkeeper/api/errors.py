"""OpenAI-style error bodies and the exceptions the HTTP layer raises.

Every error a client sees has the shape ``{"error": {"message", "type", "param", "code"}}``
(the OpenAI API's), with one of these statuses:

* 400 ``invalid_request_error``: bad parameters (also pydantic validation errors, which
  FastAPI would answer with 422), a prompt that does not fit the context window
  (code ``context_length_exceeded``, the message gives the numbers).
* 404 ``not_found_error``: unknown model (code ``model_not_found``), session or route.
* 413 ``invalid_request_error``: a request body over the size limit.
* 503 ``server_overloaded``: the waiting queue is full (code ``queue_full``) or the KV circuit breaker
  is degraded and refuses new sessions (code ``kv_memory_short``), with a ``Retry-After`` header (seconds).
* 500 ``server_error``: anything unexpected; the client gets a generic message, the
  stack trace goes to the server log only.
"""

from __future__ import annotations

from typing import Any

from ..errors import ContextLengthError, InvalidRequestError, KVKeeperError, ModelNotFoundError, SessionNotFoundError


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


def from_kvkeeper_error(e: KVKeeperError) -> APIError:
    """Map an engine error to its HTTP status: 400 for bad input, 404 for unknown model or session."""
    from ..sessions.breaker import OverloadedError

    if isinstance(e, OverloadedError):
        return APIError(503, str(e), type="server_overloaded", code="kv_memory_short",
                        headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, SessionNotFoundError):
        return APIError(404, str(e), type="not_found_error", code="session_not_found")
    if isinstance(e, ModelNotFoundError):
        return APIError(404, str(e), type="not_found_error", param="model", code="model_not_found")
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e))
    return APIError(400, str(e))
