"""The coding agents' command-line programs for ``tests/agents/`` and the server's access log they are judged by.

``make agents`` installs the agents from npm (aider from PyPI) at pinned versions into ``~/.cache/kvkeeper/agents``
(``KVKEEPER_AGENTS_DIR`` overrides it here, ``AGENTS_DIR`` in the Makefile); ``.ci/run`` runs it before
``make test``.  A missing program skips its test with the reason, and fails it under CI (``CI=true``), since CI
must install them.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

AGENTS_DIR = Path(os.environ.get("KVKEEPER_AGENTS_DIR", Path.home() / ".cache" / "kvkeeper" / "agents"))


def agent_cli(name: str) -> str:
    """The path of the agent program ``name`` (``claude``, ``codex``, ``qwen``: npm packages; ``aider``: a PyPI
    package in its own virtual environment, ``aider-venv``) that ``make agents`` installed; skips the test (fails it
    under CI) when it, or ``node`` that runs the npm packages' launchers, is missing."""
    npm = name != "aider"
    path = AGENTS_DIR / "node_modules" / ".bin" / name if npm else AGENTS_DIR / "aider-venv" / "bin" / name
    if npm and shutil.which("node") is None:
        why = "node (Node.js) is not installed: the coding agents are npm packages (make agents installs them)"
    elif not path.exists():
        why = f"{path} is missing: run `make agents` (npm, pip) to install the coding agents"
    else:
        return str(path)
    if os.environ.get("CI"):
        pytest.fail(why + " (CI must install them: .ci/run runs make agents)")
    pytest.skip(why)


@dataclass(frozen=True)
class Access:
    """One access-log line (:mod:`kvkeeper.api.common.access_log`): the request's path, status and usage (None
    where the line has ``-``: no usage)."""

    path: str
    status: int
    prompt_tokens: int | None
    cached_tokens: int | None

    @property
    def cached_share(self) -> float:
        return (self.cached_tokens or 0) / self.prompt_tokens if self.prompt_tokens else 0.0


_LINE = re.compile(r'^access \S+ "(\w+) (\S+)" (\d{3}) prompt_tokens=(\d+|-) completion_tokens=(?:\d+|-) '
                   r'cached_tokens=(\d+|-)', re.M)


def access_lines(log_text: str) -> list[Access]:
    """Every access-log line of a server log's text, in order."""
    num = lambda s: None if s == "-" else int(s)  # noqa: E731
    return [Access(m.group(2), int(m.group(3)), num(m.group(4)), num(m.group(5))) for m in _LINE.finditer(log_text)]
