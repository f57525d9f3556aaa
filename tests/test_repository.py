"""The repository's layout rules that no other test covers.

Benchmark results: every file under ``benchmarks/results/`` lies in ``benchmarks/results/<bench>/``, where bench is
the script that wrote it (``benchmarks/<kind>/<bench>.py``, or a module of ``kvkeeper.eval`` that writes its reports
there and names their folder in ``RESULTS_NAME``: ``health_eval``, ``health_train_gbt``, ``health_tune_trend``), and is named ``<bench>-<label>-<YYYY-MM-DD>``
with its suffixes (``.json``, ``.md``, ``.health.jsonl.gz``; a plot may add ``-<plot>`` before ``.png``), or lies in
such a run's folder ``<bench>-<label>-<YYYY-MM-DD>-runs/``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.utils.paths import ROOT

RESULTS = ROOT / "benchmarks" / "results"
IGNORED = (".tmp", ".log")  # git-ignored leftovers of runs (.gitignore)


def bench_writers(root: Path = ROOT) -> set[str]:
    """The names a results folder may have: the benchmark scripts ``benchmarks/<kind>/<name>.py`` and the
    ``RESULTS_NAME`` of the modules of ``src/kvkeeper/eval/`` (the evaluations that write reports under
    benchmarks/results/)."""
    scripts = {p.stem for p in (root / "benchmarks").glob("*/*.py") if p.stem != "__init__"}
    evals = {m.group(1) for p in (root / "src" / "kvkeeper" / "eval").rglob("*.py")
             for m in [re.search(r'^RESULTS_NAME = "(\w+)"', p.read_text(encoding="utf-8"), re.M)] if m}
    return scripts | evals


def result_files(results: Path = RESULTS) -> list[str]:
    """The files under results, relative to it (POSIX): git's tracked ones, or every file when git is missing."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "."], cwd=results, capture_output=True, text=True,
                             check=True, timeout=60).stdout
        return sorted(f for f in out.split("\0") if f)
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())


def misplaced(files: list[str], writers: set[str]) -> list[str]:
    """Each file of ``files`` (paths relative to benchmarks/results/) that breaks the layout, with the reason."""
    bad = []
    for f in files:
        parts = f.split("/")
        if f.endswith(IGNORED):
            continue
        if len(parts) < 2:
            bad.append(f"{f}: not in a benchmarks/results/<bench>/ folder")
            continue
        bench, name = parts[0], parts[1]
        if bench not in writers:
            bad.append(f"{f}: folder {bench!r} names no script benchmarks/<kind>/{bench}.py")
            continue
        run = re.escape(bench) + r"-[A-Za-z0-9._-]+-\d{4}-\d\d-\d\d"
        pattern = rf"{run}-runs" if len(parts) > 2 else rf"{run}(-[A-Za-z0-9_]+)?(\.[A-Za-z0-9]+)+"
        if not re.fullmatch(pattern, name):
            bad.append(f"{f}: {name!r} is not named {bench}-<label>-<YYYY-MM-DD>"
                       + ("-runs/" if len(parts) > 2 else "<suffix>"))
    return bad


def test_results_lie_in_their_bench_folder():
    writers = bench_writers()
    files = result_files()
    assert files, "no result files found under benchmarks/results/"
    bad = misplaced(files, writers)
    assert not bad, f"{len(bad)} result files break the layout:\n" + "\n".join(bad[:40])


def test_results_layout_check_can_fail():
    """The check rejects a flat file, a folder no script names, an off-pattern name and a stray run folder."""
    writers = {"kv_bench", "terms_bench"}
    good = ["kv_bench/kv_bench-smollm2-135m-2026-11-29.json", "kv_bench/kv_bench-smollm2-135m-2026-11-29-policies.png",
            "terms_bench/terms_bench-smollm2-135m-2026-12-01-runs/int8/a.json", "kv_bench/x.log"]
    assert misplaced(good, writers) == []
    bad = ["kv_bench-smollm2-135m-2026-11-29.json", "kquant/kquant-2048x2048-20261201.json",
           "kv_bench/kquant_bench-a-2026-12-01.json", "kv_bench/kv_bench-smollm2-135m-20261129.json",
           "kv_bench/kv_bench-2026-11-29.json", "terms_bench/terms_bench-x-2026-12-01/a.json"]
    assert [b.split(":")[0] for b in misplaced(bad, writers)] == bad
