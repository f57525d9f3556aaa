"""Generated requests against ``/openapi.json`` (schemathesis): no answer may be a 5xx.

A server of its own, with a 256-token context and at most 4 generated tokens per
choice (``--max-new-tokens``), so that every generated request stays cheap.  The run is schemathesis's fuzzing
phase in its deterministic mode (Hypothesis derandomized, positive and negative cases), ``--max-examples`` per
operation: every operation of the schema, the same cases on every run and machine.  (It was bounded by
``--max-time 45`` with the coverage phase first: the clock, and so the machine's load, decided how many cases ran,
and the coverage phase's thousands of cases were cut wherever the 45 s ended, after 221 cases at load 16.)  The server
also exports its OpenTelemetry spans to the console, checked in its log afterwards; its access log
tells how many generated requests reached the engine (200) and how many were refused (400).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tests.utils.serverproc import running_server

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.slow


def test_generated_requests_get_no_5xx(tmp_path):
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    with running_server(tmp_path / "server.log", "--max-model-len", "256",
                        "--max-new-tokens", "4", "--otel-traces", "console") as base:
        out = subprocess.run([exe, "run", base + "/openapi.json", "--checks", "not_a_server_error",
                              "--phases", "fuzzing", "--generation-deterministic", "--max-examples", "8",
                              "--workers", "1", "--request-timeout", "30", "--no-color"],
                             capture_output=True, text=True, timeout=240, cwd=tmp_path)
        report = out.stdout + out.stderr
        assert out.returncode == 0, report[-4000:]
        m = re.search(r"(\d+) generated, (\d+) passed", report)
        assert m and m.group(1) == m.group(2) and int(m.group(1)) >= 100, report[-2000:]
        ops = re.search(r"Operations:\s+(\d+) selected / (\d+) total", report)
        fuzzed = re.search(r"Fuzzing \(in [0-9.]+s\)\s+\S+\s+(\d+) passed", report)  # every operation fuzzed
        assert ops and fuzzed and ops.group(1) == ops.group(2) == fuzzed.group(1), report[:3000]
        for _ in range(100):  # nothing left running afterwards (bounded poll: an abort goes through a queue)
            if "kvkeeper:num_requests_running 0.0" in httpx.get(base + "/metrics").text:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("kvkeeper:num_requests_running stayed above 0 for 10 s after the run")
        # most generated bodies carry some field with a value the server refuses (400 naming it); one known
        # good request makes sure the trace exporter below has a chat request to show
        ok = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
    # the server log holds no traceback (checked by running_server on exit), and the console trace
    # exporter wrote the requests' spans there
    log = (tmp_path / "server.log").read_text()
    assert '"gen_ai.operation.name": "chat"' in log and '"name": "prefill"' in log
