"""Multi-head Latent Attention on CPU: absorbed vs expanded decode, KV bytes per token, transformers, int8 latent.

A random DeepSeek-V3-style config (hidden 1,024, 16 heads, kv_lora_rank 256, qk_rope 64, qk_nope 128, v 128,
q_lora_rank 384, 4 dense layers, vocab 49,152 (the embedded SmolLM2 tokenizer's)) is saved as a Hugging Face folder and loaded by the engine in
fp32.  One sequence is prefilled to the largest context; then, at each context length L, decode steps at
position L - 1 (the sequence's block table cut to L tokens) are timed with the absorbed and with the expanded
form (the same step, rewriting the same slot), and transformers (sdpa) decodes the same number of steps with its
DynamicCache cropped to L (the greedy step ``generate`` runs: one forward of one token, argmax).  Also: KV bytes
per token of the latent cache against the same model with standard multi-head K/V, and the perplexity of a
text (Pride and Prejudice) through an fp32 and an int8 latent cache (random weights: the delta measures the
cache's quantization error, not language quality).

Run: ``PYTHONPATH=src flock -x /work/.cpu.lock python benchmarks/models/mla_bench.py`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import cpu_model, result_name, write_report  # noqa: E402

from kvkeeper import LLMEngine, SamplingParams
from kvkeeper.engine.sequence import Sequence
from kvkeeper.eval.perplexity import perplexity, read_text_tokens

BOOK = Path(__file__).resolve().parents[2] / "data" / "gutenberg_pride_and_prejudice" / "1342-0.txt"
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=64, qk_nope_head_dim=128,
             v_head_dim=128, first_k_dense_replace=4, n_routed_experts=8, vocab_size=49152,
             max_position_embeddings=16384)


def make_folder(out: Path):
    import transformers

    cfg = transformers.DeepseekV3Config(**SHAPE, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()
    hf.save_pretrained(out)
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    load_tokenizer(resolve_model_path()).save_pretrained(out)  # the perplexity text
    return hf


@torch.inference_mode()
def time_decode(eng: LLMEngine, seq: Sequence, L: int, steps: int, mode: str) -> float:
    """Decode tok/s of ``steps`` single-token steps at context L (position L - 1) in ``mode``."""
    runner = eng.runner
    runner.model.set_decode_mode(mode)
    view = Sequence("bench-view", seq.token_ids[:L], SamplingParams(), eng.namespace)
    view.block_table = seq.block_table[: -(-L // eng.block_size)]
    view.num_computed = L - 1
    ids, pos, meta, _, _ = runner.build_batch([(view, 1)])
    runner.model(ids, pos, runner.kv_store, meta)  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        ids, pos, meta, _, _ = runner.build_batch([(view, 1)])
        runner.model.compute_logits(runner.model(ids, pos, runner.kv_store, meta)).argmax(-1)
    runner.model.set_decode_mode("absorbed")
    return steps / (time.perf_counter() - t)


@torch.inference_mode()
def transformers_decode(hf, ids: list[int], contexts: list[int], steps: int) -> dict[int, float]:
    """tok/s of transformers' greedy decode step (forward of one token with its DynamicCache, argmax) per L."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    hf(torch.tensor([ids[: max(contexts) - 1]]), past_key_values=cache, use_cache=True)
    out = {}
    for L in sorted(contexts, reverse=True):
        drop = cache.get_seq_length() - (L - 1)
        if drop:
            cache.crop(-drop)
        tok = torch.tensor([[ids[L - 1]]])
        t = time.perf_counter()
        for i in range(steps):
            logits = hf(tok, past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[L - 1 + i]])).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
        out[L] = steps / (time.perf_counter() - t)
    return out


