"""The KV cache's storage formats, one module each: :mod:`.plain` (fp32 / bf16 / fp16), :mod:`.int8` (int8 / fp8
with scales), :mod:`.kivi` (KIVI int4 / int2); :mod:`.base` holds what they share (:class:`~.base.KVFormat`, the
layer base :class:`~.base.PagedKV`).  Importing the package registers each format's layer class, so that
``PagedKV(..., fmt)`` makes the right one.
"""

from . import int8, kivi, plain  # noqa: F401  (each registers its PagedKV layout)
