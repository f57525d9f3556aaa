"""A tiny random-initialised Llama saved as a Hugging Face folder with the embedded model's tokenizer (tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvkeeper import SamplingParams
from kvkeeper.engine.sequence import Sequence


def tiny_llama_folder(out: Path, *, hidden_size: int = 32, head_dim: int = 8, num_layers: int = 2,
                      num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0, vocab_size: int | None = None) -> Path:
    """Write config.json + safetensors + tokenizer to ``out`` (intermediate size 2 x hidden); returns ``out``.
    vocab_size: the model's (default: the tokenizer's; a smaller one makes sampling cheap, ids below it decode)."""
    import torch
    import transformers
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path())
    cfg = transformers.LlamaConfig(vocab_size=vocab_size or len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                   head_dim=head_dim, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                   num_key_value_heads=num_kv_heads)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_compression_llama(out: Path):
    """The compression tests' tiny random Llama (2 layers, 4 heads over 2 KV heads of dim 16, eager attention,
    float32, weights ~ N(0, 1/fan_in), residual projections x2, norms left at 1), saved with the embedded model's
    tokenizer to ``out``.  Returns (out, the transformers model, the tokenizer)."""
    import transformers
    from kvkeeper.text.tokenizer import load_tokenizer
    from kvkeeper.weights.sources import resolve_model_path

    tok = load_tokenizer(resolve_model_path())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, head_dim=16,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                gain = 2.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    return out, hf, tok


def randomise_weights(model: torch.nn.Module, seed: int) -> None:
    """Large random weights (norm weights around 1, non-zero biases) so logits differ clearly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:  # logits of std ~2 (the tied embedding too)
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            else:  # linear layers: std ~1/sqrt(fan_in) keeps activations O(1); residual branches
                # twice that, so the current token's (tied) embedding does not dominate and
                # greedy generation does not just repeat one token
                gain = 2.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


@torch.inference_mode()
def kk_logits_chunked(eng, prompts: list[list[int]], schedule: list[list[int]], keep_seqs: list | None = None,
                      commit: bool = False) -> list[torch.Tensor]:
    """Run prompts through the runner by hand; ``schedule[step][i]`` tokens of prompt i per step (0: skip).

    Returns every position's logits for each prompt.  Several sequences share a
    step, so prefills, prefill-over-cache chunks and decodes are packed together.  ``keep_seqs``: a list
    that receives the sequences, whose KV blocks are then kept (the caller frees them).  ``commit``: after each
    step, register full blocks and give back window blocks past the window, as the engine does.
    """
    seqs = [Sequence(f"parity-{i}", list(p), SamplingParams(), eng.namespace) for i, p in enumerate(prompts)]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        for step in schedule:
            scheduled = [(s, n) for s, n in zip(seqs, step) if n]
            for s, n in scheduled:
                assert eng.kv.allocate(s, n)
            logits = eng.runner.forward(eng.runner.build_batch(scheduled), "prompt")  # every packed token
            start = 0
            for (s, n) in scheduled:
                rows[seqs.index(s)].append(logits[start:start + n].cpu())
                start += n
                s.num_computed += n
                if commit:
                    eng.kv.commit(s)
        for s, p in zip(seqs, prompts):
            assert s.num_computed == len(p), "schedule does not cover the prompt"
    finally:
        if keep_seqs is None:
            for s in seqs:
                eng.kv.free(s)
        else:  # the caller frees them
            keep_seqs.extend(seqs)
    return [torch.cat(r) for r in rows]


def tiny_deepseek_folder(out: Path, *, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V3 (MLA with q LoRA, interleaved RoPE; layer 0 dense, layer 1 MoE of 8 experts,
    top-2, one shared) saved as a Hugging Face folder with the embedded model's tokenizer; returns ``out``."""
    import transformers

    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path())
    cfg = transformers.DeepseekV3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=4, topk_group=2, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    randomise_weights(hf, seed)
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: one thread is fastest and immune to a busy machine's oversubscription (autouse in every
    module that imports it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer (tiny configs share its vocabulary)."""
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path())


# ---- the parity tests' shared pieces (tests/models: Mistral, Phi-3, Qwen3) -----------------------------------------
def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids drawn from [3, 2000) with ``seed`` (the same ids every run)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (n,), generator=g).tolist()


def tiny_hf(cfg, seed: int):
    """transformers' causal LM for ``cfg`` (eager attention, float32, eval mode), weights randomised with ``seed``."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomise_weights(hf, seed)
    return hf


def save_tiny(hf, tokenizer, out: Path) -> Path:
    """Save ``hf`` and ``tokenizer`` as a Hugging Face folder ``out``; returns ``out``."""
    hf.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits of every position of ``ids``: float32, shape (len(ids), vocab)."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' ``n`` greedy tokens after ``ids``, never stopping at EOS (the engine's ``ignore_eos``)."""
    out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def without_window(hf):
    """The same weights as ``hf`` (a tiny model from :func:`tiny_hf`) with full attention: its config's
    ``sliding_window`` set to None (the reference a GGUF without a window key is held to)."""
    cfg = type(hf.config)(**{**hf.config.to_dict(), "sliding_window": None})
    full = tiny_hf(cfg, 0)
    full.load_state_dict(hf.state_dict())
    return full
