"""Soak (endurance) test of ``kvkeeper serve``: simulated users for a bounded time, a restart in the middle.

    python benchmarks/serving/soak.py [--minutes 30] [--users 4] [--audit-fraction 0.25] [--out benchmarks/results/soak]
        [--name soak] [--rss-slope-bound 2.0] [--sample-s 5] [--swing-min P] [--burst-every-s S --burst-size N]

The health soak of issue 29 (the default engine and detector, fault-free light traffic with load swings and
bursts, one server life, an hour):

    python benchmarks/serving/soak.py --minutes 60 --users 3 --swing-min 20 --burst-every-s 240 --burst-size 3 \
        --no-restart --kv-cache-bytes default --audit-fraction 0 --max-tokens 16 --think-s 2 --name soak-health-DATE \
        --server-arg=--health-trace --server-arg=/tmp/health.jsonl   # record the samples; then rescore them with
    python benchmarks/health/health_rescore.py --trace /tmp/health.jsonl    # any predictor (the server's code, offline)

Starts a server (a subprocess on a free 127.0.0.1 port, ``--data-dir`` in a temporary folder, the reuse audit on)
and runs ``--users`` simulated users (asyncio; the official ``openai`` client for completions, ``httpx`` for the
session endpoints).  Each user holds multi-turn sessions (``X-Session-ID``), one conversation after another: the
two turns of an MT-Bench question or up to six turns of a Topical-Chat conversation (its first speaker's lines).
Per turn, at random: streaming or not; a streaming request hangs up after two chunks (a tenth of them,
``--hangup-fraction``; the user then asks again, retrying while the server answers 409 because it is still aborting
the turn); the session is offloaded to the host or disk tier afterwards (an eighth of turns, ``--offload-fraction``).
Before a conversation (half the time) a user asks a one-off question with ``n=2``.  A finished conversation's session is deleted, or left
open (a third of them; the oldest left-open ones are deleted later).  Halfway through, the users pause, the server
is stopped (SIGTERM: it saves its sessions to disk) and started again on the same data directory; the sessions open
before must be listed again (restored from disk) and the users carry on with them.

Every ``--sample-s`` seconds it samples the server process (resident memory, open file descriptors, threads, from
``/proc``) and ``/metrics`` (KV blocks by state, prefix-cache hits, audit counters, breaker tier, health score);
each request's TTFT and TPOT (streaming) are measured by the client.  At the end the users stop, every session is
deleted and the server must go idle.

Pass criteria (each reported): no 5xx answer and no transport error; no block owned once idle with no session;
zero reuse-audit mismatches (and at least one audit); every session open at the restart restored; resident memory
flat after warm-up: the slope of a least-squares line over the second half of each server life below
``--rss-slope-bound`` MiB per minute.  The health detector's warnings over the run (fault-free) are reported as its
false alarms, both kinds: the EWMA charts' warnings and the breach forecasts
(``--health-predictor``; "KV cache health forecast: breach in about N s" in the log), each with the TTFT objective
(``--ttft-objective``, 3 s) breached or not by the soak's own requests in the minute after it.

Coverage (``--until-covered S``): a short run on a loaded machine may end before every kind of request has
happened (a one-minute run with three users once made 8 turns and no ``n=2`` request).  With it the restart waits
for a first completed turn, and the load goes on past ``--minutes`` until turns, streams, hang-ups, ``n=2``
requests, offloads and at least one reuse audit have all happened, for at most S more seconds; the report says how
long the load was extended and what was still missing (``coverage``).  Nothing then depends on how fast the
machine is, only how long the run takes.

Load variation (``--swing-min P``): the number of active users follows ``1 + (U - 1) (1 - cos(2 pi t / P)) / 2``,
from one user to ``--users`` and back every P minutes (a daily-style swing, compressed); an inactive user waits
before its next turn.  ``--burst-every-s S``: every S seconds (jittered +-25%) ``--burst-size`` one-off requests
(no session) arrive at once on top of the users.  Writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` (matplotlib, extra ``plots``) under ``--out``;
exit status 0 when every criterion passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import cpu_model  # noqa: E402

MT_BENCH = ROOT / "data" / "mt_bench" / "question.jsonl"
TOPICAL = ROOT / "data" / "topical_chat" / "test_freq_conversations_first20.jsonl"
SYSTEM = "You are a friendly, concise assistant. Answer in one or two sentences."


# ---- data ---------------------------------------------------------------------------------------------
def conversations() -> list[list[str]]:
    """User turns of every conversation: MT-Bench questions (two turns) and Topical-Chat (agent_1, up to six)."""
    out = [json.loads(x)["turns"] for x in MT_BENCH.read_text().splitlines() if x.strip()]
    for line in TOPICAL.read_text().splitlines():
        if line.strip():
            turns = json.loads(line)["turns"]
            first = turns[0]["speaker"]
            out.append([t["text"] for t in turns if t["speaker"] == first][:6])
    return out


# ---- the server -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``kvkeeper serve`` as a subprocess; :meth:`start` waits for /health, :meth:`stop` sends SIGTERM."""

    def __init__(self, data_dir: Path, log_path: Path, extra: list[str]):
        self.data_dir, self.log_path, self.extra = data_dir, log_path, extra
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.lives = 0

    def start(self, timeout_s: float = 600) -> float:
        """Start and wait until healthy; returns the seconds it took."""
        t0 = time.monotonic()
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvkeeper.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--data-dir", str(self.data_dir), "--no-access-log", *self.extra],
            stdout=log, stderr=subprocess.STDOUT, text=True,
            # the KV pool committed at start: otherwise its pages become resident as blocks are first written,
            # a growth the RSS-slope check would read as a leak
            env={**os.environ, "KVKEEPER_KV_PREFAULT": "1"})
        log.close()
        self.lives += 1
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 120) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def proc_sample(pid: int) -> dict:
    """Resident memory (MiB), threads and open file descriptors of a process, from /proc."""
    out = {"rss_mib": None, "threads": None, "fds": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mib"] = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


_SAMPLE = re.compile(r"^(kvkeeper:[a-z0-9_:]+)(\{[^}]*\})? ([-+0-9.eEinfa]+)$")


def read_metrics(base: str) -> dict[str, float]:
    """``kvkeeper:*`` samples of /metrics; labelled ones keyed ``name{labels}``."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def http_client() -> httpx.AsyncClient:
    """A client whose idle connections expire (2 s) before uvicorn closes them (its keep-alive timeout, 5 s): else
    a request sent on a connection the server is closing at that moment fails with a ReadError (seen twice in a
    30-minute run before this)."""
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(keepalive_expiry=2.0))


# ---- users --------------------------------------------------------------------------------------------
class Run:
    """Shared state of the users and the controller."""

    def __init__(self, args, server: Server):
        self.args, self.server = args, server
        self.convs = conversations()
        self.go = asyncio.Event()
        self.go.set()
        self.stop = False
        self.in_flight = 0
        self.requests: list[dict] = []  # one record per completion request
        self.errors: list[str] = []
        self.counts = {"turns": 0, "streamed": 0, "hung_up": 0, "n2": 0, "offloads": 0, "deletes": 0,
                       "conversations": 0, "left_open": 0, "status_5xx": 0, "status_4xx": 0, "transport_errors": 0,
                       "busy_retries": 0, "bursts": 0, "burst_requests": 0}
        self.t0 = time.monotonic()

    def active_users(self) -> int:
        """Users active now: all of them, or the ``--swing-min`` cosine swing between 1 and ``--users``."""
        a = self.args
        if not a.swing_min:
            return a.users
        phase = (time.monotonic() - self.t0) / (60.0 * a.swing_min)
        return 1 + round((a.users - 1) * (1 - math.cos(2 * math.pi * phase)) / 2)

    async def wait_active(self, k: int) -> None:
        """Block user ``k`` while the load swing leaves it inactive (or the users are paused)."""
        while not self.stop and k >= self.active_users():
            await asyncio.sleep(1.0)
        await self.go.wait()

    def client(self):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.server.base + "/v1", api_key="soak", max_retries=0, timeout=600,
                           http_client=http_client())

    def fail(self, what: str, status: int | None) -> None:
        if status is None:
            self.counts["transport_errors"] += 1
        elif status >= 500:
            self.counts["status_5xx"] += 1
        else:
            self.counts["status_4xx"] += 1
        if len(self.errors) < 50:
            self.errors.append(f"{status}: {what}"[:400])


async def _complete(run: Run, oai, messages, sid: str | None, stream: bool, hang_up: bool, n: int,
                    busy_retries: int = 0, burst: bool = False) -> str | None:
    """One chat completion; returns the (first choice's) text, or None when it hung up or failed.

    busy_retries: after a hang-up the server may still be aborting the session's turn and answer 409 (busy); the
    client then asks again after 0.1 s, up to this many times (counted in ``busy_retries``)."""
    import openai

    for _ in range(busy_retries):
        try:
            return await _complete_once(run, oai, messages, sid, stream, hang_up, n, raise_busy=True, burst=burst)
        except openai.ConflictError:
            run.counts["busy_retries"] += 1
            await asyncio.sleep(0.1)
    return await _complete_once(run, oai, messages, sid, stream, hang_up, n, burst=burst)


async def _complete_once(run: Run, oai, messages, sid, stream, hang_up, n, raise_busy: bool = False,
                         burst: bool = False) -> str | None:
    import openai

    a = run.args
    kw = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": a.max_tokens, "temperature": 0.7,
          "seed": random.randrange(1 << 30), "n": n}
    headers = {"X-Session-ID": sid} if sid else None
    rec = {"t": time.time(), "stream": stream, "hang_up": hang_up, "n": n, "session": sid is not None,
           "ttft_s": None, "tpot_s": None, "status": 200, "burst": burst}
    run.in_flight += 1
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await oai.chat.completions.create(**kw, extra_headers=headers)
            rec["e2e_s"] = time.perf_counter() - t0
            return r.choices[0].message.content or ""
        text, chunks, t_first, t_last, ntok = "", 0, None, None, 0
        st = await oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                               extra_headers=headers)
        try:
            async for chunk in st:
                chunks += 1
                for c in chunk.choices:
                    if c.index == 0 and c.delta.content:
                        now = time.perf_counter()
                        t_first = t_first or now
                        t_last, ntok = now, ntok + 1
                        text += c.delta.content
                if hang_up and chunks >= 2:
                    break
        finally:
            await st.close()
        if t_first is not None:
            rec["ttft_s"] = t_first - t0
            if ntok > 1:
                rec["tpot_s"] = (t_last - t_first) / (ntok - 1)
        rec["e2e_s"] = time.perf_counter() - t0
        return None if hang_up else text
    except openai.APIStatusError as e:
        rec["status"] = e.status_code
        if raise_busy and e.status_code == 409:
            raise
        run.fail(f"{e.status_code} {str(e)[:300]}", e.status_code)
    except (openai.APIConnectionError, openai.APITimeoutError, httpx.HTTPError) as e:
        rec["status"] = None
        run.fail(f"{type(e).__name__}: {e}", None)
    finally:
        run.in_flight -= 1
        run.requests.append(rec)
    return None


async def _session_call(run: Run, http: httpx.AsyncClient, method: str, path: str) -> None:
    run.in_flight += 1
    try:
        r = await http.request(method, run.server.base + path)
        if r.status_code >= 400 and r.status_code != 404:
            run.fail(f"{method} {path}: {r.text[:300]}", r.status_code)
    except httpx.HTTPError as e:
        run.fail(f"{method} {path}: {type(e).__name__}: {e}", None)
    finally:
        run.in_flight -= 1


async def _turn(run: Run, oai, http, rng: random.Random, sid: str, history: list[dict], text: str) -> bool:
    """One user turn of a session (asked again after a hang-up); False when the request failed."""
    history.append({"role": "user", "content": text})
    stream = rng.random() < 0.6
    hang = stream and rng.random() < run.args.hangup_fraction
    if hang:
        run.counts["hung_up"] += 1
        await _complete(run, oai, history, sid, True, True, 1)
        await run.go.wait()
    answer = await _complete(run, oai, history, sid, stream, False, 1, busy_retries=50 if hang else 0)
    run.counts["turns"] += 1
    run.counts["streamed"] += stream
    if answer is None:
        history.pop()
        return False
    history.append({"role": "assistant", "content": answer})
    if rng.random() < run.args.offload_fraction:
        run.counts["offloads"] += 1
        await _session_call(run, http, "POST", f"/v1/sessions/{sid}/offload?tier={rng.choice(['host', 'disk'])}")
    return True


async def user(run: Run, k: int) -> None:
    rng = random.Random(run.args.seed * 1000 + k)
    oai = run.client()
    left_open: list[str] = []
    async with http_client() as http:
        j = 0
        while not run.stop:
            if rng.random() < 0.5:
                await run.wait_active(k)
                run.counts["n2"] += 1
                q = rng.choice(run.convs)[0]
                await _complete(run, oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                None, rng.random() < 0.5, False, 2)
            turns = rng.choice(run.convs)
            sid, j = f"soak-u{k}-c{j}", j + 1
            history = [{"role": "system", "content": SYSTEM}]
            for text in turns:
                await run.wait_active(k)
                if run.stop or not await _turn(run, oai, http, rng, sid, history, text):
                    break
                await asyncio.sleep(rng.uniform(0, run.args.think_s))
            run.counts["conversations"] += 1
            await run.go.wait()
            if rng.random() < 1 / 3:
                left_open.append(sid)
                run.counts["left_open"] += 1
            else:
                left_open.insert(0, sid)
            while len(left_open) > (0 if run.stop else 3) or (left_open and left_open[0] == sid):
                run.counts["deletes"] += 1
                await _session_call(run, http, "DELETE", f"/v1/sessions/{left_open.pop(0)}")
        for sid in left_open:
            run.counts["deletes"] += 1
            await _session_call(run, http, "DELETE", f"/v1/sessions/{sid}")
    await oai.close()


async def bursts(run: Run) -> None:
    """Every ``--burst-every-s`` seconds (jittered +-25%), ``--burst-size`` one-off requests at once."""
    a = run.args
    rng = random.Random(a.seed * 1000 + 999)
    oai = run.client()
    while not run.stop:
        wait = a.burst_every_s * rng.uniform(0.75, 1.25)
        end = time.monotonic() + wait
        while not run.stop and time.monotonic() < end:
            await asyncio.sleep(min(1.0, end - time.monotonic()))
        if run.stop:
            break
        await run.go.wait()
        run.counts["bursts"] += 1
        run.counts["burst_requests"] += a.burst_size
        qs = [rng.choice(run.convs)[0] for _ in range(a.burst_size)]
        await asyncio.gather(*(_complete(run, oai, [{"role": "system", "content": SYSTEM}, {"role": "user",
                                                                                          "content": q}],
                                         None, True, False, 1, burst=True) for q in qs))
    await oai.close()


# ---- sampling, restart, the end ---------------------------------------------------------------------------
def sample(run: Run, t0: float) -> dict:
    srv = run.server
    s = {"t_s": round(time.monotonic() - t0, 2), "life": srv.lives, **proc_sample(srv.proc.pid)}
    try:
        m = read_metrics(srv.base)
    except httpx.HTTPError as e:
        s["metrics_error"] = str(e)
        return s
    for st in ("free", "cached", "owned", "offloaded"):
        s[f"blocks_{st}"] = m.get(f'kvkeeper:kv_blocks{{state="{st}"}}')
    q, h = m.get("kvkeeper:prefix_cache_queries_total", 0), m.get("kvkeeper:prefix_cache_hits_total", 0)
    s.update(prefix_queries=q, prefix_hits=h, prefix_hit_rate=h / q if q else None,
             audit_total=m.get("kvkeeper:kv_audit_total"), audit_mismatches=m.get("kvkeeper:kv_audit_mismatch_total"),
             health_score=m.get("kvkeeper:kv_health_score"), health_warnings=m.get("kvkeeper:kv_health_warnings_total"),
             breach_eta_s=m.get("kvkeeper:kv_health_breach_eta_seconds"), active_users=run.active_users(),
             breaker_tier=m.get("kvkeeper:breaker_tier"), breaker_trips=m.get("kvkeeper:breaker_trips_total"),
             sessions_open=m.get("kvkeeper:sessions_open"), pinned_blocks=m.get("kvkeeper:pinned_blocks"),
             running=m.get("kvkeeper:num_requests_running"), waiting=m.get("kvkeeper:num_requests_waiting"),
             requests=len(run.requests), status_5xx=run.counts["status_5xx"])
    return s


async def sampler(run: Run, t0: float, samples: list[dict]) -> None:
    while not run.stop:
        if run.go.is_set():
            samples.append(await asyncio.to_thread(sample, run, t0))
        await asyncio.sleep(run.args.sample_s)


def life_end(run: Run) -> dict:
    """What a server life leaves to the report: audit counters, health detector state, breaker trips."""
    base = run.server.base
    m = read_metrics(base)
    h = httpx.get(base + "/admin/health", timeout=30).json()
    return {"audit_total": m.get("kvkeeper:kv_audit_total", 0),
            "audit_mismatches": m.get("kvkeeper:kv_audit_mismatch_total", 0),
            "breaker_trips": m.get("kvkeeper:breaker_trips_total", 0),
            "health_samples": h.get("samples", 0), "health_warnings": h.get("warnings", 0),
            "health_forecasts": h.get("forecasts", 0), "health_predictor": h.get("predictor"),
            "health_events": h.get("events", []), "sessions": [s["id"] for s in httpx.get(
                base + "/v1/sessions", timeout=30).json()["data"]]}


async def _quiesce(run: Run, timeout_s: float = 300) -> None:
    run.go.clear()
    deadline = time.monotonic() + timeout_s
    while run.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def restart(run: Run, t0: float) -> dict:
    """Pause the users, stop the server (it saves its sessions), start it again, compare the session lists."""
    await _quiesce(run)
    t = time.monotonic() - t0
    before = await asyncio.to_thread(life_end, run)
    rc = await asyncio.to_thread(run.server.stop)
    start_s = await asyncio.to_thread(run.server.start)
    after = httpx.get(run.server.base + "/v1/sessions", timeout=30).json()["data"]
    ids = {s["id"] for s in after}
    run.go.set()
    return {"at_s": round(t, 1), "exit_code": rc, "start_s": round(start_s, 1), "open_before": len(before["sessions"]),
            "restored": sum(1 for s in before["sessions"] if s in ids),
            "missing": [s for s in before["sessions"] if s not in ids],
            "tiers_after": sorted({s["tier"] for s in after}), "life1": before}


async def drain(run: Run, tasks) -> dict:
    """Stop the users (they delete their sessions), delete leftovers, wait until the server is idle."""
    run.stop = True
    await asyncio.wait(tasks, timeout=600)
    base = run.server.base
    async with httpx.AsyncClient(timeout=120) as http:
        left = (await http.get(base + "/v1/sessions")).json()["data"]
        for s in left:
            await http.delete(f"{base}/v1/sessions/{s['id']}")
    deadline = time.monotonic() + 60
    while True:
        m = await asyncio.to_thread(read_metrics, base)
        idle = (m["kvkeeper:num_requests_running"] == 0 and m["kvkeeper:num_requests_waiting"] == 0
                and m['kvkeeper:kv_blocks{state="owned"}'] == 0)
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return {"leftover_sessions_deleted": len(left), "owned_blocks_idle": m['kvkeeper:kv_blocks{state="owned"}'],
            "pinned_blocks_idle": m["kvkeeper:pinned_blocks"], "sessions_open_idle": m["kvkeeper:sessions_open"],
            "running_idle": m["kvkeeper:num_requests_running"], "waiting_idle": m["kvkeeper:num_requests_waiting"]}


# ---- analysis ---------------------------------------------------------------------------------------------
def slope_mib_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute (None under 3 points)."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return 60.0 * sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else None


def rss_slopes(samples: list[dict]) -> list[dict]:
    """Per server life: the slope of RSS over the second half of its samples (time-wise)."""
    out = []
    for life in sorted({s["life"] for s in samples}):
        pts = [(s["t_s"], s["rss_mib"]) for s in samples if s["life"] == life and s.get("rss_mib") is not None]
        if not pts:
            continue
        mid = (pts[0][0] + pts[-1][0]) / 2
        half = [p for p in pts if p[0] >= mid]
        out.append({"life": life, "from_s": half[0][0] if half else None, "to_s": pts[-1][0], "points": len(half),
                    "rss_start_mib": round(pts[0][1], 1), "rss_end_mib": round(pts[-1][1], 1),
                    "slope_mib_per_min": slope_mib_per_min(half)})
    return out


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def verdict(res: dict, bound: float) -> dict:
    c = res["counts"]
    lives = [res["restart"]["life1"], res["life2"]] if res.get("restart") else [res["life2"]]
    audits = sum(x["audit_total"] for x in lives)
    mism = sum(x["audit_mismatches"] for x in lives)
    idle = res["idle"]
    slopes = [s["slope_mib_per_min"] for s in res["rss"] if s["slope_mib_per_min"] is not None]
    checks = {
        "no_5xx": c["status_5xx"] == 0 and c["transport_errors"] == 0,
        "no_leaked_blocks_idle": idle["owned_blocks_idle"] == 0 and idle["pinned_blocks_idle"] == 0
        and idle["sessions_open_idle"] == 0,
        "zero_audit_mismatches": mism == 0 and (audits > 0 or res.get("audit_fraction") == 0),
        "sessions_restored": res.get("restart") is None or not res["restart"]["missing"],
        "rss_flat": bool(slopes) and all(s < bound for s in slopes),
        "covered": not (res.get("coverage") or {}).get("missing"),
    }
    return {"checks": checks, "audits": audits, "audit_mismatches": mism, "rss_slope_bound_mib_per_min": bound,
            "ok": all(checks.values())}


def audit_warnings(log_path: Path, most: int = 10) -> list[str]:
    """The server log's reuse-audit mismatch lines (first divergent layer and token, max |dKV|), at most ``most``."""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if "KV reuse audit of" in ln]
    return lines[:most]


def latency(requests: list[dict]) -> dict:
    ttft = [r["ttft_s"] for r in requests if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in requests if r.get("tpot_s") is not None]
    return {"streamed_with_tokens": len(ttft),
            **{f"ttft_p{q}_s": pct(ttft, q / 100) for q in (50, 90, 99)},
            **{f"tpot_p{q}_s": pct(tpot, q / 100) for q in (50, 90, 99)}}


def health_report(res: dict, log_path: Path | None = None, after_s: float = 60.0) -> dict:
    """The detector's alarms over the (fault-free) run: EWMA warnings and breach forecasts, per hour.

    Each forecast event is paired with the soak's own requests that started in the ``after_s`` seconds after it:
    ``followed_by_ttft_breach`` says whether one of them had a TTFT over ``ttft_objective_s`` (a forecast that came
    true would not be a false alarm; the soak injects no fault, so any is reported, not excused)."""
    lives = [res["restart"]["life1"], res["life2"]] if res.get("restart") else [res["life2"]]
    samples = sum(x["health_samples"] for x in lives)
    warns = sum(x["health_warnings"] for x in lives)
    fcs = sum(x.get("health_forecasts", 0) for x in lives)
    hours = res["elapsed_s"] / 3600
    obj = res.get("ttft_objective_s") or 3.0
    events = [e for x in lives for e in x["health_events"]]
    forecasts = []
    for e in events:
        if e["event"] != "forecast":
            continue
        near = [r for r in res["requests"] if e["t"] <= r["t"] <= e["t"] + after_s and r.get("ttft_s") is not None]
        forecasts.append({"t_s": round(e["t"] - res["t_start_wall"], 1), "breach_eta_s": e.get("breach_eta_s"),
                          "reason": e.get("breach_reason"),
                          "max_ttft_next_s": max((r["ttft_s"] for r in near), default=None),
                          "followed_by_ttft_breach": any(r["ttft_s"] > obj for r in near)})
    log_lines = {"warning": 0, "forecast": 0}
    if log_path is not None and log_path.exists():
        for ln in log_path.read_text(errors="replace").splitlines():
            log_lines["warning"] += "KV cache health warning (score" in ln
            log_lines["forecast"] += "KV cache health forecast: breach" in ln
    ttfts = [r["ttft_s"] for r in res["requests"] if r.get("ttft_s") is not None]
    return {"samples": samples, "warnings": warns, "forecasts": fcs,
            "predictor": lives[-1].get("health_predictor"),
            "false_alarms_per_hour": warns / hours if hours else None,
            "forecast_false_alarms_per_hour": fcs / hours if hours else None,
            "alarms_per_hour": (warns + fcs) / hours if hours else None,
            "false_alarm_rate_per_sample": warns / samples if samples else None,
            "log_lines": log_lines, "forecast_events": forecasts,
            "requests_over_ttft_objective": sum(t > obj for t in ttfts), "ttft_measured": len(ttfts),
            "reasons": [r["signal"] for x in lives for e in x["health_events"] if e["event"] == "warning"
                        for r in e["reasons"]]}


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'kvkeeper[plots]'): no PNG", file=sys.stderr)
        return False
    S = res["samples"]
    t = [s["t_s"] / 60 for s in S]
    fig, ax = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)

    def series(key):
        return [s.get(key) if s.get(key) is not None else float("nan") for s in S]

    a = ax[0][0]
    a.plot(t, series("rss_mib"), label="RSS (MiB)")
    a.set_ylabel("MiB")
    b = a.twinx()
    b.plot(t, series("fds"), "g:", label="open fds")
    b.plot(t, series("threads"), "r:", label="threads")
    a.legend(loc="upper left")
    b.legend(loc="upper right")
    a.set_title("server process")
    a = ax[0][1]
    for st in ("free", "cached", "owned", "offloaded"):
        a.plot(t, series(f"blocks_{st}"), label=st)
    a.set_title("KV blocks by state")
    a.legend()
    a = ax[1][0]
    a.plot(t, series("prefix_hit_rate"), label="prefix hit rate (cumulative, per life)")
    a.plot(t, series("health_score"), label="health score")
    a.set_ylim(-0.05, 1.05)
    a.legend()
    a.set_xlabel("minutes")
    a = ax[1][1]
    t0 = res["t_start_wall"]
    rq = [r for r in res["requests"] if r.get("ttft_s") is not None]
    a.scatter([(r["t"] - t0) / 60 for r in rq], [r["ttft_s"] for r in rq], s=4, label="TTFT (s)")
    rq = [r for r in res["requests"] if r.get("tpot_s") is not None]
    a.scatter([(r["t"] - t0) / 60 for r in rq], [r["tpot_s"] for r in rq], s=4, label="TPOT (s)")
    a.set_yscale("log")
    a.legend()
    a.set_xlabel("minutes")
    if res.get("restart"):
        for row in ax:
            for a in row:
                a.axvline(res["restart"]["at_s"] / 60, color="k", lw=0.8, ls="--")
    fig.suptitle(f"kvkeeper soak: {res['minutes']} min, {res['users']} users (restart dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def markdown(res: dict) -> str:
    v, lat, h, c = res["verdict"], res["latency"], res["health"], res["counts"]
    rs = res.get("restart") or {}
    rows = [("duration", f"{res['elapsed_s'] / 60:.1f} min ({res['users']} users)"),
            ("requests / turns / conversations", f"{len(res['requests'])} / {c['turns']} / {c['conversations']}"),
            ("streamed / hung up / n=2 / offloads / deletes",
             f"{c['streamed']} / {c['hung_up']} / {c['n2']} / {c['offloads']} / {c['deletes']}"),
            ("5xx / 4xx / transport errors", f"{c['status_5xx']} / {c['status_4xx']} / {c['transport_errors']}"),
            ("409 (turn still aborting after a hang-up), retried", str(c["busy_retries"])),
            ("restart at / sessions restored", f"{rs.get('at_s', '-')} s / {rs.get('restored', '-')} of "
                                               f"{rs.get('open_before', '-')}"),
            ("load extended to cover every kind (s) / still missing",
             f"{(res.get('coverage') or {}).get('extended_s', 0)} / "
             f"{', '.join((res.get('coverage') or {}).get('missing') or []) or 'none'}"),
            ("reuse audits / mismatches", f"{v['audits']:.0f} / {v['audit_mismatches']:.0f}"),
            ("owned / pinned blocks when idle", f"{res['idle']['owned_blocks_idle']:.0f} / "
                                                f"{res['idle']['pinned_blocks_idle']:.0f}"),
            ("RSS slope, 2nd half of each life (MiB/min)", ", ".join(
                f"{s['slope_mib_per_min']:.2f}" if s["slope_mib_per_min"] is not None else "n/a" for s in res["rss"])
             + f" (bound {v['rss_slope_bound_mib_per_min']})"),
            ("RSS start -> end per life (MiB)", ", ".join(f"{s['rss_start_mib']} -> {s['rss_end_mib']}"
                                                         for s in res["rss"])),
            ("TTFT p50 / p90 / p99 (s)", " / ".join(_f(lat[f"ttft_p{q}_s"]) for q in (50, 90, 99))),
            ("TPOT p50 / p90 / p99 (s)", " / ".join(_f(lat[f"tpot_p{q}_s"]) for q in (50, 90, 99))),
            ("health warnings (false alarms) / samples", f"{h['warnings']} / {h['samples']}"),
            (f"breach forecasts ({h.get('predictor')}) / per hour",
             f"{h.get('forecasts', 0)} / {_f(h.get('forecast_false_alarms_per_hour'))}"),
            ("alarms of either kind per hour (target <= 1)", _f(h.get("alarms_per_hour"))),
            (f"requests with TTFT over the objective ({res.get('ttft_objective_s')} s)",
             f"{h.get('requests_over_ttft_objective')} of {h.get('ttft_measured')}"),
            ("load swing / bursts", f"{res.get('swing_min') or 'none'} min / {c.get('bursts', 0)} bursts of "
                                    f"{res.get('burst_size')}"),
            ("load average start / end", f"{_la(res.get('load_avg_start'))} / {_la(res.get('load_avg_end'))}"),
            ("pass", ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in v["checks"].items()))]
    return "| soak | |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def _f(x):
    return "n/a" if x is None else f"{x:.3f}"


