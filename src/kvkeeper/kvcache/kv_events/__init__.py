"""KV cache events in vLLM's schema: the wire (schema, msgpack, the pool's recorder) and the ZMQ publisher."""
