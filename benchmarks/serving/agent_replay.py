#!/usr/bin/env python
"""Agent-session replay (issue 45's Measure): coding-agent sessions against ``kvkeeper serve`` and llama.cpp's own
``llama-server`` on the same GGUF file, one server after the other, in one run.

The workload is deterministic for a seed and a checkout (its texts are this repository's docs and sources):

* a stable system-plus-tools prefix of ``--prefix-tokens`` tokens (an agent's instructions, the JSON schemas of its
  tools, the project's docs), followed by a short environment section of its own for each parent session;
* ``--sessions`` concurrent sessions, ``--subagents`` of them subagents: a subagent sends its parent's whole system
  prompt (so it shares the parent's prefix) with a task of its own, and starts once its parent's first turn is
  answered;
* ``--turns`` requests per session: the first sends the task; each later one appends the previous reply and a tool
  output (a file of the repository, ``--tool-tokens MIN MAX`` tokens, as a user message ``<tool_result>``) and asks
  for the next reply (``--reply-tokens MIN MAX`` tokens, greedy; on the chat API ``ignore_eos`` so that both
  servers generate the same number of tokens).  The whole conversation is resent every turn, as a stateless client
  does; when it would pass ``--ctx`` the oldest tool results are cleared (a placeholder instead), as agents' context
  management does (counted as ``cleared`` in the report: each one changes the prompt after the prefix).

Every request is streamed through ``--api chat`` (``/v1/chat/completions``) or ``--api messages`` (``/v1/messages``,
``cache_control`` on the system prompt and on the last user block), the same API for both servers.  kvkeeper also gets
the session header an agent sends (``X-Session-ID`` on the chat API, ``X-Claude-Code-Session-Id`` on the Messages
API; ``--no-session-header`` leaves it out; llama-server ignores it).  llama-server runs with its prompt cache,
``--cache-reuse``, ``--cache-ram``, one slot per session (``-np``, unified KV) and the same threads and per-session
context; kvkeeper with ``--max-model-len`` = ``--ctx``.

Measured per server: TTFT (request sent to first content token, streamed) per turn p50 / p99, of turn 1 and of later
turns; prompt tokens per turn and those computed (not read from a cache: usage's ``prompt_tokens - cached_tokens``,
or Anthropic's ``input_tokens + cache_creation_input_tokens``; llama-server's ``timings.prompt_n`` kept beside), and
the server's own counters (``/metrics``) over the run; each session's wall time and the run's; output tokens;
start-up time (spawn to healthy); peak RSS of the server's whole process tree (sampled every 0.1 s); the load
average before and after; the CPU model.  Ratios are kvkeeper / llama-server (below 1: kvkeeper faster or smaller).

    python benchmarks/serving/agent_replay.py [--model ID_OR_GGUF] [--api chat|messages] [--prefix-tokens 12000]
        [--turns 30] [--sessions 4] [--subagents 2] [--llama-server BIN] [--label LABEL] [--out DIR]

``make bench-peers`` builds llama-server and runs the full form.  Writes
``OUT/agent_replay-<model>-<api>[-<label>]-<date>.json`` and ``.md`` and prints the markdown.  Timings are only
meaningful on a quiet machine: the report records the load average and says when it was not quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(HERE))
from common import cpu_model, result_name, results_dir, write_report  # noqa: E402
from serve_bench import Server, fmt, pct, stream_chat  # noqa: E402

BENCH = "agent_replay"
PEERS_DIR = Path(os.environ.get("KVKEEPER_PEERS_DIR", Path.home() / ".cache" / "kvkeeper" / "peers"))
LLAMA_SERVER = PEERS_DIR / "llama-server-0.3.36" / "bin" / "llama-server"
TARGETS = {"later_ttft_p50": 0.5, "session_time": 0.7}  # issue 45: kvkeeper / llama-server at most
CLEARED = "[tool result cleared to save context]"
TOOLS = ["Read", "Edit", "Write", "Bash", "Grep", "Glob", "TodoWrite", "WebFetch", "Task", "NotebookEdit",
         "ListDir", "Diff"]
MSG_OVERHEAD = 8  # template tokens per message, in the client's context estimate


# ---- the workload ------------------------------------------------------------------------


class Texts:
    """The repository's docs and sources as tool outputs, and the model's tokenizer to size them (tokens)."""

    def __init__(self, gguf: str):
        from kvkeeper.text.tokenizer import load_tokenizer

        self.tok = load_tokenizer(gguf, lazy=True)
        files = sorted([*ROOT.glob("docs/**/*.md"), *ROOT.glob("src/kvkeeper/**/*.py")])
        self.files = [(str(p.relative_to(ROOT)), p.read_text(errors="replace")) for p in files if p.stat().st_size > 2000]

    def ntok(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def cut(self, text: str, n: int) -> str:
        """The first ``n`` tokens of ``text`` as text (about ``n`` tokens when encoded again)."""
        return self.tok.decode(self.tok.encode(text, add_special_tokens=False)[:n])

    def fill(self, n: int, rng: random.Random, header: str = "") -> str:
        """``header`` and files of the repository, cut to ``n`` tokens in all (``header`` alone, cut, when it is
        longer)."""
        if self.ntok(header) >= n:
            return self.cut(header, n)
        parts, need = [header], n - self.ntok(header)
        while need > 0:
            path, text = self.files[rng.randrange(len(self.files))]
            piece = self.cut(f"\n=== {path} ===\n{text}", need)
            parts.append(piece)
            need -= self.ntok(piece)
        return "".join(parts)


def tool_schemas() -> str:
    schemas = [{"type": "function", "function": {
        "name": name, "description": f"{name}: a tool of the coding agent; see the instructions above for when to use it.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "an absolute path inside the working directory"},
            "content": {"type": "string", "description": "the text to write, search for or run"},
            "limit": {"type": "integer", "description": "the most lines to return"}}, "required": ["path"]}}}
        for name in TOOLS]
    return json.dumps(schemas)


def build_sessions(texts: Texts, a) -> list[dict]:
    """The sessions' plans: system prompt, task, per-turn tool outputs and reply lengths (tokens).

    Sessions ``0 .. parents-1`` are parents with their own environment section; subagent ``j`` belongs to parent
    ``j % parents`` and sends that parent's system prompt.  Deterministic for ``a.seed`` and the checkout."""
    rng = random.Random(a.seed)
    head = ("You are an interactive coding agent working in a software repository. Use the tools below to read and "
            "change files, run commands and search the code; answer briefly; never invent file contents.\n\n"
            f"# Tools\n{tool_schemas()}\n\n# Project instructions\n")
    stable = texts.fill(a.prefix_tokens, random.Random(a.seed + 1), head)
    parents = a.sessions - a.subagents
    systems = [f"{stable}\n\n# Environment\nWorking directory: /home/dev/project-{p}\nPlatform: linux\n"
               f"Session: {p}\n" for p in range(parents)]
    plans = []
    for s in range(a.sessions):
        parent = s if s < parents else (s - parents) % parents
        tools = [texts.fill(rng.randint(*a.tool_tokens), rng, "<tool_result>\n") + "\n</tool_result>"
                 for _ in range(a.turns - 1)]
        plans.append({"session": s, "parent": None if s < parents else parent, "system": systems[parent],
                      "task": f"Task {s}: read the files that implement the feature named in the instructions, "
                              f"explain the change you would make and make it.",
                      "tools": tools, "replies": [rng.randint(*a.reply_tokens) for _ in range(a.turns)]})
    return plans


