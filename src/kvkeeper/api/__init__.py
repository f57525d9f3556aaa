"""The OpenAI-compatible HTTP server (``kvkeeper serve``).

Modules, from the top down: ``server`` (run uvicorn), ``app`` (FastAPI routes and
error handlers), ``schemas`` (request bodies), ``errors`` (OpenAI-style error
bodies), ``async_engine`` (the engine loop thread), ``metrics`` (Prometheus),
``token_text`` (token strings and bytes for logprobs).
"""
