"""Session compression over long conversations: KV held, cached share and recall (``kvkeeper.sessions.compress``).

Replays the memory-recall conversations (``kvkeeper eval memory``'s easy set, generated from
``data/topical_chat/test_freq_conversations.jsonl``; every user message in order with a one-token reply, the planted
facts asked at their places, ``replay="turns"``) through sessions of one in-process engine under the ``full`` context
policy, first without compression (the baseline), then under each session compression policy at each ratio.
After every request it records the KV entries the session holds (per layer and KV head) and the tokens they cover
(the uncompressed session's entries), and at each question whether the answer's tokens still have KV: the benchmark
follows the true position of every KV entry (per layer and KV head) through each turn's compression (the indices the
policy selected) and reports the share of (layer, head, answer token) entries kept, ``answer_in_kv``.  The prompt
itself always holds the whole history under ``full``, so ``answer_in_prompt`` is 1.0 by construction; it is reported
for the table's sake beside the context policies' figures (docs/serving/context-policies.md).

Targets (issue 27, at ratio 0.5): KV held per session <= 0.55x the uncompressed session's, cached share of prompt
tokens >= 0.9x the uncompressed session's.  Writes ``benchmarks/results/session_compression/session_compression-<model>-<date>.json``
and ``.md`` after each run.

    python benchmarks/kv/session_compression.py [--conversations 3] [--min-tokens 1500] [--ratios 0.5 0.75]
        [--policies streaming_llm knorm kvzip] [--kv-dtype int4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # common

from kvkeeper import LLMEngine  # noqa: E402
from kvkeeper.eval.memory_recall import LibraryBackend, generate, history_turns, load_dialogues, run  # noqa: E402
from kvkeeper.sessions import compress as compress_mod  # noqa: E402

SOURCE = ROOT / "data" / "topical_chat" / "test_freq_conversations.jsonl"
_CAPTURED: list[torch.Tensor] = []  # the indices the policy selected at the last compression, one (KVH, k) per layer
_select = compress_mod.select_entries


def _recording_select(*a, **kw):
    idx = _select(*a, **kw)
    _CAPTURED.append(idx.clone())
    return idx


compress_mod.select_entries = _recording_select


def answer_span(tok, ids: list[int], answer: str) -> tuple[int, int] | None:
    """Token positions [i, e) of the first occurrence of ``answer`` (case-insensitive) in ``ids``' text."""
    low = answer.lower()

    def has(a, b):
        return low in tok.decode(ids[a:b]).lower()

    if not has(0, len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:  # the shortest prefix holding the answer
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has(0, mid) else (mid + 1, hi)
    e = lo
    lo, hi = 0, e - 1
    while lo < hi:  # the latest start still holding it
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if has(mid, e) else (lo, mid - 1)
    return lo, e


class TrackingBackend(LibraryBackend):
    """LibraryBackend recording KV entries per request and the true positions each KV entry holds."""

    def __init__(self, engine, policy: str, ratio: float, max_tokens: int):
        super().__init__(engine, "full", 16, max_tokens, session_compression=policy,
                         session_compression_ratio=ratio)
        self.records: list[dict] = []
        self.positions: dict[str, list[torch.Tensor]] = {}  # session -> per layer (KVH, entries) true positions
        self.questions: dict[str, str] = {}  # set by the caller before a question: conv id -> answer

    def ask(self, conv_id: str, messages: list[dict], max_tokens: int | None = None) -> dict:
        eng = self.engine
        s = self.sessions.get(conv_id)
        if s is None:
            s = self.sessions[conv_id] = self.manager.open()
        seq = s.begin_turn(messages=messages, params=self.turn_params if max_tokens == 1 else self.params)
        mc = eng.model_config
        nc0 = seq.num_computed
        if seq.kv_offset and conv_id in self.positions:
            base = self.positions[conv_id]
        else:
            base = [torch.arange(nc0).expand(mc.num_kv_heads, nc0) for _ in range(mc.num_layers)]
        ids = seq.token_ids[: seq.num_prompt_tokens]
        in_kv = None
        answer = self.questions.pop(conv_id, None) if max_tokens is None else None
        if answer is not None:
            span = answer_span(eng.tokenizer, ids, answer)
            if span is not None:
                pos = torch.arange(*span)
                # an answer position at or past nc0 is computed in this turn (kept); before, it must be in ``base``
                got = [((pos[None, :, None] == b[:, None, :]).any(-1) | (pos >= nc0)[None]).float().mean().item()
                       for b in base]
                in_kv = sum(got) / len(got)
        _CAPTURED.clear()
        eng.run_until_done([seq])
        rep = s.last_compression if s.compression.active else None
        if rep is not None and s.kv is seq:
            T = rep.tokens
            full = [torch.cat([b, torch.arange(nc0, T).expand(b.shape[0], T - nc0)], dim=1) for b in base]
            if rep.applied:
                assert len(_CAPTURED) == mc.num_layers and full[0].shape[1] == rep.before
                full = [f.gather(1, i) for f, i in zip(full, _CAPTURED)]
            self.positions[conv_id] = full
        self.records.append({"conversation": conv_id, "question": max_tokens is None,
                             "kv_entries": s.kv_entries, "kv_tokens": s.kv.num_computed if s.kv is not None else 0,
                             "blocks": s.num_blocks, "handed_over": seq.num_handed_over,
                             "cached": seq.num_cached_tokens or 0, "prompt": len(ids), "answer_in_kv": in_kv})
        return {"prompt": eng.tokenizer.decode(ids), "reply": seq.text, "prompt_tokens": len(ids),
                "cached_tokens": seq.num_cached_tokens or 0, "memory_ms": 0.0, "summary_ms": 0.0, "context": None}


def replay(eng, convs, policy: str, ratio: float, max_tokens: int) -> tuple[dict, list[dict]]:
    be = TrackingBackend(eng, policy, ratio, max_tokens)
    real_ask = be.ask

    def ask(conv_id, messages, max_tokens=None):  # tell the backend the answer of the question it is asked
        if max_tokens is None:
            conv = next(c for c in convs if c["id"] == conv_id)
            q = next(q for q in conv["questions"] if q["question"] == messages[-1]["content"])
            be.questions[conv_id] = q["answer"]
        return real_ask(conv_id, messages, max_tokens)

    be.ask = ask
    r = run(convs, be, "full", None, replay="turns")
    r.pop("per_question")
    r.pop("per_turn")
    return r, be.records


def summarize(policy: str, ratio: float, r: dict, recs: list[dict], base: list[dict] | None) -> dict:
    out = {"policy": policy, "ratio": ratio, "requests": len(recs), "answer_in_prompt": r["answer_in_prompt"],
           "answer_in_reply": r["answer_in_reply"], "cached_share": r["cached_share"], "seconds": r["seconds"]}
    qs = [x["answer_in_kv"] for x in recs if x["question"] and x["answer_in_kv"] is not None]
    out["answer_in_kv"] = sum(qs) / len(qs) if qs else 1.0 if policy == "none" else None
    out["kv_share_of_tokens"] = sum(x["kv_entries"] for x in recs) / max(1, sum(x["kv_tokens"] for x in recs))
    if base is not None:
        ratios = [x["kv_entries"] / b["kv_entries"] for x, b in zip(recs, base) if b["kv_entries"]]
        blocks = [x["blocks"] / b["blocks"] for x, b in zip(recs, base) if b["blocks"]]
        out["kv_held_vs_uncompressed_mean"] = sum(ratios) / len(ratios)
        out["kv_held_vs_uncompressed_max"] = max(ratios)
        out["blocks_vs_uncompressed_mean"] = sum(blocks) / len(blocks)
        last = {}
        for x, b in zip(recs, base):
            last[x["conversation"]] = (x["kv_entries"], b["kv_entries"])
        out["kv_held_vs_uncompressed_end"] = sum(a / b for a, b in last.values()) / len(last)
    return out


def table(rows: list[dict], meta: dict) -> str:
    base = next((r for r in rows if r["policy"] == "none"), None)
    lines = [f"Session compression over {meta['conversations']} conversations of {meta['turns_mean']:.0f} user turns "
             f"on average (>= {meta['min_tokens']} tokens, mean {meta['mean_tokens']:.0f}; memory-recall easy set, "
             f"seed {meta['seed']}, {meta['questions']} questions), {meta['model']} ({meta['weights']}), greedy, "
             f"replay turns, context policy full; {meta['machine']}; load average {meta['load_average_start']:.1f} at "
             f"the start.  Command: `{meta['command']}`.", "",
             "| policy | ratio | KV held / uncompressed (mean over requests) | max | at the end | blocks / uncompressed | "
             "cached share | cached share / uncompressed | answer in prompt | answer tokens in KV | answer in reply | "
             "seconds | load average | KV target (<= 0.55) | cached target (>= 0.9x) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv = r.get("kv_held_vs_uncompressed_mean")
        cs = r["cached_share"] / base["cached_share"] if base and base["cached_share"] else float("nan")
        aik = r["answer_in_kv"]
        met_kv = "-" if r["policy"] == "none" or r["ratio"] != 0.5 else ("met" if kv <= 0.55 else "missed")
        met_cs = "-" if r["policy"] == "none" or r["ratio"] != 0.5 else ("met" if cs >= 0.9 else "missed")
        f = (lambda v: "-" if v is None else f"{v:.2f}")  # noqa: E731
        lines.append(f"| {r['policy']} | {r['ratio'] if r['policy'] != 'none' else '-'} | {f(kv) if kv else '1.00'} | "
                     f"{f(r.get('kv_held_vs_uncompressed_max')) if kv else '1.00'} | "
                     f"{f(r.get('kv_held_vs_uncompressed_end')) if kv else '1.00'} | "
                     f"{f(r.get('blocks_vs_uncompressed_mean')) if kv else '1.00'} | {r['cached_share']:.3f} | {cs:.3f} | "
                     f"{r['answer_in_prompt']:.2f} | {f(aik)} | {r['answer_in_reply']:.2f} | {r['seconds']:.0f} | "
                     f"{r['load_average']:.1f} | {met_kv} | {met_cs} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from common import result_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--min-tokens", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--policies", nargs="+", default=["streaming_llm", "knorm", "kvzip"])
    ap.add_argument("--kv-dtype", default=None, help="the engine's KV dtype (default: the engine's, bf16)")
    ap.add_argument("--out", default=str(result_path("session_compression", suffix="")), help="OUT.json and OUT.md")
    args = ap.parse_args()
    eng = LLMEngine(**({"kv_dtype": args.kv_dtype} if args.kv_dtype else {}))
    count = lambda t: len(eng.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    convs = generate(load_dialogues(SOURCE), args.conversations, args.min_tokens, count, args.seed)
    toks = [len(eng.encode_chat(c["messages"])) for c in convs]
    turns = [len(history_turns(c)) for c in convs]
    meta = {"conversations": len(convs), "min_tokens": args.min_tokens, "mean_tokens": sum(toks) / len(toks),
            "turns": turns, "turns_mean": sum(turns) / len(turns), "questions": sum(len(c["questions"]) for c in convs),
            "seed": args.seed, "model": eng.model_name, "weights": eng.runner.weight_description,
            "max_tokens": args.max_tokens, "load_average_start": os.getloadavg()[0],
            "kv_dtype": eng.runner.kv_format.name, "block_size": eng.block_size,
            "kv_bytes_per_token": eng.runner.kv_store.bytes_per_token,
            "machine": f"{platform.machine()}, 2 cores shared with other jobs",
            "command": "python benchmarks/kv/session_compression.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta), flush=True)
    rows, base_recs = [], None
    plan = [("none", 0.0)] + [(p, r) for r in args.ratios for p in args.policies]
    for policy, ratio in plan:
        t0 = time.perf_counter()
        r, recs = replay(eng, convs, policy, ratio, args.max_tokens)
        if policy == "none":
            base_recs = recs
        row = summarize(policy, ratio, r, recs, None if policy == "none" else base_recs)
        row["load_average"] = os.getloadavg()[0]
        rows.append(row)
        print(f"{policy}:{ratio}: {json.dumps(row)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
        Path(args.out + ".md").write_text(table(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