def workload_digest(plans: list[dict]) -> str:
    h = hashlib.sha256()
    for p in plans:
        h.update(json.dumps([p["system"], p["task"], p["tools"], p["replies"]]).encode())
    return h.hexdigest()[:16]


def fit_context(messages: list[dict], sizes: list[int], budget: int, low: float = 0.7) -> int:
    """When the estimated prompt passes ``budget`` tokens, clear the oldest tool results (from message 2 on) until it
    is at most ``low * budget``, in one go as agents' context editing does (so the cache misses once, not every
    turn); returns how many were cleared.  ``sizes``: each message's estimated tokens, updated in place."""
    if sum(sizes) <= budget:
        return 0
    cleared = 0
    for i in range(2, len(messages)):
        if sum(sizes) <= low * budget:
            break
        if messages[i]["role"] == "user" and messages[i]["content"].startswith("<tool_result>"):
            messages[i] = {"role": "user", "content": CLEARED}
            sizes[i] = MSG_OVERHEAD + 12
            cleared += 1
    return cleared


# ---- the clients -------------------------------------------------------------------------


async def stream_messages(http: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> dict:
    """POST a streamed Anthropic message and time it: the same record as ``serve_bench.stream_chat`` (status, ttft_s,
    end_s, chunks, text, error), with usage in Anthropic's fields (the last value of each seen in ``message_start``
    and ``message_delta``)."""
    body = {**body, "stream": True}
    t0 = time.perf_counter()
    rec = {"ttft_s": None, "end_s": None, "chunks": 0, "text": "", "usage": {}, "timings": None, "status": None}
    async with http.stream("POST", url, json=body, headers=headers) as r:
        rec["status"] = r.status_code
        if r.status_code != 200:
            rec["error"] = (await r.aread()).decode(errors="replace")[:300]
            return rec
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:].strip())
            usage = (ev.get("message") or {}).get("usage") if ev.get("type") == "message_start" else ev.get("usage")
            rec["usage"].update({k: v for k, v in (usage or {}).items() if v is not None})
            delta = ev.get("delta") or {}
            if ev.get("type") == "content_block_delta" and delta.get("type") == "text_delta" and delta.get("text"):
                if rec["ttft_s"] is None:
                    rec["ttft_s"] = time.perf_counter() - t0
                rec["chunks"] += 1
                rec["text"] += delta["text"]
    rec["end_s"] = time.perf_counter() - t0
    return rec


