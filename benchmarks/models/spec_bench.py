#!/usr/bin/env python
"""Speculative decoding from the conversation itself (issue 30): kvkeeper with and without n-gram speculation and
with a prediction, beside llama.cpp with and without its prompt lookup decoding, on the embedded GGUF file.

Workloads (greedy; every turn's prompt ids are rendered once with kvkeeper's chat template, the assistant turns being
kvkeeper's plain replies, so every engine sees the same ids and each reuses its own cache of the previous turn):

* ``copy``: copy-heavy two-turn chats built from the repository's data: a Pride and Prejudice passage with typos
  to correct and return whole, then a name to replace; code of this repository with a rename asked for, then a
  docstring; a summary quoting its source; a tool result (JSON built from ``data/lm_eval_tiny``) echoed back;
* ``predicted``: the passage and the code turns again, the client sending the text it expects back as the
  request's ``prediction`` (OpenAI's Predicted Outputs; kvkeeper only);
* ``open``: MT-Bench chats (``data/mt_bench``, both turns, the second asked after kvkeeper's plain first reply);
* ``streams``: 16 concurrent requests (the copy chats' and MT-Bench first turns), throughput.

Figures: decode tok/s per turn ((tokens - 1) / (last token - first token)), summed over a workload's turns as
tokens over seconds; TTFT; acceptance rate (accepted / drafted tokens) and mean accepted length (tokens per verify
row: 1 + accepted / drafts, vLLM's mean acceptance length); whether greedy outputs with speculation equal those
without (they must, token for token); the load average before and after.  The single-stream decode limit is
(read bandwidth measured here) / (bytes a decode step reads: the file's tensors plus the context's KV,
``files_bench.file_bytes``): speculation may pass it, since one step emits several tokens.

Usage::

    .venv/bin/python benchmarks/models/spec_bench.py [--k 8] [--method ngram|suffix] [--threads 2]
        [--llama-python PYTHON_WITH_LLAMA_CPP] [--no-llama] [--quick]

The report states each of issue 30's targets as met or missed (copy-heavy >= 1.8x plain and >= 1.2x llama.cpp with
prompt lookup, open-ended >= 0.97x, 16 streams >= 1.0x, copy-heavy single-stream decode above the one-token
bandwidth limit), kvkeeper's copy-heavy decode over llama.cpp plain and llama.cpp lookup over plain, and how many of
kvkeeper's greedy tokens llama.cpp's match before they part.

Writes ``benchmarks/results/spec_bench/spec_bench-smollm2-135m-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import RESULTS, cpu_model, result_name, write_report  # noqa: E402
from files_bench import file_bytes, read_bandwidth_gb_s  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
LLAMA_WORKER = Path(__file__).resolve().parent / "engine" / "spec_llama_worker.py"
# issue 30's targets: copy decode vs plain and vs llama.cpp lookup, open-ended vs plain, 16 streams vs plain
TARGETS = {"copy_vs_plain": 1.8, "copy_vs_llama_lookup": 1.2, "open_vs_plain": 0.97, "streams_vs_plain": 1.0}


def _passage(start: str, chars: int) -> str:
    text = (DATA / "gutenberg_pride_and_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    i = text.index(start)
    return " ".join(text[i:i + chars].split())


def _code() -> str:
    src = (ROOT / "src" / "kvkeeper" / "kvcache" / "manager.py").read_text()
    i = src.index("    def allocate(")
    return src[i:src.index("    def free(", i)].rstrip()


def _tool_json() -> str:
    rows = [json.loads(line) for line in (DATA / "lm_eval_tiny" / "tiny_facts.jsonl").read_text().splitlines()[:6]]
    return json.dumps([{"id": i, "fact": r["question"] + r["choices"][r["answer"]]} for i, r in enumerate(rows)],
                      indent=1)


def copy_chats() -> list[dict]:
    """The copy-heavy chats: name, user turns, and the text a client would send as the prediction (or None)."""
    story = _passage("It is a truth universally acknowledged", 620)
    typos = story.replace("acknowledged", "acknowleged").replace("neighbourhood", "neighborhod").replace(
        "property", "propery")
    code = _code()
    source = _passage("Mr. Bennet was among the earliest", 700)
    return [
        {"name": "revise passage", "prediction": typos,
         "turns": [f"Correct the spelling mistakes in this passage and return the whole corrected passage, nothing "
                   f"else:\n\n{typos}", "Now replace every \"Mr. Bennet\" with \"Mr. Smith\" and return the whole "
                   "passage again."]},
        {"name": "edit code", "prediction": code,
         "turns": [f"Rename the parameter `seq` to `sequence` in this Python code and return the whole code:\n\n"
                   f"```python\n{code}\n```", "Now return the whole code again with a comment above each method."]},
        {"name": "quote source", "prediction": None,
         "turns": [f"Here is a source text:\n\n{source}\n\nWrite a short summary of it that quotes its first two "
                   "sentences exactly.", "Now quote its last sentence exactly as well."]},
        {"name": "echo tool result", "prediction": None,
         "turns": [f"The search tool returned:\n\n{_tool_json()}\n\nRepeat the tool result back to me, exactly, "
                   "as the same JSON.", "Return only the entries with an even id, same JSON format."]},
    ]


def open_chats(n: int) -> list[dict]:
    qs = [json.loads(line) for line in (DATA / "mt_bench" / "question.jsonl").read_text().splitlines() if line]
    return [{"name": f"mt-bench {q['question_id']}", "prediction": None, "turns": q["turns"]} for q in qs[:n]]


class Kvk:
    """One kvkeeper engine (plain or speculating) and the per-turn figures of its requests."""

    def __init__(self, spec: dict | None, threads: int):
        from kvkeeper import LLMEngine

        self.engine = LLMEngine(quantization="gguf", num_threads=threads, max_model_len=4096,
                                speculative_config=spec)
        self.spec = spec

    def run(self, ids: list[int], max_tokens: int, ns, prediction: str | None = None):
        from kvkeeper import SamplingParams

        seq = self.engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                          prediction=prediction), namespace=ns)
        self.engine.run_until_done([seq])
        return seq

    def stats(self) -> dict:
        s = self.engine.drafter.stats
        return {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_tokens}


def turn_figures(seq) -> dict:
    n = seq.num_output_tokens
    return {"ttft_s": seq.t_first_token - seq.t_arrival, "decode_s": seq.t_last_token - seq.t_first_token,
            "tokens": n, "prompt_tokens": seq.num_prompt_tokens, "cached_tokens": seq.num_cached_tokens or 0}


def summary(turns: list[dict], before: dict | None = None, after: dict | None = None) -> dict:
    """Tokens over seconds of decode summed over the turns, mean TTFT, and the acceptance figures of the counters'
    change (``before`` / ``after`` of :meth:`Kvk.stats`)."""
    dec_tokens = sum(t["tokens"] - 1 for t in turns)
    dec_s = sum(t["decode_s"] for t in turns)
    out = {"turns": len(turns), "tokens": sum(t["tokens"] for t in turns),
           "decode_tok_s": dec_tokens / dec_s if dec_s else None,
           "mean_ttft_s": sum(t["ttft_s"] for t in turns) / len(turns)}
    if before is not None:
        d = {k: after[k] - before[k] for k in after}
        out.update(draft_tokens=d["draft_tokens"], accepted_tokens=d["accepted"],
                   acceptance_rate=d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None,
                   mean_accepted_length=1 + d["accepted"] / d["drafts"] if d["drafts"] else None)
    return out


def run_chats(chats: list[dict], plain: Kvk, spec: Kvk, max_tokens: int, with_prediction: bool) -> dict:
    """Each chat's turns on the plain and the speculating engine (the same prompt ids, each engine's own cache),
    optionally a third run sending the prediction; returns the figures and each turn's prompt ids."""
    res = {"plain": [], "spec": [], "predicted": [], "identical": True, "prompts": []}
    before = spec.stats()
    pred_before = None
    for i, chat in enumerate(chats):
        msgs, ids_of_chat = [], []
        ns = {k: e.engine.isolated_namespace(f"c{i}{k}") for k, e in (("p", plain), ("s", spec))}
        ns_pred = spec.engine.isolated_namespace(f"c{i}pred")
        for text in chat["turns"]:
            msgs.append({"role": "user", "content": text})
            ids = plain.engine.encode_chat(msgs)
            ids_of_chat.append(ids)
            a = plain.run(ids, max_tokens, ns["p"])
            b = spec.run(ids, max_tokens, ns["s"])
            res["identical"] &= a.output_token_ids == b.output_token_ids
            res["plain"].append(turn_figures(a) | {"chat": chat["name"]})
            res.setdefault("plain_ids", []).append({"ids": list(a.output_token_ids)})
            res["spec"].append(turn_figures(b) | {"chat": chat["name"], "accepted": b.spec.accepted if b.spec else 0})
            if with_prediction and chat["prediction"]:
                pred_before = pred_before or spec.stats()
                c = spec.run(ids, max_tokens, ns_pred, prediction=chat["prediction"])
                res["identical"] &= a.output_token_ids == c.output_token_ids
                res["predicted"].append(turn_figures(c) | {"chat": chat["name"],
                                                           "prediction_accepted": c.spec.prediction_accepted,
                                                           "prediction_rejected": c.spec.prediction_rejected})
            msgs.append({"role": "assistant", "content": a.text})
        res["prompts"].append(ids_of_chat)
    after = spec.stats()
    res["summary"] = {"plain": summary(res["plain"]), "spec": summary(res["spec"], before, after)}
    if res["predicted"]:
        res["summary"]["predicted"] = summary(res["predicted"])
    return res


