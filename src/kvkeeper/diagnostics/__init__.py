"""Diagnostics of the KV cache: the block map (kvmap)."""
