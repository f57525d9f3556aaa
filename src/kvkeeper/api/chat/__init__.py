"""``POST /v1/chat/completions``: the body into the engine's request and the route with its rendering."""
