#!/usr/bin/env python
"""Serving benchmark: multi-turn chat clients against ``kvkeeper serve`` and a peer server.

Each client holds one Topical-Chat conversation (data/topical_chat): it sends the
conversation's user turns one after another, each time resending the whole history
(its earlier user turns and the server's replies), streaming the answer, exactly as
a stateless OpenAI client does.  Clients run concurrently at each concurrency level
(default 1, 8 and 32).  Greedy decoding, ``max_tokens`` per turn.

Per server and concurrency: TTFT p50 and p99 (s, from sending the request to the
first content chunk), TTFT of the first and of the last turn (p50), time per output
token (s: (end - first token) / (tokens - 1), p50), output throughput (completion
tokens / wall time), and the prefix cache hit rate (prompt tokens reused / prompt
tokens; from ``usage.prompt_tokens_details.cached_tokens`` where the server reports it).

Peers measured in the same run (``--peer``): ``transformers serve`` (continuous batching
on) on the same weights, fp32, on this CPU (the embedded model only: it needs a Hugging Face
folder, which the script writes once from the embedded GGUF,
``$KVKEEPER_CACHE/hf/smollm2-135m-instruct``); or ``llama_cpp``: llama-cpp-python's OpenAI
server (``python -m llama_cpp.server``, its ``[server]`` extra, under ``--llama-python``) on the
same GGUF file with the same threads and context, its RAM prompt cache on (``--cache``) and requests queued rather than interrupted; that
server runs one request at a time and reuses the longest common prefix of the last prompt).

    .venv/bin/python benchmarks/serving/serve_bench.py [--model FILE.gguf] [--peer transformers|llama_cpp|none]
        [--llama-python PY] [--concurrency 1 8 32] [--turns 3] [--max-tokens 24] [--out benchmarks/results/serve_bench]

Writes ``OUT/serve_bench-<config>-<date>.json`` and ``.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.utils.serverproc
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import cpu_model, result_name, write_report  # noqa: E402
from tests.utils.serverproc import free_port  # noqa: E402

CONVERSATIONS = ROOT / "data" / "topical_chat" / "test_freq_conversations_first20.jsonl"


# ---- servers -----------------------------------------------------------------------------


def hf_folder() -> Path:
    """A Hugging Face folder (config.json + safetensors + tokenizer) of the embedded GGUF, written once."""
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import cache_dir

    out = cache_dir() / "hf" / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    g = resolve_model_path("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    from safetensors.torch import save_model

    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = model.config
    cfg.architectures = [type(model).__name__]
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the weights below are the dequantised fp32 ones
    cfg.to_json_file(tmp / "config.json")
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # handles the tied embedding
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


class Server:
    """A server subprocess on a free port; ``model`` is what clients send."""

    def __init__(self, name: str, cmd: list[str], model: str | None, log: Path, env: dict | None = None,
                 health: str = "/health"):
        self.name, self.model = name, model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.base + health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not become healthy; see {log}")
            time.sleep(0.5)
        if self.model is None:  # what the server calls its model
            self.model = httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def prefix_counters(base: str) -> tuple[float, float] | None:
    try:
        text = httpx.get(base + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    vals = {}
    for line in text.splitlines():
        for key in ("kvkeeper:prefix_cache_queries_total", "kvkeeper:prefix_cache_hits_total"):
            if line.startswith(key + " "):
                vals[key] = float(line.split()[-1])
    if len(vals) != 2:
        return None
    return vals["kvkeeper:prefix_cache_queries_total"], vals["kvkeeper:prefix_cache_hits_total"]


# ---- clients -----------------------------------------------------------------------------


def user_turns(k: int, turns: int) -> list[list[str]]:
    convs = [json.loads(x) for x in CONVERSATIONS.read_text().splitlines() if x.strip()]
    out = []
    for i in range(k):
        c = convs[i % len(convs)]
        ts = [t["text"] for t in c["turns"]][0::2][:turns]  # agent_1's lines are the user's turns
        if i >= len(convs):
            ts[0] = f"(Conversation {i}.) " + ts[0]
        out.append(ts)
    return out


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> dict:
    """POST a streamed chat completion (``stream_options.include_usage``) and time it.

    Returns status, ttft_s and end_s (seconds from the request), chunks (with content), text, usage (the final
    chunk's), timings (llama-server's last ``timings`` object: ``prompt_n`` tokens computed, ``cache_n`` reused;
    None from other servers), and error (the body's first 300 characters) when the status is not 200."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    rec = {"ttft_s": None, "end_s": None, "chunks": 0, "text": "", "usage": None, "timings": None,
           "status": None}
    async with http.stream("POST", url, json=body, headers=headers) as r:
        rec["status"] = r.status_code
        if r.status_code != 200:
            rec["error"] = (await r.aread()).decode(errors="replace")[:300]
            return rec
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content") or ""
                if piece:
                    if rec["ttft_s"] is None:
                        rec["ttft_s"] = time.perf_counter() - t0
                    rec["chunks"] += 1
                    rec["text"] += piece
            if chunk.get("usage"):
                rec["usage"] = chunk["usage"]
            if chunk.get("timings"):
                rec["timings"] = chunk["timings"]
    rec["end_s"] = time.perf_counter() - t0
    return rec


