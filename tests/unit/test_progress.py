"""kvkeeper.progress: plain lines off a terminal, a rich bar on one, silence outside `reporting()`."""

from __future__ import annotations

import io

from kvkeeper.progress import progress, reporting, track


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal():
    buf = io.StringIO()
    with progress("dequantise x.gguf", total=4, stream=buf, min_interval_s=0, quiet=False) as p:
        for _ in range(4):
            p.advance()
        p.note("a note")
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("dequantise x.gguf: 1/4 (25%)") and "a note" in lines
    assert lines[-2].startswith("dequantise x.gguf: 4/4 (100%)")
    assert sum(" 4/4 " in ln for ln in lines) == 1  # the last count is not repeated on exit


def test_plain_lines_are_rate_limited_but_the_last_is_printed():
    buf = io.StringIO()
    with progress("eval", total=1000, stream=buf, min_interval_s=3600, quiet=False) as p:
        for _ in range(1000):
            p.advance()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("eval: 1/1000") and lines[1].startswith("eval: 1000/1000 (100%)")


def test_rich_bar_on_a_terminal():
    buf = FakeTTY()
    with progress("turns", total=3, stream=buf, quiet=False) as p:
        p.advance(3)
    out = buf.getvalue()
    assert "\x1b[" in out and "turns" in out and "3/3" in out  # rich's live display (ANSI), not plain lines
    assert "turns: 3/3" not in out


def test_library_progress_is_silent_unless_reporting():
    buf = io.StringIO()
    assert list(track(range(3), "pack", stream=buf, min_interval_s=0)) == [0, 1, 2]
    assert buf.getvalue() == ""
    with reporting():
        assert list(track(range(3), "pack", stream=buf, min_interval_s=0)) == [0, 1, 2]
    assert "pack: 3/3 (100%)" in buf.getvalue()
    with reporting():
        buf2 = io.StringIO()
        list(track(range(2), "x", stream=buf2, quiet=True))
        assert buf2.getvalue() == ""
