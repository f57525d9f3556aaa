#!/usr/bin/env python
"""Decode, prefill and turn-10 TTFT on a busy CPU (issue 31 item 6): the same engine quiet and with one CPU-bound
process pinned to the last CPU beside it, at 1 and 2 threads; and the engine on one CPU (``taskset -c 0``) with its
own thread count against ``--threads 1``.

A spinner (``while True: pass`` in a child process, ``os.sched_setaffinity`` to the last CPU) takes one core's
time; an engine whose parallel regions waited on a descheduled thread collapsed there (OpenMP: a 2-thread decode
~10x slower than quiet on this project's 2-core machine), where the kernels' thread pool (``csrc/cpu/pool.cpp``)
should slow to about its fair share.  Target: at most 2.5x slower than quiet.

Turn-10 TTFT with reuse: the demo's conversation (``make demo``: the first Topical-Chat conversation of
``data/topical_chat/test_freq_conversations_first20.jsonl``, greedy, 64 tokens a reply) is run as a session to its
9th turn; then ``--reps`` forks of that session (its KV shared, :meth:`SessionManager.fork`) each send turn 10, and the
median of their times to first token is the figure (only turn 10's new tokens are computed).

One CPU: by default a real CPU quota, a cgroup of the benchmark's own with a 1-CPU CFS quota (cgroup v1
``cpu.cfs_quota_us`` = ``cpu.cfs_period_us``, or v2 ``cpu.max`` "100000 100000" where this process's v2 cgroup
delegates the ``cpu`` controller; needs root), which a spawned child joins before it imports torch (as a container
with ``--cpus 1`` on this host: both CPUs stay in its affinity mask).  ``--one-cpu affinity`` (or no cgroup to
write) emulates one CPU by the affinity mask instead (the child pins itself to CPU 0, as ``taskset -c 0``).  The
engine there picks its thread count itself (``kvkeeper.worker.cpu_threads``: the mask, capped by its own cgroup's
quota) and is compared with the same engine given ``--threads 1`` (``num_threads=1``).  Target: no worse than
``--threads 1``.

Usage::

    .venv/bin/python benchmarks/serving/busy_cpu_bench.py [--model embedded|ID|PATH] [--decode-tokens 64] [--reps 3]
        [--one-cpu quota|affinity] [--no-one-cpu | --only-one-cpu]

Writes ``benchmarks/results/busy_cpu_bench/busy_cpu_bench-<model>-<date>.json`` and ``.md``.  Run it on a quiet machine (the load
average is recorded beside the figures).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import RESULTS, cpu_model, result_name, write_report  # noqa: E402

TARGET = 2.5  # busy / quiet time, at most
CONVERSATIONS = Path(__file__).resolve().parents[2] / "data" / "topical_chat" / "test_freq_conversations_first20.jsonl"
DEMO_TURN, DEMO_TOKENS = 10, 64  # make demo: --turns 16 --max-tokens 64; its summary reads turn 10


def _spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def _decode_tok_s(eng, n_decode: int) -> float:
    """Single-stream greedy decode speed (tokens/s) after a short warm-up, each in its own namespace."""
    from kvkeeper import SamplingParams

    greedy = SamplingParams(max_tokens=n_decode, temperature=0.0, ignore_eos=True)
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 namespace=eng.isolated_namespace())  # warm
    t = time.perf_counter()
    eng.generate([[11, 12, 13]], greedy, namespace=eng.isolated_namespace())
    return n_decode / (time.perf_counter() - t)


def _measure(eng, threads: int, n_decode: int, prompt: list[int]) -> dict:
    from kvkeeper import SamplingParams

    torch.set_num_threads(threads)
    decode = _decode_tok_s(eng, n_decode)
    t = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), namespace=eng.isolated_namespace())
    prefill = len(prompt) / (time.perf_counter() - t)
    return {"decode_tok_s": decode, "prefill_tok_s": prefill}


def _demo_turns() -> list[str]:
    from kvkeeper.cli.chat import load_conversations

    turns = load_conversations(CONVERSATIONS, limit=1)[0][1]
    if len(turns) < DEMO_TURN:
        raise SystemExit(f"{CONVERSATIONS}: the first conversation has {len(turns)} turns, fewer than {DEMO_TURN}")
    return turns[:DEMO_TURN]


def _session_to_turn9(eng, turns: list[str]):
    """(manager, session) of the demo's conversation after its first 9 turns (greedy, 64 tokens a reply)."""
    from kvkeeper import SamplingParams, SessionManager

    sessions = SessionManager(eng)
    s = sessions.open(params=SamplingParams(max_tokens=DEMO_TOKENS, temperature=0.0))
    for text in turns[:-1]:
        s.send(text)
    return sessions, s


