"""Section 0, weight formats (none, gguf, int8, int4): bytes per weight, resident memory (a fresh process each),
single-stream decode, perplexity at 4k tokens, greedy agreement with the float32 path."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch

from kvkeeper import LLMEngine, SamplingParams

from .base import BenchConfig, ROOT, TARGET_AGREEMENT, TARGET_PPL_REL, _err, log
from .long_context import BOOK, book_tokens
from .roofline import model_costs


FORMATS = ("none", "gguf", "int8", "int4")
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "Photosynthesis is the process by which"]


def measure_rss(model: str | None, fmt: str) -> dict:
    """Resident memory of a fresh process after loading an engine in ``fmt`` (small KV pool: 64 blocks)."""
    import subprocess

    import kvkeeper as _k

    code = ("import json, sys, torch\n"
            "from kvkeeper import LLMEngine\n"
            "def kb(key):\n"
            "    for line in open('/proc/self/status'):\n"
            "        if line.startswith(key): return int(line.split()[1])\n"
            "before = kb('VmRSS:')\n"
            "e = LLMEngine(sys.argv[1] or None, quantization=sys.argv[2], num_kv_blocks=64)\n"
            "import gc; gc.collect()\n"
            "after = kb('VmRSS:')\n"
            "from kvkeeper import SamplingParams\n"
            "e.generate(['Hello'], SamplingParams(max_tokens=2))\n"
            "print(json.dumps({'rss_after_load_mib': after / 1024, 'rss_after_first_tokens_mib': kb('VmRSS:') / 1024,\n"
            "                  'peak_rss_mib': kb('VmHWM:') / 1024,\n"
            "                  'rss_before_load_mib': before / 1024, 'format': e.runner.weight_format,\n"
            "                  'kv_pool_mib': e.pool.num_blocks * e.block_size * e.kv.bytes_per_token / 2**20}))\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(_k.__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code, model or "", fmt], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        return {"failed": out.stderr.strip()[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def parity_prompts(engine: LLMEngine, questions: list[dict], n: int) -> list[list[int]]:
    """The parity test's prompts (tests/unit/engine/test_engine_real.py): both turns of the first MT-Bench questions
    (turn 2 after the engine's own greedy 24-token turn-1 reply) plus four raw text prompts; the first n of them."""
    firsts = [engine.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in questions[:10]]
    replies = engine.generate(firsts, SamplingParams(max_tokens=24), namespace=engine.isolated_namespace("pp"))
    prompts = []
    for q, ids, rep in zip(questions[:10], firsts, replies):
        prompts.append(ids)
        prompts.append(engine.encode_chat([{"role": "user", "content": q["turns"][0]},
                                           {"role": "assistant", "content": rep.text},
                                           {"role": "user", "content": q["turns"][1]}]))
    prompts += [engine.tokenizer.encode(p) for p in RAW_PROMPTS]
    return prompts[:n] if n < len(prompts) else prompts


@torch.inference_mode()
def argmax_all_positions(engine: LLMEngine, ids: list[int]) -> list[int]:
    """Greedy (top-1) token after every prefix of ids, teacher-forced: one prefill of ids, logits at each position."""
    from kvkeeper.engine.sequence import Sequence

    seq = Sequence("agree", list(ids), SamplingParams(max_tokens=1), engine.isolated_namespace("agree"))
    if not engine.kv.allocate(seq, len(ids)):
        raise RuntimeError("KV pool too small for the agreement check")
    try:
        r = engine.runner
        input_ids, positions, meta, _, _ = r.build_batch([(seq, len(ids))])
        hidden = r.model(input_ids, positions, r.kv_store, meta)
        return r.model.compute_logits(hidden).argmax(-1).tolist()
    finally:
        engine.kv.free(seq)


def single_decode_tok_s(engine: LLMEngine, ids: list[int], n: int) -> float | None:
    for _ in range(2):  # warm-up (the first steps after a load run slower)
        engine.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True), namespace=engine.isolated_namespace("w"))
    runs = [engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True),
                            namespace=engine.isolated_namespace("fmt"))[0].decode_tok_per_s for _ in range(2)]
    return max(r for r in runs if r is not None) if any(r is not None for r in runs) else None


