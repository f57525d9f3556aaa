"""The HTTP side's client of the engine: the engine loop thread and its typed commands (``async_engine``), the
requests in flight (``tracker``), token text for logprobs, the Prometheus metrics and the request traces."""