def token_counts(rec: dict, api: str) -> dict:
    """prompt, cached and computed tokens of one request from its usage (None where the server gave none)."""
    u = rec.get("usage") or {}
    if api == "messages":
        read, write, new = u.get("cache_read_input_tokens"), u.get("cache_creation_input_tokens") or 0, u.get("input_tokens")
        prompt = None if new is None else new + write + (read or 0)
        return {"prompt": prompt, "cached": read, "computed": None if new is None else new + write,
                "output": u.get("output_tokens")}
    prompt = u.get("prompt_tokens")
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    computed = prompt - cached if prompt is not None and cached is not None else None
    return {"prompt": prompt, "cached": cached, "computed": computed, "output": u.get("completion_tokens")}


async def one_request(http, srv: Server, a, messages: list[dict], max_tokens: int, sid: str) -> dict:
    if a.api == "chat":
        body = {"model": srv.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        headers = {"X-Session-ID": sid} if a.session_header else None
        return await stream_chat(http, srv.base + "/v1/chat/completions", body, headers)
    system = [{"type": "text", "text": messages[0]["content"], "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages[1:]]
    msgs[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    body = {"model": srv.model, "system": system, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
    headers = {"anthropic-version": "2023-06-01", **({"X-Claude-Code-Session-Id": sid} if a.session_header else {})}
    return await stream_messages(http, srv.base + "/v1/messages", body, headers)


async def run_session(http, srv: Server, a, plan: dict, texts: Texts, started: dict[int, asyncio.Event]) -> dict:
    """One session's turns in order; a subagent first waits for its parent's first answer.  Returns its records
    (turn, ttft_s, end_s, tokens, status, cleared) and its wall time (s)."""
    if plan["parent"] is not None:
        await started[plan["parent"]].wait()
    sid = f"agent-{plan['session']}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": plan["system"]}, {"role": "user", "content": plan["task"]}]
    sizes = [texts.ntok(m["content"]) + MSG_OVERHEAD for m in messages]
    recs, t0 = [], time.perf_counter()
    for turn in range(a.turns):
        if turn:
            messages.append({"role": "user", "content": plan["tools"][turn - 1]})
            sizes.append(texts.ntok(messages[-1]["content"]) + MSG_OVERHEAD)
        cleared = fit_context(messages, sizes, int(0.95 * a.ctx) - plan["replies"][turn])
        rec = await one_request(http, srv, a, messages, plan["replies"][turn], sid)
        recs.append({"turn": turn + 1, "status": rec["status"], "ttft_s": rec["ttft_s"], "end_s": rec["end_s"],
                     "cleared": cleared, "error": rec.get("error"), "timings": rec.get("timings"),
                     **token_counts(rec, a.api)})
        if turn == 0 and plan["parent"] is None:
            started[plan["session"]].set()
        if rec["status"] != 200:
            break
        messages.append({"role": "assistant", "content": rec["text"] or "(no reply)"})  # no empty text blocks
        sizes.append(texts.ntok(messages[-1]["content"]) + MSG_OVERHEAD)
    started.setdefault(plan["session"], asyncio.Event()).set()  # a failed parent releases its subagents
    return {"session": plan["session"], "parent": plan["parent"], "wall_s": time.perf_counter() - t0, "turns": recs}


async def run_workload(srv: Server, a, plans: list[dict], texts: Texts) -> tuple[list[dict], float]:
    started = {p["session"]: asyncio.Event() for p in plans}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=httpx.Limits(max_connections=len(plans) + 4)) as http:
        sessions = await asyncio.gather(*(run_session(http, srv, a, p, texts, started) for p in plans))
    return sessions, time.perf_counter() - t0


# ---- the servers -------------------------------------------------------------------------


class TreeRSS:
    """Samples the summed RSS (bytes, from /proc) of a process and all its descendants every ``every`` s, on a
    thread; ``stop()`` returns the peak."""

    def __init__(self, pid: int, every: float = 0.1):
        self.root, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
        return kids

    def sample(self) -> int:
        kids, todo, total = self._children(), [self.root], 0
        while todo:
            pid = todo.pop()
            todo += kids.get(pid, [])
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except (OSError, ValueError):
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def server_counters(base: str, kind: str) -> dict | None:
    """The server's own prompt-token counters from ``/metrics``: computed and cached (tokens), or None."""
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    vals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        vals[name.split("{")[0]] = vals.get(name.split("{")[0], 0.0) + float(value)
    if kind == "llama-server":
        got = vals.get("llamacpp:prompt_tokens_total"), vals.get("llamacpp:prompt_tokens_cached_total")
        return None if None in got else {"computed": got[0], "cached": got[1]}
    total, cached = vals.get("kvkeeper:prompt_tokens_total"), vals.get("kvkeeper:prompt_tokens_cached_total")
    return None if total is None or cached is None else {"computed": total - cached, "cached": cached}


def server_specs(a, gguf: str) -> list[tuple[str, list[str], dict]]:
    threads = str(a.threads)
    kvk = [sys.executable, "-m", "kvkeeper.cli", "serve", "--model", gguf, "--port", "{port}", "--threads", threads,
           "--max-model-len", str(a.ctx), "--max-num-seqs", str(max(a.sessions, 1)), *a.kvkeeper_args]
    if a.kv_cache_bytes:
        kvk += ["--kv-cache-bytes", a.kv_cache_bytes]
    llama = [a.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", threads, "-tb", threads,
             "-np", str(a.sessions), "--kv-unified", "-c", str(a.ctx * a.sessions), "--cache-reuse", str(a.cache_reuse),
             "--cache-ram", str(a.cache_ram_mib), "--metrics", "--jinja", *a.llama_args]
    specs = {"kvkeeper": ("kvkeeper", kvk, {}), "llama-server": ("llama-server", llama, {})}
    return [specs[name] for name in a.servers]


def run_server(name: str, cmd: list[str], env: dict, a, plans: list[dict], texts: Texts, out: Path) -> dict:
    """Start one server, warm it up with an unrelated request, replay the sessions, stop it; its summary."""
    t0 = time.perf_counter()
    srv = Server(name, cmd, None, out / f"{BENCH}_{name}.log", env, "/health")
    startup = time.perf_counter() - t0
    rss = TreeRSS(srv.proc.pid)
    try:
        warm = [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Say hi."}]

        async def warm_up():
            async with httpx.AsyncClient(timeout=600) as http:
                return await one_request(http, srv, a, warm, 4, "warm-up")

        w = asyncio.run(warm_up())
        if w["status"] != 200:
            raise RuntimeError(f"{name}: warm-up answered {w['status']}: {w.get('error')}")
        before, load0 = server_counters(srv.base, name), os.getloadavg()
        sessions, wall = asyncio.run(run_workload(srv, a, plans, texts))
        load1, after = os.getloadavg(), server_counters(srv.base, name)
    finally:
        peak = rss.stop()
        srv.stop()
    counters = ({k: after[k] - before[k] for k in after} if before and after else None)
    return summarize(name, sessions, wall, startup, peak, load0, load1, counters)


# ---- the report --------------------------------------------------------------------------


def summarize(name, sessions, wall, startup, peak, load0, load1, counters) -> dict:
    recs = [r for s in sessions for r in s["turns"]]
    ok = [r for r in recs if r["status"] == 200 and r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in ok if r["turn"] > 1]
    by_turn = []
    for t in sorted({r["turn"] for r in ok}):
        rt = [r for r in ok if r["turn"] == t]
        by_turn.append({"turn": t, "n": len(rt), "ttft_p50_s": pct([r["ttft_s"] for r in rt], 0.5),
                        "ttft_p99_s": pct([r["ttft_s"] for r in rt], 0.99),
                        "prompt_tokens_mean": _mean([r["prompt"] for r in rt]),
                        "computed_tokens_mean": _mean([r["computed"] for r in rt])})
    computed = [r["computed"] for r in ok]
    return {
        "server": name, "requests": len(recs), "ok": len(ok),
        "errors": [r["error"] for r in recs if r["status"] != 200][:3],
        "startup_s": startup, "peak_rss_mb": peak / 1e6, "loadavg_before": load0, "loadavg_after": load1,
        "run_wall_s": wall, "session_wall_s": [s["wall_s"] for s in sessions],
        "session_wall_mean_s": _mean([s["wall_s"] for s in sessions]),
        "ttft_turn1_p50_s": pct([r["ttft_s"] for r in ok if r["turn"] == 1], 0.5),
        "ttft_later_p50_s": pct(later, 0.5), "ttft_later_p99_s": pct(later, 0.99),
        "prompt_tokens_total": _sum([r["prompt"] for r in ok]), "computed_tokens_total": _sum(computed),
        "computed_tokens_later_mean": _mean([r["computed"] for r in ok if r["turn"] > 1]),
        "output_tokens_total": _sum([r["output"] for r in ok]),
        "cleared_tool_results": sum(r["cleared"] for r in recs),
        "server_counters": counters, "by_turn": by_turn, "sessions": sessions,
    }


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def _sum(xs):
    return None if any(x is None for x in xs) else sum(xs)


def ratios(servers: list[dict]) -> dict:
    k = next((s for s in servers if s["server"] == "kvkeeper"), None)
    p = next((s for s in servers if s["server"] == "llama-server"), None)
    if not k or not p:
        return {}

    def r(key):
        return k[key] / p[key] if k.get(key) is not None and p.get(key) else None

    return {key: r(key) for key in ("ttft_turn1_p50_s", "ttft_later_p50_s", "ttft_later_p99_s", "run_wall_s",
                                    "session_wall_mean_s", "computed_tokens_total", "peak_rss_mb", "startup_s")}


def markdown(res: dict) -> str:
    w = res["workload"]
    quiet = max([res["loadavg_start"][0], *(s["loadavg_before"][0] for s in res["servers"])])
    lines = [f"# Agent-session replay{' (' + res['label'] + ')' if res['label'] else ''} ({res['date']})", "",
             f"{res['machine']}; model `{res['model']}`; API `{res['api']}`; {w['sessions']} sessions "
             f"({w['subagents']} subagents sharing a parent's prefix) x {w['turns']} turns; prefix {w['prefix_tokens']} "
             f"tokens; tool outputs {w['tool_tokens']} tokens; replies {w['reply_tokens']} tokens; context {w['ctx']}; "
             f"{res['threads']} threads; workload digest `{w['digest']}`.", ""]
    if quiet > 0.5 * (os.cpu_count() or 1):
        lines += [f"**Not a quiet machine** (1-min load average up to {quiet:.1f} before the runs, on "
                  f"{os.cpu_count()} CPUs): these timings are not a speed claim.", ""]
    lines += ["| server | TTFT turn 1 p50 | later TTFT p50 | later TTFT p99 | run wall | session mean | computed / "
              "prompt tokens | output tokens | peak RSS | start-up | load before -> after | ok |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in res["servers"]:
        lines.append(f"| {s['server']} | {fmt(s['ttft_turn1_p50_s'], 'ms')} | {fmt(s['ttft_later_p50_s'], 'ms')} "
                     f"| {fmt(s['ttft_later_p99_s'], 'ms')} | {s['run_wall_s']:.1f} s | {fmt(s['session_wall_mean_s'])} s "
                     f"| {s['computed_tokens_total']} / {s['prompt_tokens_total']} | {s['output_tokens_total']} "
                     f"| {s['peak_rss_mb']:.0f} MB | {s['startup_s']:.1f} s "
                     f"| {s['loadavg_before'][0]:.2f} -> {s['loadavg_after'][0]:.2f} | {s['ok']}/{s['requests']} |")
    if res["ratios"]:
        q = res["ratios"]
        lines += ["", "kvkeeper / llama-server (issue 45's targets: later-turn TTFT p50 <= "
                  f"{TARGETS['later_ttft_p50']}x, total session time <= {TARGETS['session_time']}x):", "",
                  "| TTFT turn 1 p50 | later TTFT p50 | later TTFT p99 | run wall | session mean | computed tokens "
                  "| peak RSS | start-up |", "|---|---|---|---|---|---|---|---|",
                  "| " + " | ".join(f"{fmt(q[k])}x" for k in ("ttft_turn1_p50_s", "ttft_later_p50_s", "ttft_later_p99_s",
                                                           "run_wall_s", "session_wall_mean_s", "computed_tokens_total",
                                                           "peak_rss_mb", "startup_s")) + " |"]
    lines += ["", "TTFT p50 and mean computed prompt tokens by turn:", "",
              "| turn | " + " | ".join(s["server"] for s in res["servers"]) + " |",
              "|---|" + "---|" * len(res["servers"])]
    turns = sorted({t["turn"] for s in res["servers"] for t in s["by_turn"]})
    for t in turns:
        cells = []
        for s in res["servers"]:
            bt = next((x for x in s["by_turn"] if x["turn"] == t), None)
            cells.append("n/a" if bt is None else f"{fmt(bt['ttft_p50_s'], 'ms')} ({fmt(bt['computed_tokens_mean'], nd=4)})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines += ["", f"Command: `{res['command']}`"] + [f"* {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m", help="a model id of kvkeeper's registry or a GGUF path")
    ap.add_argument("--api", choices=["chat", "messages"], default="chat")
    ap.add_argument("--prefix-tokens", type=int, default=12000)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--subagents", type=int, default=2)
    ap.add_argument("--tool-tokens", type=int, nargs=2, default=[300, 2000], metavar=("MIN", "MAX"))
    ap.add_argument("--reply-tokens", type=int, nargs=2, default=[50, 200], metavar=("MIN", "MAX"))
    ap.add_argument("--ctx", type=int, default=32768, help="context per session (tokens), both servers")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--servers", nargs="+", choices=["kvkeeper", "llama-server"], default=["kvkeeper", "llama-server"])
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER), help="the llama-server binary (make bench-peers)")
    ap.add_argument("--cache-reuse", type=int, default=256, help="llama-server --cache-reuse (tokens)")
    ap.add_argument("--cache-ram-mib", type=int, default=8192, help="llama-server --cache-ram (MiB)")
    ap.add_argument("--kv-cache-bytes", default=None, help="kvkeeper --kv-cache-bytes (default: kvkeeper's)")
    ap.add_argument("--kvkeeper-args", nargs="*", default=[], help="more `kvkeeper serve` options")
    ap.add_argument("--llama-args", nargs="*", default=[], help="more llama-server options")
    ap.add_argument("--no-session-header", dest="session_header", action="store_false")
    ap.add_argument("--label", default="", help="added to the result's name and title (e.g. smoke-loaded)")
    ap.add_argument("--out", default=str(results_dir(BENCH)))
    a = ap.parse_args(argv)
    if not 0 <= a.subagents < a.sessions:
        ap.error("--subagents must be at least 0 and less than --sessions")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from kvkeeper.weights.sources import resolve_model_path

    gguf = str(resolve_model_path(a.model))
    if "llama-server" in a.servers and not Path(a.llama_server).is_file():
        sys.exit(f"no llama-server at {a.llama_server}: build it with benchmarks/peers/build_llama_server.sh")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    texts = Texts(gguf)
    plans = build_sessions(texts, a)
    notes, servers = [], []
    for name, cmd, env in server_specs(a, gguf):
        print(f"{name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            servers.append(run_server(name, cmd, env, a, plans, texts, out))
        except (RuntimeError, httpx.HTTPError) as e:
            notes.append(f"{name}: not measured ({type(e).__name__}: {e})")
            print(notes[-1], file=sys.stderr, flush=True)
            continue
        print(json.dumps({k: v for k, v in servers[-1].items() if k not in ("sessions", "by_turn")}), flush=True)
    if "llama-server" in a.servers:
        ver = subprocess.run([a.llama_server, "--version"], capture_output=True, text=True, timeout=60)
        notes.append("llama-server " + " ".join((ver.stdout + ver.stderr).split()[-12:]))
    model = a.model if a.model in ("gemma-3-270m", "smollm2-135m-instruct") else Path(gguf).stem
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "label": a.label, "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
           "loadavg_start": load_start, "model": model, "gguf": gguf, "api": a.api, "threads": a.threads, "session_header": a.session_header,
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "workload": {"prefix_tokens": a.prefix_tokens, "turns": a.turns, "sessions": a.sessions,
                        "subagents": a.subagents, "tool_tokens": a.tool_tokens, "reply_tokens": a.reply_tokens,
                        "ctx": a.ctx, "seed": a.seed, "digest": workload_digest(plans)},
           "servers": servers, "ratios": ratios(servers), "notes": notes}
    config = "-".join(x for x in (model, a.api, a.label) if x)
    write_report(out, result_name(BENCH, config), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
