"""The documentation: the mkdocs site builds with ``--strict``, and the README's examples run as written.

Every fenced code block of README.md is run: ``bash`` / ``sh`` / ``console`` blocks in a shell with this
Python's venv first on PATH, ``python`` blocks with this Python. An HTML comment on the line above a block
says how, when it is not a plain block:

* ``<!-- docs-test: serve -->``: the block starts ``kvkeeper serve``; it runs in the background (its port,
  8000, replaced by a free one) until the last block, after a bounded wait for ``/health``;
* ``<!-- docs-test: uses-server -->``: the block talks to that server at ``127.0.0.1:8000`` (replaced too);
* ``<!-- docs-test: skip (reason) -->``: the block cannot run inside the suite (``make test`` is the suite);
  at most two may be skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.utils.paths import ROOT
from tests.utils.serverproc import free_port

README = ROOT / "README.md"
MKDOCS_YML = ROOT / "mkdocs.yml"
MAX_README_LINES = 300
MAX_README_CHARS = 13_000  # an introduction: results and details live in docs/
MAX_LINE_CHARS = 120
MAX_SKIPS = 2
README_PORT = 8000
SHELL_LANGS = {"bash", "sh", "console"}
PYTHON_LANGS = {"python"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|serve|uses-server)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
HEALTH_TIMEOUT_S = 300
BLOCK_TIMEOUT_S = 600


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    mark: str | None  # None, "skip", "serve" or "uses-server"
    reason: str = ""


def readme_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, each with the docs-test marker on the line above it."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not re.match(r"^```\s*$", lines[j]):
            j += 1
        assert j < len(lines), f"README.md:{start + 1}: code block never closed"
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mk = MARKER.search(prev)
        blocks.append(Block(m.group(1).lower(), "\n".join(lines[start + 1:j]) + "\n", start + 1,
                            mk.group(1) if mk else None, mk.group(2) if mk else ""))
        i = j + 1
    return blocks


def console_commands(code: str) -> str:
    """A console block's commands: its ``$ `` lines without the prompt (all lines when none has one)."""
    cmds = [ln[2:] for ln in code.splitlines() if ln.startswith("$ ")]
    return "\n".join(cmds) + "\n" if cmds else code


def with_port(code: str, port: int) -> str:
    code = re.sub(rf"\b(127\.0\.0\.1|localhost):{README_PORT}\b", rf"\g<1>:{port}", code)
    return re.sub(rf"--port[ =]{README_PORT}\b", f"--port {port}", code)


def example_env() -> dict[str, str]:
    """Our environment with this venv first on PATH and this checkout's sources first on PYTHONPATH, and one torch
    thread (``OMP_NUM_THREADS=1``, which kvkeeper keeps: a program that set fewer threads keeps them) for the
    examples' processes: the server and the examples run beside each other and beside the other xdist worker, and
    two threads each oversubscribe the 2 cores and spin (a CLI run measured 36-39 s of CPU on 2 threads, 10 s on 1,
    under load).  The commands stay as written."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def need_mkdocs() -> None:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed (the docs extra: make setup installs it)")
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=120,
                          cwd=config.parent)


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}; the rest goes to docs/)"
    assert readme_size_problems(README.read_text(encoding="utf-8")) == []


def readme_size_problems(text: str) -> list[str]:
    """What makes a README more than an introduction: over MAX_README_CHARS characters, lines over MAX_LINE_CHARS."""
    out = [f"README.md has {len(text):,} characters (at most {MAX_README_CHARS:,}; results go to docs/benchmarks.md)"
           for _ in [0] if len(text) > MAX_README_CHARS]
    return out + [f"README.md:{i}: {len(line)} characters (at most {MAX_LINE_CHARS})"
                  for i, line in enumerate(text.splitlines(), 1) if len(line) > MAX_LINE_CHARS]


def test_readme_size_check_can_fail():
    assert readme_size_problems("a" * 121 + "\nshort\n") == ["README.md:1: 121 characters (at most 120)"]
    assert len(readme_size_problems(("b" * 100 + "\n") * 200)) == 1  # 20,200 characters


def test_readme_blocks_are_classified():
    """Every block can run or is marked skip; few skips; server blocks come after the serve block."""
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "README.md has no code blocks"
    unrunnable = {b.line for b in blocks if b.lang not in SHELL_LANGS | PYTHON_LANGS}
    skipped = {b.line for b in blocks if b.mark == "skip"}
    assert unrunnable <= skipped, f"blocks of a language the test cannot run must be marked skip: {unrunnable - skipped}"
    assert len(skipped) <= MAX_SKIPS, f"at most {MAX_SKIPS} skipped blocks, found {len(skipped)} (lines {sorted(skipped)})"
    assert all(b.reason.startswith("(") for b in blocks if b.mark == "skip"), "a skip marker gives its reason"
    serve = [b for b in blocks if b.mark == "serve"]
    assert len(serve) <= 1, "one serve block at most"
    for b in blocks:
        if b.mark == "serve":
            assert "kvkeeper serve" in b.code and f"--port {README_PORT}" in b.code, b
            commands = [ln for ln in b.code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
            assert len(commands) == 1, f"README.md:{b.line}: the serve block is one command (it runs as exec)"
        elif b.mark == "uses-server":
            assert serve and serve[0].line < b.line, f"README.md:{b.line}: a uses-server block before the serve block"
            assert f"127.0.0.1:{README_PORT}" in b.code, f"README.md:{b.line}: the server's address is not in the block"
        elif b.mark is None:
            assert f":{README_PORT}" not in b.code, f"README.md:{b.line}: uses a server but is not marked uses-server"


def _headings(page: Path) -> set[str]:
    from markdown.extensions.toc import slugify

    out, fence = set(), False
    for ln in page.read_text(encoding="utf-8").splitlines():
        if ln.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", ln):
            out.add(slugify(ln.lstrip("#").strip().replace("`", ""), "-"))
    return out


def test_readme_links_resolve():
    """The README's relative links name files of the repository (and, into docs/, headings that exist)."""
    need_mkdocs()
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert anchor in _headings(target), f"README.md links to {link}: no such heading in {path}"


