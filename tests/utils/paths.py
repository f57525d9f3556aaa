"""Where the repository's files are, for every test whatever its folder's depth: ``ROOT`` (the repository root),
``DATA`` (its ``data/`` folder: the public data sets the tests read)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
