"""Start ``kvkeeper serve`` as a subprocess on a free 127.0.0.1 port (shared by the server tests)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


_LOWEST = 20000  # above Ray's worker ports (10002-19999 by default)
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1) -> int:
    """The first of ``n`` consecutive ports on 127.0.0.1 that are free now, below the kernel's ephemeral range,
    and not handed out before in this process.

    A port the kernel handed out (``bind(("127.0.0.1", 0))``) is in the ephemeral range, where any process may get
    it next as the local port of an outgoing connection or of its own ``bind(0)`` before the server this port is
    for binds it.  A full run failed so: something, most likely the Ray started after the test chose its KV-event
    ports, held the first one, and the replica of rank 0 failed to bind it for three minutes
    (tests/e2e/test_cluster_exact.py).
    Below the range only a process that names the port takes it."""
    low = _ephemeral_low()
    top = low if low - n > _LOWEST + 1000 else 65536
    rng = random.SystemRandom()
    for _ in range(500):
        first = rng.randrange(_LOWEST, top - n)
        ports = range(first, first + n)
        if not _handed_out.intersection(ports) and all(_bindable(p) for p in ports):
            _handed_out.update(ports)
            return first
    raise RuntimeError(f"no {n} consecutive free ports in [{_LOWEST}, {top})")


def free_port() -> int:
    """A port on 127.0.0.1 that is free now (:func:`free_ports`)."""
    return free_ports(1)


def _wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout_s: float) -> None:
    """Poll ``base``/health every 0.1 s until it answers 200 (RuntimeError when the server exits or ``timeout_s``
    passes).  One client for the whole wait: ``httpx.get`` builds a new client, and with it an SSL context that
    loads the CA bundle (about 50 ms of CPU), on every poll; on two cores that took CPU from the server starting
    beside it (measured: 13.6 s of the test process's samples in a test with two server starts)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()}")
            try:
                if http.get(base + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.1)  # a refused connection costs nothing; every server start waits here


def default_threads(extra_args: tuple[str, ...]) -> tuple[str, ...]:
    """``--threads`` for a server started under pytest-xdist with N workers (``PYTEST_XDIST_WORKER_COUNT``) and no
    ``--threads`` of its own: the worker's share of the CPUs, at least 1, as tests/conftest.py gives the workers'
    own torch.  Otherwise nothing (the server's default: every CPU it may use).

    The server is another process and would take every CPU: two workers each waiting on a server of two threads
    on two cores oversubscribe them twice over, and each parallel region then waits for its thread that lost
    its core (the measurement in tests/conftest.py's ``pytest_configure``)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers <= 1 or "--threads" in extra_args:
        return ()
    from tests.utils.engines import worker_threads

    return ("--threads", str(worker_threads(workers)))


@contextlib.contextmanager
def server_process(log_path: Path, *extra_args: str, timeout_s: float = 300, env: dict | None = None):
    """Yield (base URL, Popen) of a healthy server (env: the subprocess's environment, default ours).  Under
    pytest-xdist a server without ``--threads`` gets its worker's share of the CPUs (:func:`default_threads`).

    On exit the server is terminated if it still runs (a test may have killed it itself).
    """
    extra_args = (*extra_args, *default_threads(extra_args))
    port = free_port()
    log_file = open(log_path, "w")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *extra_args], stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log_path, timeout_s)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_file.close()


def wait_for_log(log_path: Path, found, timeout_s: float = 30.0, poll_s: float = 0.1) -> str:
    """The server log's text once ``found(text)`` is true, read again every ``poll_s`` seconds: a line the server
    writes after its response (the access log) may not be there yet.  Raises AssertionError with the log's tail
    when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = Path(log_path).read_text()
        if found(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"not in the server log after {timeout_s} s:\n{text[-2000:]}")
        time.sleep(poll_s)


@contextlib.contextmanager
def running_server(log_path: Path, *extra_args: str, timeout_s: float = 300):
    """Yield the base URL of a healthy server; terminate it on exit and fail if its log holds a traceback."""
    with server_process(log_path, *extra_args, timeout_s=timeout_s) as (base, _proc):
        yield base
    out = log_path.read_text()
    assert "Traceback" not in out, out