async def one_turn(http: httpx.AsyncClient, srv: Server, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": srv.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return await stream_chat(http, srv.base + "/v1/chat/completions", body)


async def conversation(turn, turns: list[str]) -> list[dict]:
    """Send ``turns`` as user messages in order, each with the replies so far; ``turn(messages)`` sends one
    (a coroutine returning a :func:`stream_chat` record).  Stops at the first status other than 200."""
    messages, recs = [], []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        rec = await turn(messages)
        rec["turn"] = i
        recs.append(rec)
        if rec["status"] != 200:
            break
        messages.append({"role": "assistant", "content": rec["text"]})
    return recs


async def _warm_up(srv: Server) -> None:
    async with httpx.AsyncClient(timeout=300) as http:  # a prompt that no client sends
        await one_turn(http, srv, [{"role": "user", "content": "Warm-up: say hi."}], 4)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def run_level(srv: Server, c: int, turns: int, max_tokens: int) -> dict:
    convs = user_turns(c, turns)
    before = prefix_counters(srv.base)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=httpx.Limits(max_connections=c + 4)) as http:
        results = await asyncio.gather(*(conversation(functools.partial(one_turn, http, srv, max_tokens=max_tokens), ts) for ts in convs))
    wall = time.perf_counter() - t0
    after = prefix_counters(srv.base)
    recs = [r for conv in results for r in conv]
    ok = [r for r in recs if r["status"] == 200 and r["ttft_s"] is not None]
    toks = []
    for r in ok:
        n = r["usage"]["completion_tokens"] if r.get("usage") else r["chunks"]
        r["tokens"] = n
        toks.append(n)
    tpot = [(r["end_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    with_usage = [r for r in ok if r.get("usage") and r["usage"].get("prompt_tokens")]
    cached = [((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) for r in with_usage]
    hit_rate = None
    if with_usage and all(x is not None for x in cached):
        hit_rate = sum(cached) / sum(r["usage"]["prompt_tokens"] for r in with_usage)
    metrics_hit_rate = None
    if before and after and after[0] > before[0]:
        metrics_hit_rate = (after[1] - before[1]) / (after[0] - before[0])
    last = max(r["turn"] for r in ok) if ok else 0
    return {
        "server": srv.name, "concurrency": c, "requests": len(recs), "ok": len(ok),
        "errors": [r.get("error") for r in recs if r["status"] != 200][:3],
        "wall_s": round(wall, 3), "completion_tokens": sum(toks),
        "output_tok_per_s": sum(toks) / wall if wall else None,
        "ttft_p50_s": pct([r["ttft_s"] for r in ok], 0.5), "ttft_p99_s": pct([r["ttft_s"] for r in ok], 0.99),
        "ttft_first_turn_p50_s": pct([r["ttft_s"] for r in ok if r["turn"] == 0], 0.5),
        "ttft_last_turn_p50_s": pct([r["ttft_s"] for r in ok if r["turn"] == last], 0.5),
        "tpot_p50_s": pct(tpot, 0.5),
        "prompt_tokens_last_turn_mean": statistics.mean([r["usage"]["prompt_tokens"] for r in with_usage
                                                         if r["turn"] == last]) if with_usage else None,
        "prefix_hit_rate_usage": hit_rate, "prefix_hit_rate_metrics": metrics_hit_rate,
    }


# ---- report ------------------------------------------------------------------------------


def fmt(x, unit="", nd=3):
    if x is None:
        return "n/a"
    if unit == "ms":
        return f"{x * 1000:.0f} ms"
    if unit == "%":
        return f"{100 * x:.0f}%"
    return f"{x:.{nd}g}"


def markdown(res: dict) -> str:
    lines = [f"# Serving benchmark ({res['date']})", "",
             f"{res['machine']}; {res['turns']} user turns per client (Topical-Chat), history resent each turn, "
             f"greedy, max_tokens {res['max_tokens']}.", "",
             "| server | clients | TTFT p50 | TTFT p99 | TTFT turn 1 | TTFT last turn | TPOT p50 | output tok/s "
             "| prefix hit rate | ok/requests |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["levels"]:
        hr = r["prefix_hit_rate_usage"] if r["prefix_hit_rate_usage"] is not None else r["prefix_hit_rate_metrics"]
        lines.append(f"| {r['server']} | {r['concurrency']} | {fmt(r['ttft_p50_s'], 'ms')} | {fmt(r['ttft_p99_s'], 'ms')} "
                     f"| {fmt(r['ttft_first_turn_p50_s'], 'ms')} | {fmt(r['ttft_last_turn_p50_s'], 'ms')} "
                     f"| {fmt(r['tpot_p50_s'], 'ms')} | {fmt(r['output_tok_per_s'], nd=3)} | {fmt(hr, '%')} "
                     f"| {r['ok']}/{r['requests']} |")
    if res.get("ratios"):
        lines += ["", "| clients | throughput kvkeeper / peer | TTFT p50 peer / kvkeeper | last-turn TTFT peer / kvkeeper |",
                  "|---|---|---|---|"]
        for q in res["ratios"]:
            lines.append(f"| {q['concurrency']} | {fmt(q['throughput'], nd=3)}x | {fmt(q['ttft_p50'], nd=3)}x "
                         f"| {fmt(q['ttft_last_turn'], nd=3)}x |")
    if res.get("notes"):
        lines += [""] + [f"* {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--peer", choices=["transformers", "llama_cpp", "none"], default="transformers")
    ap.add_argument("--llama-python", default=sys.executable, help="the Python with llama-cpp-python[server]")
    ap.add_argument("--ctx", type=int, default=4096, help="context (tokens) of both servers")
    ap.add_argument("--config", default=None, help="the result's config name (default: the model and the peer)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_bench"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    model_args = ["--model", args.model] if args.model else []
    servers = [("kvkeeper", [py, "-m", "kvkeeper.cli", "serve", "--port", "{port}", "--threads", str(args.threads),
                             "--max-model-len", str(args.ctx), *model_args],
                None if args.model else "smollm2-135m-instruct", {}, "/health")]
    notes = []
    if args.peer == "transformers":
        exe = shutil.which("transformers") or str(Path(py).parent / "transformers")
        if args.model:
            notes.append("transformers serve: runs the embedded model's HF folder only; not measured on --model")
        elif Path(exe).exists():
            folder = str(hf_folder())
            servers.append(("transformers serve (continuous batching)",
                            [exe, "serve", folder, "--port", "{port}", "--device", "cpu", "--dtype", "float32",
                             "--continuous-batching"], folder,
                            {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}, "/health"))
        else:
            notes.append("transformers serve: the `transformers` command is not installed; not measured")
    elif args.peer == "llama_cpp":
        from kvkeeper.weights.sources import resolve_model_path

        gguf = args.model or str(resolve_model_path())
        servers.append(("llama.cpp server (llama-cpp-python)",
                        [args.llama_python, "-m", "llama_cpp.server", "--model", gguf, "--port", "{port}",
                         "--host", "127.0.0.1", "--n_threads", str(args.threads), "--n_threads_batch",
                         str(args.threads), "--n_ctx", str(args.ctx), "--cache", "True",
                         "--interrupt_requests", "False"], None,
                        {"OMP_NUM_THREADS": str(args.threads)}, "/v1/models"))
    levels = []
    for name, cmd, model, env, health in servers:
        log = out / f"serve_bench_{name.split()[0]}.log"
        try:
            srv = Server(name, cmd, model, log, env, health)
        except RuntimeError as e:
            notes.append(f"{name}: could not start ({e})")
            continue
        try:
            asyncio.run(_warm_up(srv))
            for c in args.concurrency:
                r = asyncio.run(run_level(srv, c, args.turns, args.max_tokens))
                levels.append(r)
                print(json.dumps(r), flush=True)
        finally:
            srv.stop()
    ratios = []
    for c in args.concurrency:
        k = next((r for r in levels if r["server"] == "kvkeeper" and r["concurrency"] == c), None)
        p = next((r for r in levels if r["server"] != "kvkeeper" and r["concurrency"] == c), None)
        if k and p and k["ok"] and p["ok"]:
            ratios.append({"concurrency": c, "throughput": k["output_tok_per_s"] / p["output_tok_per_s"],
                           "ttft_p50": p["ttft_p50_s"] / k["ttft_p50_s"],
                           "ttft_last_turn": p["ttft_last_turn_p50_s"] / k["ttft_last_turn_p50_s"]})
    res = {"date": _dt.datetime.now().isoformat(timespec="seconds"),
           "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
           "turns": args.turns, "max_tokens": args.max_tokens, "model": args.model or "embedded", "peer": args.peer,
           "threads": args.threads, "ctx": args.ctx, "loadavg": os.getloadavg(), "levels": levels, "ratios": ratios, "notes": notes}
    config = args.config or f"{Path(args.model).stem if args.model else 'smollm2-135m'}-{args.peer}"
    write_report(out, result_name("serve_bench", config), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
