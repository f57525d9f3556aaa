"""The OpenAI-compatible HTTP server (``kvkeeper serve``).

Modules, from the top down: ``server`` (run uvicorn), ``app`` (FastAPI routes and
error handlers), ``chat`` / ``completions`` (each: its body into the engine's request,
its route, its rendering), ``protocol`` (the rules bodies share), ``request_parsing``
(headers), ``schemas`` (request bodies), ``errors`` (OpenAI-style error bodies),
``served`` (the snapshot handlers read), ``async_engine`` (the engine loop thread and its
typed commands), ``metrics`` (Prometheus), ``token_text`` (token strings and bytes for logprobs).
"""