def bench_formats(model: str | None, questions: list[dict], bc: BenchConfig, default_format: str) -> dict:
    """Every weight format against ``none`` (float32): memory, bytes per weight, decode speed, perplexity at
    bc.ppl_context tokens, and greedy agreement over the parity prompts (bc.agree_tokens tokens each)."""
    from kvkeeper.eval.perplexity import perplexity

    rows, ref = [], None
    single_ids = None
    for fmt in FORMATS:
        log(f"formats: {fmt}: resident memory (fresh process)")
        row = {"format": fmt, "memory": measure_rss(model, fmt)}
        try:
            eng = LLMEngine(model, quantization=fmt, kv_cache_bytes=512 << 20)
        except Exception as e:  # noqa: BLE001
            row["failed"] = _err(e)
            rows.append(row)
            continue
        row["runs"] = eng.runner.weight_format
        row["description"] = eng.runner.weight_description
        mc = model_costs(eng)
        row["weight_bytes_per_decode_step"] = mc["weight_bytes_per_decode_step"]
        row["bytes_per_weight"] = mc["weight_bytes_per_decode_step"] / max(mc["decode_params"], 1)
        if single_ids is None:
            single_ids = eng.encode_chat([{"role": "user", "content": questions[16]["turns"][0]}])
        log(f"formats: {fmt}: decode speed, perplexity, agreement")
        row["decode_tok_per_s"] = single_decode_tok_s(eng, single_ids, 128 if not bc.quick else 16)
        ids = book_tokens(eng, bc.ppl_context)
        p = perplexity(eng, ids)
        row["ppl"], row["ppl_tokens"], row["ppl_seconds"] = p["ppl"], p["tokens"], p["seconds"]
        prompts = parity_prompts(eng if ref is None else ref["engine"], questions, bc.agree_prompts)
        outs = eng.generate(prompts, SamplingParams(max_tokens=bc.agree_tokens),
                            namespace=eng.isolated_namespace("agree"))
        conts = [o.token_ids for o in outs]
        if ref is None:
            ref = {"engine": eng, "conts": conts, "ppl": p["ppl"], "prompts": prompts}
        else:
            same = sum(1 for a, b in zip(conts, ref["conts"]) if a == b)
            agree = total = 0
            for pr, cont in zip(ref["prompts"], ref["conts"]):
                if not cont:
                    continue
                top1 = argmax_all_positions(eng, pr + cont[:-1])[len(pr) - 1:]
                agree += sum(1 for a, b in zip(top1, cont) if a == b)
                total += len(cont)
            row["identical_continuations"] = f"{same}/{len(conts)}"
            row["identical_fraction"] = same / len(conts)
            row["top1_agreement"] = agree / total if total else None
            row["top1_positions"] = total
            row["ppl_vs_none"] = p["ppl"] / ref["ppl"] - 1
            del eng
        rows.append(row)
        gc.collect()
    ref.pop("engine", None)
    by = {r["format"]: r for r in rows}
    d = by.get(default_format) or {}
    res = {"formats": rows, "default": default_format,
           "ppl_text": f"{BOOK.relative_to(ROOT)}, {bc.ppl_context} tokens after the first 2000, chunks of 512",
           "agreement": f"{len(ref['prompts']) if ref else 0} parity prompts (tests/unit/engine/test_engine_real.py), "
                        f"{bc.agree_tokens} greedy tokens; top-1 agreement teacher-forced on the float32 continuation"}
    if default_format != "none" and d.get("ppl_vs_none") is not None:
        res["target_ppl"] = {"metric": f"perplexity of the default format ({default_format}) / float32 - 1",
                             "target": TARGET_PPL_REL, "op": "<=abs", "measured": d["ppl_vs_none"],
                             "met": abs(d["ppl_vs_none"]) <= TARGET_PPL_REL}
        res["target_agreement"] = {"metric": f"per-position top-1 agreement of {default_format} with float32",
                                   "target": TARGET_AGREEMENT, "measured": d.get("top1_agreement"),
                                   "met": None if d.get("top1_agreement") is None
                                   else d["top1_agreement"] >= TARGET_AGREEMENT}
    return res
