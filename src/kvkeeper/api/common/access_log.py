"""One access-log line per HTTP request: method, path, status, token counts, milliseconds.

``kvkeeper serve`` writes it by default on stderr through the ``kvkeeper.access`` logger
(``--no-access-log`` turns it off)::

    access 127.0.0.1:50312 "POST /v1/chat/completions" 200 prompt_tokens=31 completion_tokens=16 cached_tokens=0 ms=742.3

Token counts are those of the response's ``usage`` (``-`` when it has none: other endpoints, errors,
a stream cut short); for a streamed response the line is written when its last chunk is sent, so ``ms``
is the whole response.  A request's ``user`` / ``safety_identifier`` field, when given, ends the line
(``user=...``).  Handlers report usage with :func:`record_usage`.
"""

from __future__ import annotations

import logging
import sys
import time

ACCESS_LOGGER = "kvkeeper.access"
_KEY = "kvkeeper.access"  # the scope entry a handler fills (a dict shared with the middleware)


def record_usage(scope: dict, usage=None, user: str | None = None) -> None:
    """Note a request's usage (a :class:`kvkeeper.api.common.streams.Usage`) and user for its access-log line."""
    entry = scope.get(_KEY)
    if entry is None:
        return
    if usage is not None:
        entry["usage"] = usage
    if user is not None:
        entry["user"] = user


def configure_access_log(enabled: bool) -> logging.Logger:
    """The access logger: INFO lines on stderr when ``enabled`` (whatever the server's log level), else silent."""
    log = logging.getLogger(ACCESS_LOGGER)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
    if enabled:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
    else:
        log.setLevel(logging.CRITICAL + 1)
    return log


class AccessLogMiddleware:
    """ASGI middleware writing :mod:`this module's <kvkeeper.api.common.access_log>` line per HTTP request."""

    def __init__(self, app, logger: logging.Logger | None = None):
        self.app = app
        self.log = logger or logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.log.isEnabledFor(logging.INFO):
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        entry: dict = {"status": 500}
        scope[_KEY] = entry

        async def sending(msg):
            if msg["type"] == "http.response.start":
                entry["status"] = msg["status"]
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                self._write(scope, entry, t0)

        try:
            await self.app(scope, receive, sending)
        finally:
            if not entry.get("written"):
                self._write(scope, entry, t0)

    def _write(self, scope, entry: dict, t0: float) -> None:
        if entry.get("written"):
            return
        entry["written"] = True
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        u = entry.get("usage")
        counts = (f"prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
                  f"cached_tokens={u.cached_tokens}") if u is not None else "prompt_tokens=- completion_tokens=- cached_tokens=-"
        user = f" user={entry['user']!r}" if entry.get("user") else ""
        self.log.info('access %s "%s %s" %d %s ms=%.1f%s', who, scope.get("method"), scope.get("path"),
                      entry["status"], counts, (time.perf_counter() - t0) * 1000, user)