def kv_bytes(eng: LLMEngine) -> dict:
    c = eng.model_config
    # standard MHA: per head a K of qk_nope + qk_rope and a V of v_head_dim values, bf16
    std = c.num_layers * c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 2
    return {"mla_bf16": c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 2, "mha_bf16": std}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "mla_bench"))
    a = ap.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="mla-bench-"))
    hf = make_folder(folder)
    _log(f"saved {folder}")
    eng = LLMEngine(model=str(folder), quantization="none", kv_dtype="fp32", num_kv_blocks=(max(contexts) + 64) // 16,
                    block_size=16)
    ids = torch.randint(2, 49152, (max(contexts),), generator=torch.Generator().manual_seed(0)).tolist()
    seq = Sequence("bench", ids, SamplingParams(), eng.namespace)
    t = time.perf_counter()
    for c in range(0, len(ids) - 1, 512):  # prefill in chunks of 512 (the engine's default token budget)
        n = min(512, len(ids) - 1 - c)
        assert eng.kv.allocate(seq, n)
        with torch.inference_mode():
            i, p, meta, _, _ = eng.runner.build_batch([(seq, n)])
            eng.runner.model(i, p, eng.kv.store, meta)
        seq.num_computed += n
    prefill_s = time.perf_counter() - t
    _log(f"prefilled {len(ids) - 1} tokens in {prefill_s:.1f} s")
    rows = {L: {"absorbed": time_decode(eng, seq, L, a.steps, "absorbed"),
                "expanded": time_decode(eng, seq, L, a.steps, "expanded")} for L in contexts}
    eng.kv.free(seq)
    _log(f"kvkeeper decode {rows}")
    hf_tps = transformers_decode(hf, ids, contexts, a.steps)
    for L in contexts:
        rows[L]["transformers"] = hf_tps[L]
    _log(f"transformers decode {hf_tps}")
    ppl = {}
    for kv in ("fp32", "int8"):
        e = LLMEngine(model=str(folder), quantization="none", kv_dtype=kv, num_kv_blocks=128, block_size=16)
        r = perplexity(e, read_text_tokens(e, BOOK, a.ppl_tokens))
        ppl[kv] = {"ppl": r["ppl"], "kv_bytes_per_token": r["kv_bytes_per_token"]}
    res = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "load": os.getloadavg()[0], "shape": SHAPE,
           "steps": a.steps, "prefill_s": prefill_s, "decode_tok_s": rows, "kv_bytes_per_token": kv_bytes(eng),
           "perplexity": ppl}
    md = [f"# MLA decode on CPU ({res['cpu']}, {res['threads']} threads, load {res['load']:.1f})", "",
          f"Config: {SHAPE}; fp32 weights and cache; {a.steps} decode steps per cell; prefill of "
          f"{max(contexts) - 1} tokens {prefill_s:.1f} s.", "",
          "| context | absorbed tok/s | expanded tok/s | absorbed / expanded | transformers tok/s |",
          "|---:|---:|---:|---:|---:|"]
    for L in contexts:
        r = rows[L]
        md.append(f"| {L:,} | {r['absorbed']:.1f} | {r['expanded']:.1f} | {r['absorbed'] / r['expanded']:.2f}x | "
                  f"{r['transformers']:.1f} |")
    kb = res["kv_bytes_per_token"]
    md += ["", f"KV bytes per token (bf16, all {SHAPE['num_hidden_layers']} layers): latent {kb['mla_bf16']:,}, "
           f"standard multi-head K/V of the same model {kb['mha_bf16']:,} ({kb['mha_bf16'] / kb['mla_bf16']:.0f}x).",
           "", f"Perplexity over {a.ppl_tokens} tokens (random weights): fp32 latent {ppl['fp32']['ppl']:.4f} "
           f"({ppl['fp32']['kv_bytes_per_token']:,} B/token), int8 latent {ppl['int8']['ppl']:.4f} "
           f"({ppl['int8']['kv_bytes_per_token']:,} B/token), delta {ppl['int8']['ppl'] - ppl['fp32']['ppl']:+.4f} "
           f"({100 * (ppl['int8']['ppl'] / ppl['fp32']['ppl'] - 1):+.3f}%).", ""]
    write_report(Path(a.out), result_name("mla_bench", f"mla-{SHAPE['hidden_size']}"), res, "\n".join(md))


if __name__ == "__main__":
    main()