def test_docs_build_strict(tmp_path):
    need_mkdocs()
    r = mkdocs_build(MKDOCS_YML, tmp_path / "site")
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr}\n{r.stdout}"
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "architecture" / "index.html").exists()
    # docs/_hooks/results.py: a plot linked where it lies in the repository is in the site, and the page reaches it
    plot = "benchmarks/results/cluster_sim/cluster_sim-targets-2026-12-02-hit_rate.png"
    assert (tmp_path / "site" / plot).read_bytes() == (ROOT / plot).read_bytes()
    assert f'src="../../{plot}"' in (tmp_path / "site" / "serving" / "cluster" / "index.html").read_text()


def test_docs_build_fails_on_a_missing_result(tmp_path):
    """A page's link to a file of benchmarks/results/ that does not exist fails the strict build, naming it."""
    need_mkdocs()
    shutil.copy(MKDOCS_YML, tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    plots = Path("benchmarks") / "results" / "cluster_sim"
    shutil.copytree(ROOT / plots, tmp_path / plots)
    page, bad = tmp_path / "docs" / "serving" / "cluster.md", "![gone](../../benchmarks/results/cluster_sim/no-such.png)"
    text = page.read_text(encoding="utf-8")
    page.write_text(text + "\n" + bad + "\n", encoding="utf-8")
    r = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0, f"a link to a missing result built:\n{r.stderr}"
    assert "no-such.png" in r.stderr + r.stdout
    page.write_text(text, encoding="utf-8")
    r = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, f"the copy without the bad link did not build:\n{r.stderr}"


def test_docs_build_fails_on_a_broken_link(tmp_path):
    """The check can fail: a copy of the docs with one link to a missing page does not build."""
    need_mkdocs()
    shutil.copy(MKDOCS_YML, tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text(encoding="utf-8") + "\nSee [the missing page](no-such-page.md).\n",
                     encoding="utf-8")
    r = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0, f"a broken link built:\n{r.stderr}"
    assert "no-such-page.md" in r.stderr + r.stdout


def _run_block(b: Block, port: int, env: dict, tmp: Path) -> None:
    code = with_port(b.code, port)
    if b.lang in PYTHON_LANGS:
        script = tmp / f"readme_block_{b.line}.py"
        script.write_text(code, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", console_commands(code) if b.lang == "console" else code]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert r.returncode == 0, (f"README.md:{b.line} ({b.lang}) exited with {r.returncode}:\n{code}\n"
                               f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")


def _start_server(b: Block, port: int, env: dict, log_path: Path) -> subprocess.Popen:
    """Run the serve block in its own process group and wait (bounded) until /health answers 200."""
    import httpx

    log = open(log_path, "w")
    proc = subprocess.Popen(["bash", "-c", "exec " + with_port(b.code, port).strip()], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    with httpx.Client(timeout=2) as http:  # one client: httpx.get builds one (and its SSL context) per poll
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"README.md:{b.line}: the server exited with {proc.returncode}:\n"
                                     f"{log_path.read_text()}")
            try:
                if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                _stop(proc)
                raise AssertionError(f"the server did not become healthy in {HEALTH_TIMEOUT_S} s:\n"
                                     f"{log_path.read_text()}")
            time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_readme_examples_run(tmp_path):
    """Every README block not marked skip runs and exits 0; the skipped ones are exactly the marked ones."""
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    env = example_env()
    port = free_port()
    log_path = tmp_path / "serve.log"
    server = None
    ran, skipped = [], []
    try:
        for b in blocks:
            if b.mark == "skip":
                skipped.append(b.line)
            elif b.mark == "serve":
                server = _start_server(b, port, env, log_path)
                ran.append(b.line)
            else:
                if b.mark == "uses-server":
                    assert server is not None and server.poll() is None, f"README.md:{b.line}: no server running"
                _run_block(b, port, env, tmp_path)
                ran.append(b.line)
    finally:
        if server is not None:
            _stop(server)
    assert skipped == [b.line for b in blocks if b.mark == "skip"] and len(skipped) <= MAX_SKIPS
    assert sorted(ran + skipped) == [b.line for b in blocks]
    if server is not None:
        out = log_path.read_text()
        assert "Traceback" not in out, out
