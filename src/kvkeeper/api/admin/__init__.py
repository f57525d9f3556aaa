"""Admin endpoints: the KV block map, KV dumps, the breaker and health state, the prefix-cache reset, LoRA adapters
at run time."""
