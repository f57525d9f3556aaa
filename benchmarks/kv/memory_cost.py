"""What the session memory costs per turn (issue 32): indexing the turns that leave the prompt and searching for
each new user message, measured separately, up to N indexed turns.

A conversation of real Topical-Chat turns (``data/topical_chat``, CDLA-Sharing-1.0; a turn is a user message and
its reply) is replayed as the ``memory`` policy does with ``--context-every K``: every K turns the K oldest turns
leave the prompt and are stored (:meth:`SessionMemory.add`: split into sentences, embedded in one batch, inserted
in sqlite-vec and the FTS5 table), and every turn searches once with its user message
(:meth:`SessionMemory.search`, top 8, floor 0.25).  The file is a real SQLite file in a temporary folder (the
server's ``--data-dir`` case).  Reported: per turn, indexing (amortised: a batch's time / K) and search, their
sum, over the whole run and over the last 50 turns (250..300 indexed turns with the default N), in wall time and in
the process's CPU time (``time.process_time``: on a shared machine the wall time includes waiting for a core,
the CPU time does not); each phase's
share (embedding the new sentences, embedding the query, k-NN, BM25, fusion, SQLite inserts); the hybrid
policy's ranking of the kept window (cosine of 20 turns' embeddings, cached by text) per turn; and, for the
decision between BM25 designs, what one bm25s rebuild over every stored sentence costs at N turns (the lazy
rebuild a search after each batch would pay) against FTS5's incremental index.

    python benchmarks/kv/memory_cost.py [--turns 300] [--every 4] [--embed-threads 1] [--embed-dtype auto] [--out PATH]

``--embed-threads N``: torch threads while embedding (the :class:`Embedder`'s ``threads``; 0: torch's own setting,
the engine's thread count); ``--embed-dtype``: the :class:`Embedder`'s ``dtype`` (auto: bfloat16 on a CPU with AMX).

Writes ``benchmarks/results/memory_cost/memory_cost-<date>.json`` and ``.md`` (load average recorded before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # common

from kvkeeper.sessions.context import turn_text  # noqa: E402
from kvkeeper.sessions.memory import Embedder, SessionMemory, lemmas  # noqa: E402

SOURCE = ROOT / "data" / "topical_chat" / "test_freq_conversations.jsonl"


def topical_turns(n: int) -> list[list[dict]]:
    """``n`` turns (user message, assistant reply) of Topical-Chat conversations, in file order."""
    out: list[list[dict]] = []
    for line in SOURCE.read_text().splitlines():
        texts = [t["text"] for t in json.loads(line)["turns"]]
        for i in range(0, len(texts) - 1, 2):
            out.append([{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 1]}])
            if len(out) == n:
                return out
    raise SystemExit(f"{SOURCE} holds fewer than {n} turns")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    from common import result_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=300, help="turns indexed by the end (default: 300)")
    ap.add_argument("--every", type=int, default=4, help="turns leave K at a time (default: 4)")
    ap.add_argument("--embed-threads", type=int, default=1,
                    help="torch threads while embedding (default: 1, the Embedder's; 0: torch's own setting)")
    ap.add_argument("--embed-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the embedding model's dtype (default: auto, bfloat16 on a CPU with AMX)")
    ap.add_argument("--out", default=str(result_path("memory_cost", config="minilm", suffix="")),
                    help="OUT.json and OUT.md")
    args = ap.parse_args()
    load0 = os.getloadavg()
    turns = topical_turns(args.turns + args.every)
    emb = Embedder(threads=args.embed_threads or None, dtype=args.embed_dtype)
    emb.encode(["warm-up"])  # the model load is not a turn's cost
    with tempfile.TemporaryDirectory() as tmp:
        mem = SessionMemory(Path(tmp) / "m.sqlite", emb)
        index_ms: list[float] = []   # per turn, amortised
        search_ms: list[float] = []
        cpu_ms: list[float] = []     # per turn, indexing (amortised) + search: this process's CPU time (all threads)
        rank_ms: list[float] = []
        for t in range(args.every, args.turns + args.every):
            if t % args.every == 0:  # the K oldest kept turns leave
                batch = [(i, turn_text(turns[i])) for i in range(t - args.every, t)]
                t0, c0 = time.perf_counter(), time.process_time()
                mem.add(batch, "")
                index_ms += [(time.perf_counter() - t0) * 1000 / args.every] * args.every
                index_cpu = (time.process_time() - c0) * 1000 / args.every
            query = turns[t][0]["content"]
            t0, c0 = time.perf_counter(), time.process_time()
            mem.search(query, "", 8, 0.25)
            search_ms.append((time.perf_counter() - t0) * 1000)
            cpu_ms.append(index_cpu + (time.process_time() - c0) * 1000)
            window = [turn_text(turns[i]) for i in range(max(0, t - 20), t)]
            t0 = time.perf_counter()
            mem.similarities(query, window)
            rank_ms.append((time.perf_counter() - t0) * 1000)
        n_sent = mem.sentences("")
        texts = [row[0] for row in mem.db.execute("select text from sents")]
        phases = {k: v * 1000 / len(search_ms) for k, v in mem.timings.items()}
        mem.close()
    import bm25s

    t0 = time.perf_counter()
    r = bm25s.BM25()
    r.index([lemmas(x) for x in texts], show_progress=False)
    rebuild_ms = (time.perf_counter() - t0) * 1000
    last = slice(-50, None)
    total = [a + b for a, b in zip(index_ms, search_ms)]
    res = {
        "turns_indexed": args.turns, "every": args.every, "sentences_indexed": n_sent,
        "per_turn_ms_mean": statistics.mean(total), "per_turn_ms_mean_last50": statistics.mean(total[last]),
        "per_turn_cpu_ms_mean": statistics.mean(cpu_ms), "per_turn_cpu_ms_mean_last50": statistics.mean(cpu_ms[last]),
        "index_ms_per_turn_mean": statistics.mean(index_ms), "index_ms_per_turn_mean_last50": statistics.mean(index_ms[last]),
        "search_ms_mean": statistics.mean(search_ms), "search_ms_mean_last50": statistics.mean(search_ms[last]),
        "search_ms_p50": pct(search_ms, 0.5), "search_ms_p95": pct(search_ms, 0.95),
        "hybrid_rank_ms_mean": statistics.mean(rank_ms), "phases_ms_per_turn": phases,
        "bm25s_rebuild_ms_at_end": rebuild_ms,
        "load_average_before": load0[0], "load_average_after": os.getloadavg()[0],
        "machine": f"{platform.machine()}, 2 cores shared with other jobs", "torch_threads": __import__("torch").get_num_threads(),
        "embed_threads": emb.threads or __import__("torch").get_num_threads(), "embed_dtype": emb.dtype,
    }
    md = "\n".join([
        f"Memory cost per turn: {args.turns} turns indexed ({n_sent} sentences), {args.every} leaving at a time, one "
        f"search per turn (top 8, floor 0.25); all-MiniLM-L6-v2 on CPU ({res['embed_dtype']}, {res['embed_threads']} torch threads while embedding, {res['torch_threads']} otherwise), "
        f"sqlite-vec + FTS5 in a SQLite file; {res['machine']}; load average {load0[0]:.2f} before, "
        f"{res['load_average_after']:.2f} after.", "",
        "| figure | all turns | last 50 turns |", "|---|---|---|",
        f"| indexing, ms per turn (a batch / {args.every}) | {res['index_ms_per_turn_mean']:.1f} | "
        f"{res['index_ms_per_turn_mean_last50']:.1f} |",
        f"| search, ms per turn | {res['search_ms_mean']:.1f} (p50 {res['search_ms_p50']:.1f}, p95 "
        f"{res['search_ms_p95']:.1f}) | {res['search_ms_mean_last50']:.1f} |",
        f"| **memory cost per turn (indexing + search), ms** | **{res['per_turn_ms_mean']:.1f}** | "
        f"**{res['per_turn_ms_mean_last50']:.1f}** |",
        f"| the same in CPU time of this process (all its threads), ms | {res['per_turn_cpu_ms_mean']:.1f} | "
        f"{res['per_turn_cpu_ms_mean_last50']:.1f} |",
        f"| hybrid: ranking 20 kept turns (cached embeddings), ms per turn | {res['hybrid_rank_ms_mean']:.1f} | |",
        "", "| phase | ms per turn |", "|---|---|",
        *[f"| {k} | {v:.2f} |" for k, v in sorted(phases.items())],
        "", f"One bm25s rebuild over the {n_sent} sentences (what a lazy rebuild would cost per search after each "
        f"batch): {rebuild_ms:.1f} ms; FTS5's incremental index pays only the new rows (in `store` above).", ""])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(args.out + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