def _la(x):
    return "n/a" if not x else " ".join(f"{v:.2f}" for v in x)


def dumps(res: dict) -> str:
    """The report as JSON: one line per sample and per request (times rounded to 0.1 ms), the rest indented."""
    def rnd(v):
        return round(v, 4) if isinstance(v, float) else v

    rows = {k: [json.dumps({a: rnd(b) for a, b in x.items()}, separators=(",", ":")) for x in res[k]]
            for k in ("samples", "requests")}
    head = json.dumps({k: v for k, v in res.items() if k not in rows}, indent=1)[:-2]
    parts = [f',\n "{k}": [\n  ' + ",\n  ".join(v) + "\n ]" for k, v in rows.items()]
    return head + "".join(parts) + "\n}"


# ---- coverage ----------------------------------------------------------------------------------------
COVERED = ("turns", "streamed", "hung_up", "n2", "offloads")  # deletes: every user deletes its sessions at the end


def missing_kinds(run: Run, audits_before: float) -> list[str]:
    """The kinds of request that have not happened yet (and "audit" while no reuse audit ran in any life)."""
    missing = [k for k in COVERED if not run.counts[k]]
    if not audits_before and not read_metrics(run.server.base).get("kvkeeper:kv_audit_total", 0):
        missing.append("audit")
    return missing