def _turn10_ttft(sessions, s, text: str, reps: int) -> dict:
    """Median (and all) turn-10 TTFTs of ``reps`` forks of the session ``s`` (each computes turn 10's tokens)."""
    from kvkeeper import SamplingParams

    ttfts, cached = [], []
    for _ in range(reps):
        f = sessions.fork(s)
        try:
            r = f.send(text, params=SamplingParams(max_tokens=1, temperature=0.0))
            ttfts.append(r.ttft_s)
            cached.append(r.cached_tokens)
        finally:
            f.close()
    return {"turn10_ttft_s": statistics.median(ttfts), "turn10_ttfts_s": ttfts, "turn10_cached_tokens": cached[0],
            "turn10_prompt_tokens": r.prompt_tokens}


def _one_cpu_child(model: str | None, threads: int | None, n_decode: int, reps: int, q, procs: str | None) -> None:
    """In a spawned child, before torch is imported: join the 1-CPU cgroup (``procs``: its ``cgroup.procs``) or,
    without one, pin to CPU 0; then decode and turn-10 TTFT (``threads``: the engine's ``num_threads``; None: its
    own choice)."""
    if procs is not None:
        Path(procs).write_text(str(os.getpid()))
    else:
        os.sched_setaffinity(0, {0})
    from kvkeeper import LLMEngine
    from kvkeeper.worker.cpu_threads import cgroup_cpu_limit

    eng = LLMEngine(model, max_model_len=4096, num_kv_blocks=256, num_threads=threads)
    chosen = torch.get_num_threads()
    decode = _decode_tok_s(eng, n_decode)
    turns = _demo_turns()
    sessions, s = _session_to_turn9(eng, turns)
    q.put({"threads_requested": threads, "threads_chosen": chosen, "decode_tok_s": decode,
           "affinity_cpus": len(os.sched_getaffinity(0)), "cgroup_cpu_limit": cgroup_cpu_limit(),
           **_turn10_ttft(sessions, s, turns[-1], reps)})


def _one_cpu_cgroup() -> tuple[Path, str] | None:
    """A new cgroup with a 1-CPU quota under this process's own (v1 ``cpu`` hierarchy, else v2 where its cgroup
    delegates ``cpu``), and how it was set; None where none can be made (not root, no such hierarchy)."""
    from kvkeeper.worker.cpu_threads import cpu_cgroup_folders

    for version, folder in sorted(cpu_cgroup_folders()):  # "v1" first: v2's own cgroup usually holds processes
        cg = folder / f"kvkeeper-busy-cpu-{os.getpid()}"
        try:
            if version == "v1":
                cg.mkdir()
                (cg / "cpu.cfs_period_us").write_text("100000")
                (cg / "cpu.cfs_quota_us").write_text("100000")
                return cg, f"cgroup v1 {cg}: cpu.cfs_quota_us 100000 / cpu.cfs_period_us 100000"
            if "cpu" in (folder / "cgroup.subtree_control").read_text().split():
                cg.mkdir()
                (cg / "cpu.max").write_text("100000 100000")
                return cg, f"cgroup v2 {cg}: cpu.max 100000 100000"
        except OSError:
            if cg.is_dir():
                cg.rmdir()
    return None


