"""Diagnostics of the KV cache: layer-wise dumps and diffs (``kvdump``, ``kvdiff``), the reuse audit
(``audit``) and fault injectors for tests (``faults``)."""
