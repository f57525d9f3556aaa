"""Diagnostics of the KV cache: the block map (``kvmap``), layer-wise dumps and diffs (``kvdump``,
``kvdiff``), the reuse audit (``audit``) and fault injectors for tests (``faults``)."""
