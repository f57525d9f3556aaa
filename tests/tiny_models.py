"""A tiny random-initialised Llama saved as a Hugging Face folder with the embedded model's tokenizer (tests)."""

from __future__ import annotations

from pathlib import Path


def tiny_llama_folder(out: Path, *, hidden_size: int = 32, head_dim: int = 8, num_layers: int = 2,
                      num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0) -> Path:
    """Write config.json + safetensors + tokenizer to ``out`` (intermediate size 2 x hidden); returns ``out``."""
    import torch
    import transformers

    from kvkeeper.model.registry import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                   head_dim=head_dim, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                   num_key_value_heads=num_kv_heads)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out
