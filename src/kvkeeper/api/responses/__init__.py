"""OpenAI's Responses API (``/v1/responses``) on sessions, and its Conversations API (``/v1/conversations``): the
routes, the run of one request, the request schema, items, streamed events and the stores of responses and
conversations."""
