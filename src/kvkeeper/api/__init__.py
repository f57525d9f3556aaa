"""The OpenAI-compatible HTTP server (``kvkeeper serve``), grouped by endpoint as vLLM's ``entrypoints/openai``.

From the top down: ``server`` (ServerConfig; wires sessions, breaker, audit, tracing; runs uvicorn), ``app`` (the
app factory: routers, error handlers, body-size limit); one package per endpoint: ``chat``, ``completions``
(each: ``protocol`` its body, ``serving`` the body into the engine's request, ``route`` the route and its
rendering), ``responses`` (the Responses and Conversations APIs), ``sessions`` (session routes, fork, export and
import), ``admin`` (KV block map, dumps, breaker and health state, LoRA adapters), ``observability`` (health,
metrics, models, tokenizer); ``engine_client`` (the engine loop thread and its typed commands, the requests in
flight, token text, Prometheus metrics, traces); ``common`` (what every endpoint shares: errors and limits, body
schemas and rules, the request context, auth, tools, chat messages, streams and their rendering, the served
snapshot, the access log).  An endpoint package imports ``common`` and ``engine_client``, never another endpoint.
"""