def run_streams(eng: Kvk, prompts: list[list[int]], max_tokens: int) -> dict:
    from kvkeeper import SamplingParams

    before = eng.stats()
    ns = eng.engine.isolated_namespace("streams")
    t0 = time.perf_counter()
    seqs = [eng.engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), namespace=ns)
            for ids in prompts]
    eng.engine.run_until_done(seqs)
    wall = time.perf_counter() - t0
    out = summary([turn_figures(s) for s in seqs], before, eng.stats())
    out.update(wall_s=wall, throughput_tok_s=sum(s.num_output_tokens for s in seqs) / wall, streams=len(seqs))
    return out, [list(s.output_token_ids) for s in seqs]


def run_llama(python: str, model: str, chats: list[list[list[int]]], lookup: dict | None, a, eos) -> dict:
    job = {"model": model, "threads": a.threads, "n_ctx": 4096, "lookup": lookup, "eos": sorted(eos),
           "max_tokens": a.max_tokens, "chats": chats}
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    p = subprocess.run([python, str(LLAMA_WORKER)], input=json.dumps(job), capture_output=True, text=True,
                       timeout=3600, env=env, cwd=str(ROOT))
    if p.returncode != 0:
        return {"failed": f"exit {p.returncode}: {p.stderr[-1500:]}"}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["summary"] = summary(res["turns"])
    return res


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (default 8)")
    ap.add_argument("--method", choices=("ngram", "suffix"), default="ngram",
                    help="kvkeeper's speculative method (default ngram; suffix also drafts from the namespace's "
                         "earlier requests)")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--open-chats", type=int, default=6)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--llama-python", default=sys.executable, help="the Python that has llama-cpp-python")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--quick", action="store_true", help="two copy chats, two open chats, 60 tokens")
    ap.add_argument("--out", type=Path, default=RESULTS / "spec_bench")
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    if a.quick:
        a.max_tokens, a.open_chats = 60, 2
    torch.set_num_threads(a.threads)
    spec_cfg = {"method": a.method, "num_speculative_tokens": a.k, "prompt_lookup_max": a.lookup_max,
                "prompt_lookup_min": a.lookup_min}
    res = {"cpu": cpu_model(), "threads": a.threads, "loadavg_start": os.getloadavg(), "started": time.time(),
           "speculative_config": spec_cfg, "max_tokens": a.max_tokens, "read_gb_s": read_bandwidth_gb_s(a.threads)}
    plain, spec = Kvk(None, a.threads), Kvk(spec_cfg, a.threads)
    eng = plain.engine
    res["model"] = str(eng.model_path)
    res["weights"] = eng.runner.weight_description
    plain.run(eng.encode_chat([{"role": "user", "content": "Hi"}]), 4, None)  # warm-up
    spec.run(eng.encode_chat([{"role": "user", "content": "Hi"}]), 4, None)
    copies = copy_chats()[:2] if a.quick else copy_chats()
    res["copy"] = run_chats(copies, plain, spec, a.max_tokens, with_prediction=True)
    res["open"] = run_chats(open_chats(a.open_chats), plain, spec, a.max_tokens, with_prediction=False)
    firsts = [c[0] for c in res["copy"]["prompts"]] + [c[0] for c in res["open"]["prompts"]]
    more = [eng.encode_chat([{"role": "user", "content": c["turns"][0]}]) for c in open_chats(a.streams)]
    stream_prompts = (firsts + more)[: a.streams]
    res["streams"] = {"runs": []}
    outs = {}
    for _ in range(2):  # interleaved, twice: this machine's load moves between runs
        for name, e in (("plain", plain), ("spec", spec)):
            got, outs[name] = run_streams(e, stream_prompts, a.max_tokens // 2)
            res["streams"]["runs"].append({"engine": name, **got})
    for name in ("plain", "spec"):
        runs = [r for r in res["streams"]["runs"] if r["engine"] == name]
        res["streams"][name] = {**runs[-1], "throughput_tok_s": sum(r["throughput_tok_s"] for r in runs) / len(runs),
                                "throughput_runs": [r["throughput_tok_s"] for r in runs]}
    res["streams"]["identical"] = outs["plain"] == outs["spec"]
    ctx = sum(t["prompt_tokens"] + t["tokens"] / 2 for t in res["copy"]["plain"]) / len(res["copy"]["plain"])
    res["bytes"] = file_bytes(str(eng.model_path), eng.kv.bytes_per_token, int(ctx))
    if not a.no_llama:
        res["llama"] = {}
        for name, lookup in (("plain", None), ("lookup", {"num_pred_tokens": a.k, "max_ngram_size": a.lookup_max})):
            res["llama"][name] = {w: run_llama(a.llama_python, str(eng.model_path), res[w]["prompts"], lookup, a,
                                               eng.eos_token_ids) for w in ("copy", "open")}
        for w in ("copy", "open"):  # how far llama.cpp's greedy tokens follow kvkeeper's plain ones
            ours = [t["ids"] for t in res[w]["plain_ids"]] if "plain_ids" in res[w] else None
            for name in ("plain", "lookup"):
                got = res["llama"][name][w]
                if ours is None or "turns" not in got:
                    continue
                same = sum(_common_prefix(x, t["ids"]) for x, t in zip(ours, got["turns"]))
                got["common_prefix_tokens"] = same
                got["kvkeeper_tokens"] = sum(len(x) for x in ours)
    res["loadavg_end"] = os.getloadavg()
    name = result_name("spec_bench")
    write_report(a.out, name, res, report(res))
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _met(x, target) -> str:
    return "n/a" if x is None else f"{x:.2f}x (target {target}x: {'met' if x >= target else 'missed'})"


def _f(x, nd=1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def report(r: dict) -> str:
    copy, opn, st = r["copy"]["summary"], r["open"]["summary"], r["streams"]
    limit = r["read_gb_s"] * 1e9 / r["bytes"]["read_per_step"]
    lines = [f"# Speculative decoding (issue 30), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(r['started']))}",
             "", f"{r['cpu']}, {r['threads']} threads; load average {r['loadavg_start'][0]:.1f} at the start, "
             f"{r['loadavg_end'][0]:.1f} at the end (a shared machine: figures move between runs).  Model "
             f"{Path(r['model']).name} ({r['weights']}); speculative config {json.dumps(r['speculative_config'])}; "
             f"greedy, up to {r['max_tokens']} tokens a turn.", "",
             "| workload | engine | decode tok/s | vs plain | mean TTFT s | acceptance | mean accepted length |",
             "|---|---|---|---|---|---|---|"]
    for wname, s in (("copy-heavy", copy), ("open-ended (MT-Bench)", opn)):
        base = s["plain"]["decode_tok_s"]
        for ename in ("plain", "spec", "predicted"):
            if ename not in s:
                continue
            x = s[ename]
            label = {"plain": "kvkeeper", "spec": f"kvkeeper + {r['speculative_config']['method']}",
                     "predicted": "kvkeeper + prediction"}[ename]
            lines.append(f"| {wname} | {label} | {_f(x['decode_tok_s'])} | {_f(x['decode_tok_s'] / base, 2)}x | "
                         f"{_f(x['mean_ttft_s'], 3)} | {_f(x.get('acceptance_rate'), 2)} | "
                         f"{_f(x.get('mean_accepted_length'), 2)} |")
        key = "copy" if wname.startswith("copy") else "open"
        for lname, lres in (r.get("llama") or {}).items():
            x = lres[key].get("summary")
            if x is None:
                lines.append(f"| {wname} | llama.cpp {lname} | failed | | | | |")
                continue
            lines.append(f"| {wname} | llama.cpp{' + prompt lookup' if lname == 'lookup' else ''} | "
                         f"{_f(x['decode_tok_s'])} | {_f(x['decode_tok_s'] / base, 2)}x | {_f(x['mean_ttft_s'], 3)} "
                         "| | |")
    lines += ["", f"Greedy outputs with speculation (and with a prediction) identical to without: copy "
              f"{r['copy']['identical']}, open {r['open']['identical']}, streams {st['identical']}.", "",
              f"{st['plain']['streams']} concurrent streams (two interleaved runs each, mean): throughput "
              f"{_f(st['plain']['throughput_tok_s'])} tok/s plain ({', '.join(_f(x) for x in st['plain']['throughput_runs'])}), "
              f"{_f(st['spec']['throughput_tok_s'])} tok/s with speculation "
              f"({', '.join(_f(x) for x in st['spec']['throughput_runs'])}) "
              f"({_f(st['spec']['throughput_tok_s'] / st['plain']['throughput_tok_s'], 2)}x; acceptance "
              f"{_f(st['spec'].get('acceptance_rate'), 2)}, {st['spec'].get('draft_tokens')} draft tokens).", "",
              f"Single-stream decode limit here: {r['read_gb_s']:.1f} GB/s read bandwidth / "
              f"{r['bytes']['read_per_step'] / 1e6:.1f} MB per decode step = {limit:.0f} tok/s; copy-heavy decode with "
              f"speculation reached {_f(copy['spec']['decode_tok_s'] / limit, 2)}x of it, without "
              f"{_f(copy['plain']['decode_tok_s'] / limit, 2)}x."]
    llama = r.get("llama") or {}
    ll = llama.get("lookup", {}).get("copy", {}).get("summary")
    lp = llama.get("plain", {}).get("copy", {}).get("summary")
    ratio = lambda x, y: None if x is None or not y else x / y  # noqa: E731
    spec = copy["spec"]["decode_tok_s"]
    lines += ["", "Targets (issue 30):",
              f"- copy-heavy decode, kvkeeper + {r['speculative_config']['method']} / kvkeeper plain: "
              f"{_met(ratio(spec, copy['plain']['decode_tok_s']), TARGETS['copy_vs_plain'])}"]
    if ll:
        lines.append(f"- copy-heavy decode, kvkeeper + {r['speculative_config']['method']} / llama.cpp + prompt "
                     f"lookup: {_met(ratio(spec, ll['decode_tok_s']), TARGETS['copy_vs_llama_lookup'])}; / llama.cpp "
                     f"plain: {_f(ratio(spec, lp and lp['decode_tok_s']), 2)}x; llama.cpp lookup / llama.cpp plain: "
                     f"{_f(ratio(ll['decode_tok_s'], lp and lp['decode_tok_s']), 2)}x")
    lines += [f"- open-ended decode / plain: {_met(ratio(opn['spec']['decode_tok_s'], opn['plain']['decode_tok_s']), TARGETS['open_vs_plain'])}",
              f"- {st['plain']['streams']} streams throughput / plain: "
              f"{_met(ratio(st['spec']['throughput_tok_s'], st['plain']['throughput_tok_s']), TARGETS['streams_vs_plain'])}",
              f"- copy-heavy single-stream decode with speculation / one-token bandwidth limit: "
              f"{_met(ratio(spec, limit), 1.0)}"]
    for lname, lres in llama.items():
        for w in ("copy", "open"):
            x = lres.get(w, {})
            if "common_prefix_tokens" in x:
                lines.append(f"- llama.cpp {lname}, {w}: {x['common_prefix_tokens']} of kvkeeper's "
                             f"{x['kvkeeper_tokens']} greedy tokens the same before the first difference (per turn, "
                             f"summed): the engines' arithmetic differs, so their greedy paths part")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