async def until(pred, cap_s: float) -> float:
    """Wait (1 s polls) until ``pred()`` is true or ``cap_s`` seconds passed; returns the seconds waited."""
    t = time.monotonic()
    while time.monotonic() - t < cap_s and not await asyncio.to_thread(pred):
        await asyncio.sleep(1.0)
    return time.monotonic() - t


async def covered_load(run: Run, args, t0: float) -> dict:
    """The load phase: ``--minutes`` with the restart halfway, each stretched by ``--until-covered``."""
    total, cap = args.minutes * 60, args.until_covered
    rs, waited = None, 0.0
    if not args.no_restart:
        await asyncio.sleep(total / 2)
        waited += await until(lambda: run.counts["turns"] > 0, cap)
        rs = await restart(run, t0)
    await asyncio.sleep(max(0.0, total + waited - (time.monotonic() - t0)))
    audits1 = rs["life1"]["audit_total"] if rs else 0
    if cap:
        waited += await until(lambda: not missing_kinds(run, audits1), max(0.0, cap - waited))
    return {"restart": rs, "coverage": {"extended_s": round(waited, 1), "cap_s": cap,
                                        "missing": missing_kinds(run, audits1) if cap else None}}


# ---- main --------------------------------------------------------------------------------------------
async def soak(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvkeeper-soak-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--audit-fraction", str(args.audit_fraction),
             *([] if args.kv_cache_bytes == "default" else ["--kv-cache-bytes", args.kv_cache_bytes]),
             "--max-new-tokens", str(args.max_tokens), "--threads", str(args.threads), *args.server_arg]
    server = Server(tmp / "data", out / f"{args.name}.server.log", extra)
    (out / f"{args.name}.server.log").write_text("")
    first_start = await asyncio.to_thread(server.start)
    run = Run(args, server)
    t0, wall0 = time.monotonic(), time.time()
    run.t0 = t0
    load0 = os.getloadavg()
    samples: list[dict] = []
    tasks = [asyncio.create_task(user(run, k)) for k in range(args.users)]
    if args.burst_every_s:
        tasks.append(asyncio.create_task(bursts(run)))
    samp = asyncio.create_task(sampler(run, t0, samples))
    load = await covered_load(run, args, t0)
    rs = load["restart"]
    idle = await drain(run, tasks)
    samples.append(await asyncio.to_thread(sample, run, t0))
    run.stop = True
    await samp
    life2 = await asyncio.to_thread(life_end, run)
    elapsed = time.monotonic() - t0
    server.stop()
    res = {"minutes": args.minutes, "users": args.users, "elapsed_s": round(elapsed, 1), "t_start_wall": wall0,
           "first_start_s": round(first_start, 1), "server_args": extra, "cpu": cpu_model(),
           "load_avg_start": load0, "load_avg_end": os.getloadavg(), "audit_fraction": args.audit_fraction,
           "swing_min": args.swing_min, "burst_every_s": args.burst_every_s, "burst_size": args.burst_size,
           "ttft_objective_s": args.ttft_objective, "counts": run.counts, "errors": run.errors, "restart": rs, "coverage": load["coverage"],
           "life2": life2, "idle": idle, "samples": samples, "requests": run.requests}
    res["rss"] = rss_slopes(samples)
    res["latency"] = latency(run.requests)
    res["health"] = health_report(res, out / f"{args.name}.server.log")
    res["verdict"] = verdict(res, args.rss_slope_bound)
    res["verdict"]["audit_warnings"] = audit_warnings(out / f"{args.name}.server.log")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="duration of the load (default 30)")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--think-s", type=float, default=1.0, help="most seconds a user waits between turns")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--hangup-fraction", type=float, default=0.1, help="streams that hang up after two chunks")
    ap.add_argument("--offload-fraction", type=float, default=0.125, help="turns followed by an offload")
    ap.add_argument("--audit-fraction", type=float, default=0.25)
    ap.add_argument("--kv-cache-bytes", default="256M", help="the server's KV budget; 'default': the server's own")
    ap.add_argument("--threads", type=int, default=1, help="server torch threads (the soak measures no speed)")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--rss-slope-bound", type=float, default=2.0, help="MiB per minute (default 2)")
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--until-covered", type=float, default=0.0, metavar="S",
                    help="extend the load by at most S seconds until every kind of request happened (0: off)")
    ap.add_argument("--swing-min", type=float, default=0.0, help="period of the active-user swing (minutes, 0: none)")
    ap.add_argument("--burst-every-s", type=float, default=0.0, help="seconds between bursts (0: none)")
    ap.add_argument("--burst-size", type=int, default=3, help="one-off requests per burst")
    ap.add_argument("--ttft-objective", type=float, default=3.0,
                    help="TTFT objective (s) the report compares requests against (the server's default, 3 s)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for kvkeeper serve")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak"))
    ap.add_argument("--config", default="smollm2-135m", help="the run's config in its file name (default %(default)s)")
    ap.add_argument("--name", default=None, help="write OUT/NAME.{json,md,png} (default: soak-CONFIG-DATE)")
    args = ap.parse_args(argv)
    if args.name is None:
        from common import result_name

        args.name = result_name("soak", args.config)
    res = asyncio.run(soak(args))
    out = Path(args.out)
    res["png"] = plot(res, out / f"{args.name}.png")
    md = markdown(res)
    (out / f"{args.name}.json").write_text(dumps(res) + "\n")
    (out / f"{args.name}.md").write_text(md)
    print(md)
    if res["errors"]:
        print("errors:", *res["errors"][:10], sep="\n  ", file=sys.stderr)
    return 0 if res["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
