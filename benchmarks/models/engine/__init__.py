"""The sections of ``benchmarks/models/engine_bench.py``, one module each: ``roofline``, ``formats``, ``multiturn``,
``batched``, ``single``, ``long_context``, the peers (``peers``), the report (``report``) and what they share
(``base``).  Importing the package puts the checkout's ``src/`` on the path when kvkeeper is not installed."""

import sys
from pathlib import Path

try:
    import kvkeeper  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
