"""Helpers shared by the benchmark scripts: the machine's CPU name, result file names and writing a report.

Result files are named by run: ``<bench>-<config>-<date>`` (``engine_bench-smollm2-135m-2026-11-30.json``), where
bench is the script's name, config says what ran (the model, or the variant of the set-up) and date is the UTC day of
the run (YYYY-MM-DD).  They live in one folder per bench: ``benchmarks/results/<bench>/`` (``results_dir``).  The
scripts sit in ``benchmarks/<kind>/`` and import this module after putting ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m"  # the embedded SmolLM2-135M-Instruct: the config of most runs


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def run_date() -> str:
    """Today's UTC date, YYYY-MM-DD: the date part of a result's name."""
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def result_name(bench: str, config: str = MODEL, date: str | None = None) -> str:
    """``<bench>-<config>-<date>``, e.g. ``engine_bench-smollm2-135m-2026-11-30`` (no suffix).

    config is made file-safe (characters other than letters, digits, ``.``, ``_`` and ``-`` become ``-``); date is
    today's UTC date unless given.  Raises ValueError for an empty bench or config.
    """
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", config).strip("-")
    if not bench or not safe:
        raise ValueError(f"a result name needs a bench and a config, got {bench!r} and {config!r}")
    return f"{bench}-{safe}-{date or run_date()}"


def results_dir(bench: str) -> Path:
    """``benchmarks/results/<bench>/``: the folder of one bench's results (bench: the script's name, no ``.py``)."""
    if not bench or "/" in bench:
        raise ValueError(f"a bench is a script's name, got {bench!r}")
    return RESULTS / bench


def result_path(bench: str, config: str = MODEL, suffix: str = ".json", out: Path | None = None,
                date: str | None = None) -> Path:
    """``out/<bench>-<config>-<date><suffix>``: where a run writes its result (suffix ``.json``, ``.md``, ...).

    out defaults to ``results_dir(bench)``, i.e. ``benchmarks/results/<bench>/``.
    """
    return Path(out if out is not None else results_dir(bench)) / (result_name(bench, config, date) + suffix)


def latest_result(bench: str, config: str = MODEL, suffix: str = ".json", out: Path | None = None) -> Path | None:
    """The newest existing ``out/<bench>-<config>-<date><suffix>`` (by date; out defaults to ``results_dir(bench)``),
    or None when there is none."""
    out = Path(out if out is not None else results_dir(bench))
    pat = re.compile(re.escape(result_name(bench, config, "X")[:-1]) + r"(\d{4}-\d\d-\d\d)" + re.escape(suffix) + "$")
    found = sorted((m.group(1), p) for p in out.glob(f"{bench}-*{suffix}") if (m := pat.match(p.name)))
    return found[-1][1] if found else None


def write_report(out: Path, name: str, res: dict, md: str) -> None:
    """Write ``out/name.json`` and ``out/name.md`` (making out) and print the markdown (name: a ``result_name``)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{name}.md").write_text(md)
    print(md)
