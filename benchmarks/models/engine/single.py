"""Section 4, single-stream decode: one prompt, K new tokens, against transformers ``generate`` and llama.cpp."""

from __future__ import annotations

import time
import traceback

from kvkeeper import LLMEngine, SamplingParams

from .base import BenchConfig, TARGET_DECODE_VS_LLAMA, TARGET_SINGLE_STREAM, _err, _ratio, log
from .peers import TimingStreamer, _first_divergence, _until_eos, hf_generate, llama_cpp_stream


def bench_single(engine: LLMEngine, hf, question: dict, bc: BenchConfig, llm=None) -> dict:
    ids = engine.encode_chat([{"role": "user", "content": question["turns"][0]}])
    N = bc.single_new_tokens
    log(f"single-stream: kvkeeper, {len(ids)} prompt tokens, {N} new")
    engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True), namespace=engine.isolated_namespace("w"))
    t0 = time.perf_counter()
    o = engine.generate([ids], SamplingParams(max_tokens=N, ignore_eos=True),
                        namespace=engine.isolated_namespace("single"))[0]
    wall = time.perf_counter() - t0
    res = {"prompt": f"MT-Bench question {question['question_id']} first turn, chat template",
           "prompt_tokens": len(ids), "new_tokens": N,
           "kvkeeper": {"ttft_s": o.ttft_s, "decode_tok_per_s": o.decode_tok_per_s, "wall_s": wall,
                        "tokens": o.completion_tokens}}
    if hf is not None:
        log("single-stream: transformers generate")
        hf_generate(hf, ids, 8, 8)  # warm-up
        st = TimingStreamer()
        t0 = time.perf_counter()
        out = hf_generate(hf, ids, N, N, streamer=st)
        wall = time.perf_counter() - t0
        toks = out[0, len(ids):].tolist()
        n = len(st.times)
        dec = (n - 1) / (st.times[-1] - st.times[0]) if n > 1 and st.times[-1] > st.times[0] else None
        res["transformers_generate"] = {"ttft_s": st.times[0] - t0 if st.times else None, "decode_tok_per_s": dec,
                                        "wall_s": wall, "tokens": len(toks),
                                        "timing": "streamer timestamps: (n-1)/(t_last - t_first), as kvkeeper"}
        kv_cmp = _until_eos(o.token_ids, engine.eos_token_ids)
        res["greedy_tokens_equal"] = kv_cmp == toks[: len(kv_cmp)]
        res["greedy_compared_tokens"] = len(kv_cmp)
        res["greedy_first_divergence"] = _first_divergence(kv_cmp, toks[: len(kv_cmp)])
        res["greedy_note"] = ("compared up to kvkeeper's first EOS: after it kvkeeper (ignore_eos) keeps the EOS "
                              "token while transformers (min_new_tokens) masks it")
    if llm is not None:
        log("single-stream: llama.cpp")
        try:
            llama_cpp_stream(llm, ids, 8)  # warm-up
            res["llama_cpp"] = llama_cpp_stream(llm, ids, N)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["llama_cpp"] = {"failed": _err(e)}
    rl = _ratio(o.decode_tok_per_s, (res.get("llama_cpp") or {}).get("decode_tok_per_s"))
    res["ratio_kvkeeper_over_llama_cpp"] = rl
    res["target_llama_cpp"] = {"metric": "kvkeeper decode tok/s / llama.cpp decode tok/s, short chat prompt",
                               "target": TARGET_DECODE_VS_LLAMA, "measured": rl,
                               "met": None if rl is None else rl >= TARGET_DECODE_VS_LLAMA}
    r = _ratio(o.decode_tok_per_s, (res.get("transformers_generate") or {}).get("decode_tok_per_s"))
    res["ratio_kvkeeper_over_transformers"] = r
    res["target"] = {"metric": "kvkeeper decode tok/s / transformers generate decode tok/s",
                     "target": TARGET_SINGLE_STREAM, "measured": r,
                     "met": None if r is None else r >= TARGET_SINGLE_STREAM}
    return res
