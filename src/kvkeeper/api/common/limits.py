"""The HTTP server's default limits, in a module of their own so that ``ServerConfig`` (and the command line's
``serve`` options) can be built without importing FastAPI (:mod:`kvkeeper.api.server` imports the app only
when it builds one)."""

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: larger request bodies get 413 (ServerConfig.max_body_bytes)
DEFAULT_MAX_QUEUE = 256  # requests that may wait before new ones get 503 (ServerConfig.max_queue)
