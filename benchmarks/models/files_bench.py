#!/usr/bin/env python
"""The engine benchmark's files section: kvkeeper beside llama.cpp on the GGUF files users run (issue 24).

For each file, each engine runs in its own process (``benchmarks/models/engine/file_worker.py``) with the same KV size
(``--kv-tokens``) and thread count: a cold load (the file's pages dropped from the page cache with
``posix_fadvise(DONTNEED)``, kvkeeper with an empty cache folder: first use), then a warm run (caches filled)
that measures load time, peak resident memory, single-stream greedy decode after a short chat prompt, prefill of
``--prefill-tokens`` tokens of Pride and Prejudice and decode after it, and the time to first token of each turn
of a 10-turn conversation (MT-Bench first-turn questions, each answered by a fixed reply: the entry's second-turn
question, so both engines see the same token ids), each engine reusing its own cache of the previous turn.
Every input is tokenized once here with kvkeeper's tokenizer of the file.

Beside each row: this machine's decode limit, bytes read per decode step (the file's tensors, less the token
embedding when an LM head is separate, plus the KV of the context) over the read bandwidth measured here with
the same threads, and the fraction of it each engine reached.

Usage::

    .venv/bin/python benchmarks/models/files_bench.py --file embedded --file /path/model.gguf ... \
        [--llama-python /path/venv/bin/python] [--threads 2] [--kv-tokens 4096] [--config NAME]

Writes ``benchmarks/results/files_bench/files_bench-<config>-<date>.json`` and ``.md``.  llama.cpp runs under
``--llama-python`` (default: this interpreter; ``make bench-llamacpp`` installs llama-cpp-python into the venv).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import RESULTS, cpu_model, result_name, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "engine" / "file_worker.py"
BOOK = ROOT / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"
QUESTIONS = ROOT / "data" / "mt_bench" / "question.jsonl"

# targets of issue 24 (kvkeeper / llama.cpp, same run)
TARGETS = {"decode": 1.0, "prefill": 1.0, "rss": 1.25, "load": 2.0}


def evict(path: str) -> None:
    """Drop the file's clean pages from the page cache (a cold read next time); no effect on mapped pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bandwidth_gb_s(threads: int, mib: int = 1024, reps: int = 5) -> float:
    """Best read bandwidth (GB/s) of a sum over a buffer far larger than the caches, with ``threads`` threads."""
    torch.set_num_threads(threads)
    buf = torch.ones(mib * (1 << 20) // 4)
    buf.sum()
    best = min((lambda t0: (buf.sum(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(reps))
    return buf.numel() * 4 / best / 1e9


def file_bytes(path: str, kv_bytes_per_token: int, context: int) -> dict:
    """Bytes a decode step reads: every tensor of the file (the token embedding only when it is also the LM head)
    plus the KV of ``context`` tokens."""
    import gguf

    r = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    tied = "output.weight" not in sizes
    weights = sum(n for name, n in sizes.items() if tied or name != "token_embd.weight")
    return {"file_bytes": os.path.getsize(path), "tensor_bytes": sum(sizes.values()), "read_per_step": weights
            + kv_bytes_per_token * context, "tied_embedding": tied}


def inputs(path: str, prefill_tokens: int, turns: int) -> dict:
    """The token ids of every task, from kvkeeper's tokenizer of the file and its chat template."""
    from kvkeeper.text.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(path))

    def chat(msgs):
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))

    qs = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()][:turns]
    text = BOOK.read_text(encoding="utf-8")[2000:]
    long_ids = tok.encode(text[: prefill_tokens * 8], add_special_tokens=False)[:prefill_tokens]
    msgs, turn_ids = [], []
    for q in qs:
        msgs.append({"role": "user", "content": q["turns"][0]})
        turn_ids.append(chat(msgs))
        msgs.append({"role": "assistant", "content": q["turns"][1]})
    return {"chat_ids": chat([{"role": "user", "content": "Write a short poem about the sea."}]),
            "long_ids": long_ids, "turn_ids": turn_ids}