def _one_cpu(model: str | None, n_decode: int, reps: int, how: str, rounds: int) -> tuple[list[dict], str]:
    """The engine on one CPU with its own thread count, ``--threads 1`` and ``--threads 2`` (what it picked before
    it read its own cgroup's quota), one child each, ``rounds`` times in turn."""
    ctx = mp.get_context("spawn")
    made = _one_cpu_cgroup() if how == "quota" else None
    method = made[1] if made else "affinity {0} (taskset -c 0), not a quota" + (
        " (no cgroup could be made here)" if how == "quota" else "")
    rows = []
    try:
        for threads in [None, 1, 2] * rounds:
            q = ctx.Queue()
            procs = str(made[0] / "cgroup.procs") if made else None
            p = ctx.Process(target=_one_cpu_child, args=(model, threads, n_decode, reps, q, procs))
            p.start()
            rows.append(q.get(timeout=1800))
            p.join()
            print(rows[-1], flush=True)
    finally:
        if made:
            made[0].rmdir()
    return rows, method


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3, help="turn-10 TTFTs per figure (forks of the turn-9 session)")
    ap.add_argument("--no-one-cpu", action="store_true", help="skip the one-CPU comparison")
    ap.add_argument("--only-one-cpu", action="store_true", help="only the one-CPU comparison")
    ap.add_argument("--one-cpu", choices=("quota", "affinity"), default="quota",
                    help="one CPU as a 1-CPU cgroup quota (default; needs root) or as the affinity mask {0}")
    ap.add_argument("--rounds", type=int, default=1, help="one-CPU comparison: children per setting, in turn")
    ap.add_argument("--out", default=str(RESULTS / "busy_cpu_bench"))
    args = ap.parse_args(argv)
    from kvkeeper import LLMEngine

    model = None if args.model == "embedded" else args.model
    cpus = sorted(os.sched_getaffinity(0))
    rows, load0 = [], os.getloadavg()
    if not args.only_one_cpu:
        eng = LLMEngine(model, max_model_len=4096, num_kv_blocks=256)
        prompt = [100 + (i * 37) % 20000 for i in range(args.prefill_tokens)]
        turns = _demo_turns()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            sessions, s = _session_to_turn9(eng, turns)
            quiet = {**_measure(eng, threads, args.decode_tokens, prompt),
                     **_turn10_ttft(sessions, s, turns[-1], args.reps)}
            spinner = mp.get_context("spawn").Process(target=_spin, args=(cpus[-1],), daemon=True)
            spinner.start()
            try:
                time.sleep(0.5)
                busy = {**_measure(eng, threads, args.decode_tokens, prompt),
                        **_turn10_ttft(sessions, s, turns[-1], args.reps)}
            finally:
                spinner.kill()
                spinner.join()
            s.close()
            rows.append({"threads": threads, "quiet": quiet, "busy": busy,
                         "decode_slowdown": quiet["decode_tok_s"] / busy["decode_tok_s"],
                         "prefill_slowdown": quiet["prefill_tok_s"] / busy["prefill_tok_s"],
                         "turn10_slowdown": busy["turn10_ttft_s"] / quiet["turn10_ttft_s"]})
            print(rows[-1], flush=True)
    one_cpu, method = ([], None) if args.no_one_cpu else _one_cpu(model, args.decode_tokens, args.reps, args.one_cpu,
                                                                         args.rounds)
    res = {"model": args.model, "cpu": cpu_model(), "cpus": len(cpus), "loadavg_start": load0,
           "loadavg_end": os.getloadavg(), "target_slowdown": TARGET, "rows": rows, "one_cpu": one_cpu,
           "one_cpu_method": method}
    md = [f"## busy_cpu_bench: one CPU-bound process pinned beside the engine ({args.model}, {cpu_model()}, "
          f"{len(cpus)} CPUs)", "",
          f"Load average at start {tuple(round(x, 2) for x in load0)}, at end "
          f"{tuple(round(x, 2) for x in res['loadavg_end'])} (a busy machine before the run makes the quiet figures "
          "low too)."]
    if rows:
        md += ["", "| threads | decode quiet tok/s | decode busy tok/s | slowdown | prefill quiet tok/s | prefill busy "
               "tok/s | slowdown | turn-10 TTFT quiet ms | busy ms | slowdown | target |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        worst = max(r["decode_slowdown"], r["prefill_slowdown"], r["turn10_slowdown"])
        ok = "met" if worst <= TARGET else "missed"
        md.append(f"| {r['threads']} | {r['quiet']['decode_tok_s']:.1f} | {r['busy']['decode_tok_s']:.1f} | "
                  f"{r['decode_slowdown']:.2f}x | {r['quiet']['prefill_tok_s']:.0f} | {r['busy']['prefill_tok_s']:.0f} "
                  f"| {r['prefill_slowdown']:.2f}x | {1000 * r['quiet']['turn10_ttft_s']:.0f} | "
                  f"{1000 * r['busy']['turn10_ttft_s']:.0f} | {r['turn10_slowdown']:.2f}x | <= {TARGET}x {ok} |")
    if one_cpu:
        r0 = one_cpu[0]
        md += ["", f"One CPU ({method}; turn 10: {r0['turn10_prompt_tokens']} prompt tokens, "
               f"{r0['turn10_cached_tokens']} from the session's KV; {r0['affinity_cpus']} CPUs in the affinity "
               f"mask, the engine's reading of the quota: {r0['cgroup_cpu_limit']}):", "",
               "| engine | threads chosen | decode tok/s | turn-10 TTFT ms | turn-10 TTFTs ms |",
               "|---|---|---|---|---|"]
        for r in one_cpu:
            name = "its own count" if r["threads_requested"] is None else f"--threads {r['threads_requested']}"
            each = ", ".join(f"{1000 * t:.0f}" for t in r["turn10_ttfts_s"])
            md.append(f"| {name} | {r['threads_chosen']} | {r['decode_tok_s']:.1f} | {1000 * r['turn10_ttft_s']:.0f} "
                      f"| {each} |")
    name = result_name("busy_cpu_bench", Path(args.model).stem if args.model != "embedded" else "smollm2-135m")
    write_report(Path(args.out), name, res, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
