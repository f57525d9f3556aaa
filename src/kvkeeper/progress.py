"""Progress of long operations (model load and dequantisation, evals, benchmarks) on stderr.

On a terminal: a rich progress bar (description, bar, done/total, elapsed time) that disappears when done.
Elsewhere (a pipe, a CI log, a file): plain lines, at most one per ``min_interval_s`` seconds plus the
last one, e.g. ``dequantise: 120/272 (44%) 3.1 s``.  ``quiet=True`` prints nothing.

Library code (model loading, evals) reports through :func:`progress` without a ``quiet`` argument: it
prints only inside :func:`reporting` (the command line and the benchmark scripts turn it on; a program
that embeds kvkeeper sees nothing on stderr unless it does too).

Usage::

    with progress("dequantise", total=len(tensors)) as p:
        for t in tensors:
            ...
            p.advance()
        p.note("a line shown above the bar")
"""

from __future__ import annotations

import contextlib
import sys
import time
from contextvars import ContextVar
from typing import TextIO

_REPORTING: ContextVar[bool] = ContextVar("kvkeeper_progress_reporting", default=False)


@contextlib.contextmanager
def reporting(enabled: bool = True):
    """Within this block (this thread or task), :func:`progress` without ``quiet`` prints."""
    token = _REPORTING.set(enabled)
    try:
        yield
    finally:
        _REPORTING.reset(token)


class Progress:
    """One task's progress.  total: steps (None: unknown; only counts and time are shown)."""

    def __init__(self, description: str, total: int | None = None, stream: TextIO | None = None,
                 min_interval_s: float = 2.0, quiet: bool = False, terminal: bool | None = None):
        self.description = description
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval_s = min_interval_s
        self.quiet = quiet
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = terminal if terminal is not None else bool(isatty and isatty())
        self._bar = None
        self._task = None
        self._t0 = time.perf_counter()
        self._last_line = float("-inf")
        self._printed: int | None = None  # the count of the last plain line

    def __enter__(self) -> "Progress":
        self._t0 = time.perf_counter()
        if self.quiet or not self.terminal:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
            TimeElapsedColumn

        console = Console(file=self.stream, highlight=False, force_terminal=True)
        self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
        self._bar.__enter__()
        self._task = self._bar.add_task(self.description, total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None
        elif not self.quiet and exc[0] is None:
            self._line(force=True)

    def advance(self, n: int = 1, description: str | None = None) -> None:
        """Count ``n`` more steps done (and optionally change the description)."""
        self.done += n
        if description is not None:
            self.description = description
        if self._bar is not None:
            self._bar.update(self._task, advance=n, description=self.description)
        elif not self.quiet:
            self._line()

    def note(self, message: str) -> None:
        """Print ``message`` on its own line (above the bar on a terminal)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def _line(self, force: bool = False) -> None:
        now = time.perf_counter()
        if (not force and now - self._last_line < self.min_interval_s) or (force and self._printed == self.done):
            return
        self._last_line, self._printed = now, self.done
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        print(f"{self.description}: {count}{pct} {now - self._t0:.1f} s", file=self.stream, flush=True)


def progress(description: str, total: int | None = None, quiet: bool | None = None, **kw) -> Progress:
    """A :class:`Progress` context manager (keyword arguments: stream, min_interval_s, terminal).

    quiet: None (default) prints only inside :func:`reporting`; False always prints; True never."""
    return Progress(description, total, quiet=not _REPORTING.get() if quiet is None else quiet, **kw)


def track(iterable, description: str, total: int | None = None, quiet: bool | None = None, **kw):
    """Yield the items of ``iterable``, counting each one done once the loop body has run (see :func:`progress`).

    total: steps (default ``len(iterable)`` when it has one)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    with progress(description, total, quiet=quiet, **kw) as p:
        for item in iterable:
            yield item
            p.advance()
