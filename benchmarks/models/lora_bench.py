"""The cost of LoRA adapters on CPU: prefill and decode tok/s of the embedded SmolLM2-135M with and without adapters.

Adapters: random rank-``--rank`` LoRA on all seven projections of all 30 layers, made with peft on a transformers
Llama of SmolLM2's widths (tiny vocabulary: the adapter's tensors do not depend on it).  The engine runs its
default weights (``--quantization``, default gguf: Q8_0 blocks computed in place, bf16 KV).  Measured, each after
one warm-up run:

* prefill: one prompt of ``--prompt-tokens`` random tokens (fresh namespace, no prefix hit), max_tokens 1;
* decode: ``--decode-tokens`` greedy tokens (ignore_eos) for 1 request, and for a batch of 4 requests all on the
  base model, all under adapter A, and mixed (A, B, base, base).

A step with an adapter runs layer by layer (the fused C++ decode step knows no adapters) and adds each adapter's
low-rank term with a loop over the distinct adapters in the step (kvkeeper.layers.lora).

Run: ``PYTHONPATH=src flock -x /work/.cpu.lock python benchmarks/models/lora_bench.py`` (about 2 minutes on 2 cores).
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


def make_adapter(out: Path, cfg, rank: int, seed: int) -> Path:
    import peft
    import transformers

    hf_cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=cfg.hidden_size,
                                      intermediate_size=cfg.intermediate_size, head_dim=cfg.head_dim,
                                      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                                      num_key_value_heads=cfg.num_kv_heads)
    pm = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(hf_cfg), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    pm.save_pretrained(out)
    return out


def timed(eng: LLMEngine, prompts, params, loras) -> tuple[float, int]:
    """(seconds, tokens generated) of one generate() call, each prompt in a fresh namespace."""
    ns = eng.isolated_namespace("bench")
    t = time.perf_counter()
    outs = eng.generate(prompts, params, namespace=ns, lora=loras)
    return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)


def run(args) -> dict:
    eng = LLMEngine(quantization=args.quantization, num_threads=args.threads)
    with tempfile.TemporaryDirectory() as d:
        for name, seed in (("A", 1), ("B", 2)):
            eng.load_lora(name, make_adapter(Path(d) / name, eng.model_config, args.rank, seed))
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (args.prompt_tokens,), generator=g).tolist()
    short = [torch.randint(100, vocab, (32,), generator=g).tolist() for _ in range(4)]
    rows = []
    pre = SamplingParams(max_tokens=1, temperature=0.0)
    dec = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    cases = [("prefill", "base", [prompt], pre, None), ("prefill", "adapter A", [prompt], pre, "A"),
             ("decode x1", "base", short[:1], dec, None), ("decode x1", "adapter A", short[:1], dec, "A"),
             ("decode x4", "base", short, dec, None), ("decode x4", "adapter A", short, dec, "A"),
             ("decode x4", "mixed A, B, base, base", short, dec, ["A", "B", None, None])]
    for kind, label, prompts, params, loras in cases:
        timed(eng, prompts, params, loras)  # warm-up
        best = min(timed(eng, prompts, params, loras) for _ in range(args.repeats))
        secs, gen = best
        tokens = len(prompt) if kind == "prefill" else gen
        rows.append({"case": kind, "adapters": label, "tokens": tokens, "seconds": round(secs, 4),
                     "tok_per_s": round(tokens / secs, 1)})
        print(rows[-1], file=sys.stderr)
    return {"model": str(eng.model_path), "weights": eng.runner.weight_description, "rank": args.rank,
            "adapter_params": eng.loras["A"].num_parameters, "threads": torch.get_num_threads(),
            "cpu": cpu_model(), "rows": rows}


def markdown(res: dict, load: tuple[float, float]) -> str:
    lines = [f"# LoRA adapter cost ({res['cpu']}, {res['threads']} threads, load average {load[0]:.2f} at start, "
             f"{load[1]:.2f} at end)", "",
             f"SmolLM2-135M, {res['weights']}; adapters rank {res['rank']} on q/k/v/o/gate/up/down of all layers "
             f"({res['adapter_params']:,} parameters each). Best of the repeats, after a warm-up.", "",
             "| case | adapters | tokens | seconds | tok/s | vs base |", "|---|---|---|---|---|---|"]
    base = {r["case"]: r["tok_per_s"] for r in res["rows"] if r["adapters"] == "base"}
    for r in res["rows"]:
        lines.append(f"| {r['case']} | {r['adapters']} | {r['tokens']} | {r['seconds']} | {r['tok_per_s']} | "
                     f"{r['tok_per_s'] / base[r['case']]:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "lora_bench")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    load0 = os.getloadavg()[0]
    res = run(args)
    load1 = os.getloadavg()[0]
    res["load_average"] = [load0, load1]
    res["settings"] = vars(args) | {"out": str(args.out)}
    write_report(args.out, result_name("lora_bench"), res, markdown(res, (load0, load1)))


if __name__ == "__main__":
    main()
