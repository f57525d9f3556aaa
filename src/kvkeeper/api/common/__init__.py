"""What the endpoints share: error bodies and limits, request schemas and the body rules (model, refused and
unknown fields, sampling parameters, output constraints), the request context and caller (API keys), tools, chat
messages, the request objects and streams the engine thread answers with, their rendering as JSON or server-sent
events, the served snapshot and the access log."""
