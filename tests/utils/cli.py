"""The command line's ``main()`` run in the test process (tests/e2e/test_cli.py, tests/e2e/test_cli_processes.py)."""

from __future__ import annotations

import logging
import os
import subprocess


def main_in_process(capfd, *args: str) -> subprocess.CompletedProcess:
    """``kvkeeper ARGS`` through the CLI's ``main()`` in this process, as a CompletedProcess: its return value, and
    what reached file descriptors 1 and 2 (capfd: Python-level and C-level writes alike).  For the error paths whose
    subject is the message, not the process: each fails before any model is loaded; a subprocess would pay the
    interpreter and torch import (about 2.8 s of CPU) for it.  ``python -m kvkeeper.cli`` is ``sys.exit(main())``;
    the files using this keep a real process where the process is the subject (exit status and stderr through
    ``python -m``, a command that would run on if its refusal regressed)."""
    from kvkeeper.cli import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    bars = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    capfd.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's usage errors: status 2
        rc = e.code
    finally:  # main() configures this process's logging as a program's: put pytest's back
        root.handlers[:], root.level = handlers, level
        if bars is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["kvkeeper", *args], rc, out, err)
