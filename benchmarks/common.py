"""Helpers shared by the benchmark scripts: the machine's CPU name and writing a report."""

from __future__ import annotations

import json
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def write_report(out: Path, name: str, res: dict, md: str) -> None:
    """Write ``out/name.json`` and ``out/name.md`` and print the markdown."""
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{name}.md").write_text(md)
    print(md)
