"""Start ``kvkeeper serve`` as a subprocess on a free 127.0.0.1 port (shared by the server tests)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(log_path: Path, *extra_args: str, timeout_s: float = 300, env: dict | None = None):
    """Yield (base URL, Popen) of a healthy server (env: the subprocess's environment, default ours).

    On exit the server is terminated if it still runs (a test may have killed it itself).
    """
    port = free_port()
    log_file = open(log_path, "w")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *extra_args], stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.1)  # a refused connection costs nothing; every server start waits here
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