def run_worker(python: str, job: dict, timeout: float) -> dict:
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]))
    p = subprocess.run([python, str(WORKER)], input=json.dumps(job), capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=str(ROOT))
    if p.returncode != 0:
        return {"failed": f"exit {p.returncode}: {p.stderr[-1500:]}"}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["start_to_ready_s"] = res.pop("ready_wall") - t0
    res["loadavg_after"] = os.getloadavg()
    return res


def bench_file(name: str, path: str, a, bw: float) -> dict:
    ids = inputs(path, a.prefill_tokens, a.turns)
    base = {"model": path, "threads": a.threads, "kv_tokens": a.kv_tokens, "decode_tokens": a.decode_tokens,
            "after_long_tokens": a.after_long_tokens, **ids}
    res: dict = {"name": name, "path": path, "loadavg_start": os.getloadavg()}
    engines = [("kvkeeper", sys.executable), ("llama_cpp", a.llama_python)]
    with tempfile.TemporaryDirectory(prefix="kvk-cold-") as cold_cache:
        for eng, py in engines:
            evict(path)
            res[f"{eng}_cold"] = run_worker(py, {**base, "engine": eng, "tasks": [], "cache_dir": cold_cache},
                                            a.timeout)
            print(f"  {name} {eng} cold: {res[f'{eng}_cold'].get('load_s', res[f'{eng}_cold'])}", file=sys.stderr)
    for eng, py in engines:
        res[eng] = run_worker(py, {**base, "engine": eng, "tasks": ["decode", "prefill", "turns"]}, a.timeout)
        print(f"  {name} {eng}: {json.dumps({k: v for k, v in res[eng].items() if 'turn' not in k})[:600]}",
              file=sys.stderr)
    res["loadavg_end"] = os.getloadavg()
    kvb = kv_bytes_per_token(path)
    res["bytes"] = file_bytes(path, kvb, len(ids["chat_ids"]))
    res["kv_bytes_per_token"] = kvb
    res["decode_limit_tok_s"] = bw * 1e9 / res["bytes"]["read_per_step"]
    return res


