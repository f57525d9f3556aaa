"""Section 3, batched decode: N concurrent chat prompts, M new tokens each, against transformers'
``generate_batch`` and padded ``generate``."""

from __future__ import annotations

import inspect
import time
import traceback

import torch

from kvkeeper import LLMEngine, SamplingParams

from .base import BenchConfig, TARGET_BATCHED_TOK_S, TARGET_BATCHED_VS_GENERATE_BATCH, _err, _ratio, log
from .peers import _until_eos


def kvkeeper_batched(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict:
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True),
                    namespace=engine.isolated_namespace("warm"))
    ns = engine.isolated_namespace("batched")
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    # same as engine.generate (add_request + step until done), stepping by hand to see when prefill ends
    seqs = [engine.add_request(p, sp, namespace=ns) for p in prompts]
    t_all_first, tok_at = None, 0
    while any(not s.finished for s in seqs):
        engine.step()
        if t_all_first is None and all(s.t_first_token is not None for s in seqs):
            t_all_first = time.perf_counter()
            tok_at = sum(s.num_output_tokens for s in seqs)
    t1 = time.perf_counter()
    total = sum(s.num_output_tokens for s in seqs)
    dec_t = t1 - t_all_first if t_all_first else None
    return {
        "wall_s": t1 - t0, "tokens": total, "tok_per_s": total / (t1 - t0),
        "prefill_phase_s": (t_all_first - t0) if t_all_first else None,
        "decode_only_tok_per_s": (total - tok_at) / dec_t if dec_t else None,
        "steps": engine.num_steps - steps0,
        "all_exact_length": all(s.num_output_tokens == new_tokens for s in seqs),
        "_outputs": [list(s.output_token_ids) for s in seqs],
    }


def hf_padded_generate(hf, prompts: list[list[int]], new_tokens: int) -> dict:
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])

    def run(n):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=2)

    run(2)  # warm-up
    t0 = time.perf_counter()
    run(1)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = run(new_tokens)
    wall = time.perf_counter() - t0
    gen = out[:, L:]
    total = gen.numel()
    dec = wall - t_prefill
    return {"wall_s": wall, "tokens": total, "tok_per_s": total / wall, "prefill_s (max_new_tokens=1)": t_prefill,
            "decode_only_tok_per_s": len(prompts) * (new_tokens - 1) / dec if dec > 0 else None,
            "padded_len": L, "all_exact_length": gen.shape[1] == new_tokens,
            "_outputs": gen.tolist()}


def hf_generate_batch(hf, prompts: list[list[int]], new_tokens: int, kv_budget_bytes: int, kv_bytes_per_token: int,
                      max_batch_tokens: int) -> dict:
    """transformers continuous batching.  Its KV cache is sized like kvkeeper's (same byte budget, same per-step
    token budget): left to its defaults on CPU it takes 60% of the machine's RAM (psutil) for the cache."""
    from transformers import GenerationConfig

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

    res: dict = {"signature": f"generate_batch{inspect.signature(hf.generate_batch)}"}
    # eos_token_id=-1 disables EOS in continuous batching, so every request makes exactly new_tokens tokens
    gc_ = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=2)
    gc_warm = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=2)
    page = ContinuousBatchingConfig().page_size  # tokens per block (all layers)
    num_blocks = max(len(prompts), kv_budget_bytes // (page * kv_bytes_per_token))
    label = (f"ContinuousBatchingConfig(num_blocks={num_blocks}, max_batch_tokens={max_batch_tokens}), "
             f"page_size={page}: {num_blocks * page * kv_bytes_per_token / 2**30:.2f} GiB KV, as kvkeeper's budget")

    def cbc():
        return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)

    try:
        hf.generate_batch(prompts[:2], generation_config=gc_warm, continuous_batching_config=cbc())
        t0 = time.perf_counter()
        out = hf.generate_batch(prompts, generation_config=gc_, continuous_batching_config=cbc(),
                                record_timestamps=True)
        wall = time.perf_counter() - t0
        outs = list(out.values())
        if len(outs) != len(prompts) or any(o.error for o in outs):
            errs = [o.error for o in outs if o.error]
            raise RuntimeError(f"{len(outs)}/{len(prompts)} results; errors: {errs[:2]}")
        total = sum(len(o.generated_tokens) for o in outs)
        res.update({"config": label, "wall_s": wall, "tokens": total, "tok_per_s": total / wall,
                    "all_exact_length": all(len(o.generated_tokens) == new_tokens for o in outs),
                    "_outputs": [list(o.generated_tokens) for o in outs]})
        stamps = [o.timestamps for o in outs if o.timestamps]
        if len(stamps) == len(outs):
            t_all_first = max(s[0] for s in stamps)
            t_end = max(s[-1] for s in stamps)
            after = sum(1 for s in stamps for t in s if t > t_all_first)
            res["decode_only_tok_per_s"] = after / (t_end - t_all_first) if t_end > t_all_first else None
            res["prefill_phase_s"] = t_all_first - min(o.created_time for o in outs)
            res["after_last_token_s"] = t0 + wall - t_end  # manager shutdown etc., inside the wall time
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res.update({"config": label, "failed": True, "errors": [_err(e)]})
    return res


