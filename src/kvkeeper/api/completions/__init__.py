"""``POST /v1/completions``: the body into the engine's requests (one per prompt) and the route with its rendering."""