def kv_bytes_per_token(path: str) -> int:
    """K and V of one token over all layers at 2 bytes per value (bf16 / f16: both engines' default)."""
    import gguf

    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(key, default=None):
        f = r.fields.get(f"{arch}.{key}")
        return default if f is None else int(f.parts[-1][0])

    heads, hidden = field("attention.head_count"), field("embedding_length")
    kv_heads = field("attention.head_count_kv", heads)
    head_dim = field("attention.key_length", hidden // heads)
    return 2 * field("block_count") * kv_heads * head_dim * 2


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def _f(x, nd=1):
    return "-" if x is None else f"{x:,.{nd}f}"


def render(R: dict) -> str:
    L = [f"## files_bench: kvkeeper beside llama.cpp on GGUF files ({R['date']}, {R['cpu']}, {R['threads']} threads, "
         f"KV {R['kv_tokens']} tokens)\n",
         f"Read bandwidth measured here ({R['threads']} threads): {R['read_gb_s']:.1f} GB/s.  llama.cpp: "
         f"{R.get('llama_status', '')}.  Load average at start {R['loadavg_start']}, at end {R['loadavg_end']}.\n",
         "| file | engine | load warm s | start to ready s | load cold s | peak RSS MB | decode tok/s | of limit | "
         f"prefill {R['prefill_tokens']} tok/s | decode after tok/s | turn-10 TTFT ms |",
         "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for f in R["files"]:
        lim = f.get("decode_limit_tok_s")
        for eng in ("kvkeeper", "llama_cpp"):
            r, c = f.get(eng, {}), f.get(f"{eng}_cold", {})
            if "failed" in r:
                L.append(f"| {f['name']} | {eng} | failed: {r['failed'][-200:]!r} |" + " |" * 9)
                continue
            t10 = (r.get("turn_ttft_s") or [None])[-1]
            L.append(f"| {f['name']} | {eng} | {_f(r.get('load_s'), 2)} | {_f(r.get('start_to_ready_s'), 2)} | "
                     f"{_f(c.get('load_s'), 2)} | {_f(r.get('peak_rss_mb'), 0)} | {_f(r.get('decode_tok_s'))} | "
                     f"{_f(_ratio(r.get('decode_tok_s'), lim) and 100 * _ratio(r.get('decode_tok_s'), lim), 0)}% | "
                     f"{_f(r.get('prefill_tok_s'))} | {_f(r.get('decode_after_long_tok_s'))} | "
                     f"{_f(t10 and 1e3 * t10, 0)} |")
        k, ll = f.get("kvkeeper", {}), f.get("llama_cpp", {})
        rat = {"decode": _ratio(k.get("decode_tok_s"), ll.get("decode_tok_s")),
               "prefill": _ratio(k.get("prefill_tok_s"), ll.get("prefill_tok_s")),
               "rss": _ratio(k.get("peak_rss_mb"), ll.get("peak_rss_mb")),
               "load": _ratio(k.get("load_s"), ll.get("load_s")),
               "turn10": _ratio((k.get("turn_ttft_s") or [None])[-1], (ll.get("turn_ttft_s") or [None])[-1]),
               "decode_after": _ratio(k.get("decode_after_long_tok_s"), ll.get("decode_after_long_tok_s"))}
        f["ratios"] = rat
        L.append(f"| {f['name']} | **kvkeeper / llama.cpp** | {_f(rat['load'], 2)}x (<= {TARGETS['load']}) | | | "
                 f"{_f(rat['rss'], 2)}x (<= {TARGETS['rss']}) | {_f(rat['decode'], 2)}x (>= {TARGETS['decode']}) | "
                 f"limit {_f(lim)} tok/s | {_f(rat['prefill'], 2)}x (>= {TARGETS['prefill']}) | "
                 f"{_f(rat['decode_after'], 2)}x | {_f(rat['turn10'], 2)}x |")
    L.append("\nload warm: the engine's constructor with caches filled; start to ready: process start to the "
             "constructor's return (imports included); load cold: the file's pages dropped from the page cache and "
             "(kvkeeper) an empty cache folder.  peak RSS: the process's VmHWM after every task.  decode: greedy, "
             f"{R['decode_tokens']} tokens after a short chat prompt, end-of-sequence ignored; of limit: decode "
             "tok/s over (read bandwidth / bytes read per decode step).  turn-10 TTFT: with each engine's own reuse of "
             "the previous turn (the reply and the new question prefilled).  A ratio below 1 for the load, RSS and "
             "TTFT columns is kvkeeper's advantage; above 1 for decode and prefill.\n")
    return "\n".join(L) + "\n"


def resolve(f: str) -> tuple[str, str]:
    """(name, path) of 'embedded', a known model id (``gemma-3-270m``) or a GGUF path."""
    from kvkeeper.weights.sources import resolve_model_path

    if f == "embedded":
        return "SmolLM2-135M (embedded)", str(resolve_model_path())
    if not Path(f).exists():
        return f, str(resolve_model_path(f))
    return Path(f).stem, str(Path(f).resolve())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", action="append", required=True,
                    help="a GGUF path, a known model id (gemma-3-270m) or 'embedded' (repeatable)")
    ap.add_argument("--llama-python", default=sys.executable, help="the Python that has llama-cpp-python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--prefill-tokens", type=int, default=2000)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--after-long-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--config", default="issue24")
    ap.add_argument("--out", default=str(RESULTS / "files_bench"))
    a = ap.parse_args(argv)
    chk = subprocess.run([a.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                         capture_output=True, text=True)
    R = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(), "threads": a.threads,
         "kv_tokens": a.kv_tokens, "prefill_tokens": a.prefill_tokens, "decode_tokens": a.decode_tokens,
         "llama_status": (f"llama-cpp-python {chk.stdout.strip()} ({a.llama_python})" if chk.returncode == 0
                          else f"not importable under {a.llama_python}"),
         "loadavg_start": os.getloadavg(), "read_gb_s": read_bandwidth_gb_s(a.threads), "files": []}
    for f in a.file:
        name, path = resolve(f)
        print(f"file {name}: {path}", file=sys.stderr)
        R["files"].append(bench_file(name, path, a, R["read_gb_s"]))
    R["loadavg_end"] = os.getloadavg()
    md = render(R)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    write_report(Path(a.out), result_name("files_bench", a.config), R, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