def bench_batched(engine: LLMEngine, hf, questions: list[dict], bc: BenchConfig) -> dict:
    prompts = [engine.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in questions[: bc.batch]]
    M = bc.batch_new_tokens
    log(f"batched: kvkeeper, {len(prompts)} requests x {M} tokens")
    kv = kvkeeper_batched(engine, prompts, M)
    res = {"requests": len(prompts), "new_tokens_each": M, "prompt_tokens": [len(p) for p in prompts],
           "prompts_from": f"MT-Bench first turns {[q['question_id'] for q in questions[: bc.batch]]}, chat template",
           "kvkeeper": kv, "transformers_generate_padded": None, "transformers_generate_batch": None}
    if hf is not None:
        log("batched: transformers padded generate")
        try:
            res["transformers_generate_padded"] = hf_padded_generate(hf, prompts, M)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["transformers_generate_padded"] = {"failed": True, "errors": [_err(e)]}
        log("batched: transformers generate_batch (continuous batching)")
        attn_before = getattr(hf.config, "_attn_implementation", None)
        res["transformers_generate_batch"] = hf_generate_batch(
            hf, prompts, M, engine.pool.num_blocks * engine.block_size * engine.kv.bytes_per_token,
            engine.kv.bytes_per_token, engine.scheduler.max_num_batched_tokens)
        if getattr(hf.config, "_attn_implementation", None) != attn_before:
            res["transformers_generate_batch"]["note"] = (
                f"attention implementation changed {attn_before} -> {hf.config._attn_implementation}")
    eos = engine.eos_token_ids
    kv_out = kv.pop("_outputs")
    for key in ("transformers_generate_padded", "transformers_generate_batch"):
        peer = res[key]
        if not peer or peer.get("failed"):
            continue
        outs = peer.pop("_outputs")
        # compare greedy tokens up to kvkeeper's first EOS (after EOS the two ways of ignoring it differ)
        same = sum(1 for a, b in zip(kv_out, outs) if _until_eos(a, eos) == b[: len(_until_eos(a, eos))])
        peer["rows_equal_to_kvkeeper_until_eos"] = f"{same}/{len(kv_out)}"
        peer["ratio_kvkeeper_over_peer_total"] = _ratio(kv["tok_per_s"], peer["tok_per_s"])
        peer["ratio_kvkeeper_over_peer_decode_only"] = _ratio(kv.get("decode_only_tok_per_s"),
                                                             peer.get("decode_only_tok_per_s"))
    res["target_tok_s"] = {"metric": f"kvkeeper total tok/s, {len(prompts)} streams x {M} tokens",
                           "target": TARGET_BATCHED_TOK_S, "measured": kv["tok_per_s"], "unit": " tok/s",
                           "met": kv["tok_per_s"] >= TARGET_BATCHED_TOK_S,
                           "note": "target defined for 16 x 64 (full run)" if bc.quick else ""}
    gb = res["transformers_generate_batch"] or {}
    r = gb.get("ratio_kvkeeper_over_peer_total")
    res["target"] = {"metric": "kvkeeper tok/s / transformers generate_batch tok/s (wall, all tokens)",
                     "target": TARGET_BATCHED_VS_GENERATE_BATCH, "measured": r,
                     "met": None if r is None else r >= TARGET_BATCHED_VS_GENERATE_BATCH,
                     "note": "" if r is not None else "generate_batch did not produce a result (see errors)"}
    return res
