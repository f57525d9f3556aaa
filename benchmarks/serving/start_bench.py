#!/usr/bin/env python
"""Warm start to a healthy server, kvkeeper beside llama.cpp's (issue 31, item 5).

Each start is a fresh process: the time from ``Popen`` to the first 200 from the server's readiness route
(``kvkeeper serve``: ``/health``; llama-cpp-python's server, which has no ``/health``: ``/v1/models``), polled every
20 ms, then the process is terminated.  "Warm": one unmeasured start of each engine first fills every cache
(kvkeeper's converted tokenizer and repacked blocks under ``~/.cache/kvkeeper``, the OS page cache, Python's
bytecode).  Python's bytecode is cached under a folder of this benchmark's own (``PYTHONPYCACHEPREFIX``, so that an
environment with ``PYTHONDONTWRITEBYTECODE`` still measures what an installed package does) for every engine.
The engines' starts alternate, ``--starts`` each; the floor is ``python -c "import torch"`` timed the same way.
Each start also records the CPU seconds (user + system, all threads) the process had used when it became ready
(``/proc/PID/stat``; the floor's from ``wait4``): on a shared machine the wall time stretches with the other jobs'
load, the CPU time much less.

    .venv/bin/python benchmarks/serving/start_bench.py [--starts 5] [--llama-python PATH] [--baseline-src DIR]
        [--out benchmarks/results/start_bench] [--config NAME]

``--llama-python``: a Python with ``llama-cpp-python[server]`` (without it llama.cpp is not measured);
``--baseline-src DIR``: also start the kvkeeper of another ``src`` folder (``git archive REV src | tar -x -C DIR``)
in the same run, for a before / after.  Writes ``OUT/start_bench-<config>-<date>.{json,md}`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import MODEL, RESULTS, cpu_model, result_name, write_report  # noqa: E402

POLL_S = 0.02


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (all its threads), from ``/proc/PID/stat``;
    None where that file cannot be read (not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (proc(5): fields 14, 15)


def time_start(cmd: list[str], route: str | None, env: dict, log: Path, timeout_s: float = 300
               ) -> tuple[float, float | None]:
    """(seconds from launching ``cmd`` (``{port}`` in it replaced) to the first 200 from ``route``, the CPU
    seconds the process had used then; None if unknown).  ``route`` None: until the process's exit with status 0.
    Raises RuntimeError when it exits first or ``timeout_s`` passes."""
    port = _free_port()
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen([c.replace("{port}", str(port)) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
        try:
            if route is None:
                _, status, usage = os.wait4(proc.pid, 0)
                wall = time.perf_counter() - t0
                proc.returncode = os.waitstatus_to_exitcode(status)
                if proc.returncode != 0:
                    raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
                return wall, usage.ru_utime + usage.ru_stime
            deadline = t0 + timeout_s
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}{route}", timeout=5).status_code == 200:
                        return time.perf_counter() - t0, _cpu_s(proc.pid)
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"{cmd[:3]} not ready after {timeout_s} s")
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def engines(args, pycache: Path) -> list[dict]:
    from kvkeeper.weights.sources import resolve_model_path

    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    base["PYTHONPYCACHEPREFIX"] = str(pycache)
    py = sys.executable
    serve = [py, "-m", "kvkeeper.cli", "serve", "--host", "127.0.0.1", "--port", "{port}", "--threads", "2"]
    out = [{"name": "kvkeeper serve", "cmd": serve, "route": "/health", "env": base}]
    if args.baseline_src is not None:
        src = str(args.baseline_src.resolve())
        out.insert(0, {"name": f"kvkeeper serve ({args.baseline_src})", "cmd": serve, "route": "/health",
                       "env": {**base, "PYTHONPATH": src}})
    if args.llama_python:
        out.append({"name": "llama.cpp server (llama-cpp-python)", "route": "/v1/models",
                    "cmd": [args.llama_python, "-m", "llama_cpp.server", "--model", str(resolve_model_path()),
                            "--host", "127.0.0.1", "--port", "{port}", "--n_threads", "2", "--n_ctx", "8192"],
                    "env": {**base, "OMP_NUM_THREADS": "2"}})
    out.append({"name": "floor: python -c 'import torch'", "cmd": [py, "-c", "import torch"], "route": None,
                "env": base})
    return out


def markdown(res: dict) -> str:
    rows = ["| engine | starts | median (s) | min (s) | max (s) | CPU median (s) | CPU min (s) |",
            "|---|---|---|---|---|---|---|"]
    for e in res["engines"]:
        t = e.get("times_s")
        if not t:
            rows.append(f"| {e['name']} | 0 | - | - | - ({e.get('error', '')}) | - | - |")
            continue
        cpu = [c for c in e.get("cpu_s", []) if c is not None]
        cpu_cols = f"{statistics.median(cpu):.2f} | {min(cpu):.2f}" if cpu else "- | -"
        rows.append(f"| {e['name']} | {len(t)} | {e['median_s']:.2f} | {min(t):.2f} | {max(t):.2f} | {cpu_cols} |")
    return (f"# Warm start to a healthy server ({res['config']}, {res['date']})\n\n{res['cpu']}; embedded model "
            f"(SmolLM2-135M-Instruct Q4_1 GGUF), 2 threads; the starts of the engines alternate.  Load average "
            f"{res['load_start']} at the start, {res['load_end']} at the end.  Target (kvkeeper): under 2 s.  "
            f"CPU: user + system seconds of the process (all threads) when it became ready.\n\n"
            + "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=5, help="measured starts per engine (after one warm-up each)")
    ap.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python[server]")
    ap.add_argument("--baseline-src", type=Path, default=None, help="another kvkeeper src folder, started too")
    ap.add_argument("--pycache", type=Path, default=Path(tempfile.gettempdir()) / "kvkeeper-start-bench-pycache")
    ap.add_argument("--out", type=Path, default=RESULTS / "start_bench")
    ap.add_argument("--config", default=MODEL, help="the result's config name (e.g. the code measured)")
    args = ap.parse_args()
    if args.starts < 1:
        ap.error(f"--starts must be at least 1, got {args.starts}")
    load = lambda: " / ".join(f"{x:.2f}" for x in os.getloadavg())  # noqa: E731
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(), "load_start": load(),
           "config": args.config, "starts": args.starts}
    todo = engines(args, args.pycache)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "start.log"
        for e in todo:  # the warm-up start
            try:
                time_start(e["cmd"], e["route"], e["env"], log)
                e["times_s"], e["cpu_s"] = [], []
            except RuntimeError as err:
                e["error"] = str(err).splitlines()[0][:200]
                print(f"{e['name']}: {e['error']}", file=sys.stderr)
        for _ in range(args.starts):
            for e in todo:
                if "times_s" in e:
                    wall, cpu = time_start(e["cmd"], e["route"], e["env"], log)
                    e["times_s"].append(wall)
                    e["cpu_s"].append(cpu)
                    print(f"{e['name']}: {wall:.2f} s (CPU {cpu if cpu is None else round(cpu, 2)} s)",
                          file=sys.stderr, flush=True)
    res["load_end"] = load()
    for e in todo:
        e.pop("env")
        if e.get("times_s"):
            e["median_s"] = statistics.median(e["times_s"])
    res["engines"] = todo
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, result_name("start_bench", args.config), res, markdown(res))


if __name__ == "__main__":
    main()
