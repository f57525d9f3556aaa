"""Section 5, long context: a 7,000-token prompt (Pride and Prejudice), prefill then decode, against llama.cpp."""

from __future__ import annotations

import gc
import time
import traceback

from kvkeeper import LLMEngine, SamplingParams

from .base import BenchConfig, ROOT, TARGET_DECODE_VS_LLAMA, TARGET_PREFILL_VS_LLAMA, _err, _ratio, log
from .peers import llama_cpp_stream


BOOK = ROOT / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"


def book_tokens(engine: LLMEngine, n: int, skip: int = 2000) -> list[int]:
    ids = engine.tokenizer.encode(BOOK.read_text(encoding="utf-8"), add_special_tokens=False)
    return ids[skip: skip + n]


def bench_long(engine: LLMEngine, llm, llm_status: str, bc: BenchConfig) -> dict:
    """Prefill of a long raw-text prompt (time to first token), then decode after it; kvkeeper vs llama.cpp."""
    n, m = bc.long_prompt_tokens, bc.long_new_tokens
    ids = book_tokens(engine, n)
    log(f"long context: kvkeeper, {len(ids)}-token prompt, {m} new tokens")
    engine.generate([ids[:300]], SamplingParams(max_tokens=4), namespace=engine.isolated_namespace("w"))
    t0 = time.perf_counter()
    o = engine.generate([ids], SamplingParams(max_tokens=m + 1, ignore_eos=True),
                        namespace=engine.isolated_namespace("long"))[0]
    res = {"prompt": f"{BOOK.relative_to(ROOT)}, tokens 2000..{2000 + len(ids)} (raw text)",
           "prompt_tokens": len(ids), "new_tokens": m + 1,
           "kvkeeper": {"prefill_s": o.ttft_s, "decode_tok_per_s": o.decode_tok_per_s,
                        "wall_s": time.perf_counter() - t0, "tokens": o.completion_tokens,
                        "kv_dtype": engine.runner.kv_format.name},
           "llama_cpp_status": llm_status}
    if llm is not None:
        log("long context: llama.cpp")
        try:
            r = llama_cpp_stream(llm, ids, m + 1)
            res["llama_cpp"] = {"prefill_s": r["ttft_s"], "decode_tok_per_s": r["decode_tok_per_s"],
                                "wall_s": r["wall_s"], "tokens": r["tokens"]}
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["llama_cpp"] = {"failed": _err(e)}
    # the other KV precision, for comparison (no target): float32 when the default is 16-bit (quantized weights keep
    # bf16 KV, as llama.cpp keeps f16), else bfloat16
    other = "fp32" if engine.runner.kv_format.name in ("bfloat16", "float16") else "bf16"
    log(f"long context: kvkeeper with a {other} KV cache")
    try:
        eng2 = LLMEngine(str(engine.model_path), quantization=engine.runner.weight_format, kv_dtype=other,
                         kv_cache_bytes=512 << 20)
        eng2.generate([ids[:300]], SamplingParams(max_tokens=4), namespace=eng2.isolated_namespace("w"))
        o2 = eng2.generate([ids], SamplingParams(max_tokens=m + 1, ignore_eos=True),
                           namespace=eng2.isolated_namespace("long"))[0]
        res["kvkeeper_other_kv"] = {"prefill_s": o2.ttft_s, "decode_tok_per_s": o2.decode_tok_per_s,
                                    "tokens": o2.completion_tokens, "kv_dtype": eng2.runner.kv_format.name}
        del eng2
        gc.collect()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["kvkeeper_other_kv"] = {"failed": _err(e), "kv_dtype": other}
    lc = res.get("llama_cpp") or {}
    note = "targets defined for 7,000 tokens (full run)" if bc.quick else ""
    pf = _ratio(lc.get("prefill_s"), o.ttft_s)
    dc = _ratio(o.decode_tok_per_s, lc.get("decode_tok_per_s"))
    res["target_prefill"] = {"metric": f"llama.cpp prefill time / kvkeeper prefill time, {len(ids)}-token prompt",
                             "target": TARGET_PREFILL_VS_LLAMA, "measured": pf,
                             "met": None if pf is None else pf >= TARGET_PREFILL_VS_LLAMA, "note": note}
    res["target_decode"] = {"metric": f"kvkeeper decode tok/s / llama.cpp decode tok/s after {len(ids)} tokens",
                            "target": TARGET_DECODE_VS_LLAMA, "measured": dc,
                            "met": None if dc is None else dc >= TARGET_DECODE_VS_LLAMA, "note": note}
    return res
