"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the chat path.

:mod:`.protocol`: the request shapes; :mod:`.serving`: a body to the engine's chat request and the output rendered
as Anthropic's message or its stream events; :mod:`.route`: the routes, Anthropic's error shape and ``x-api-key``.
"""
