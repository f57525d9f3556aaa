"""A tiny transformers model written as a GGUF file the way llama.cpp's converter writes its architecture (tests).

``write_gguf(path, hf, arch)`` stores the model's float32 weights (F32, or F16 matrices with ``f16=True``) under
llama.cpp's tensor names and metadata keys for ``arch`` "llama" (q/k rows permuted for llama.cpp's RoPE, as
``convert_hf_to_gguf.py``'s LlamaModel does; Mistral checkpoints are converted as "llama") or "phi3" (fused
``attn_qkv`` and ``ffn_up`` holding gate then up, nothing permuted), with the embedded SmolLM2 GGUF's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.unit.weights.conftest import load_synth


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (half-split -> interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _layer_tensors(sd: dict, i: int, arch: str, n_head: int, n_kv: int) -> dict[str, np.ndarray]:
    pre = f"model.layers.{i}."
    out = {f"blk.{i}.attn_norm.weight": sd[pre + "input_layernorm.weight"],
           f"blk.{i}.ffn_norm.weight": sd[pre + "post_attention_layernorm.weight"],
           f"blk.{i}.attn_output.weight": sd[pre + "self_attn.o_proj.weight"],
           f"blk.{i}.ffn_down.weight": sd[pre + "mlp.down_proj.weight"]}
    if arch == "phi3":
        out[f"blk.{i}.attn_qkv.weight"] = sd[pre + "self_attn.qkv_proj.weight"]
        out[f"blk.{i}.ffn_up.weight"] = sd[pre + "mlp.gate_up_proj.weight"]
    else:
        out[f"blk.{i}.attn_q.weight"] = _permute(sd[pre + "self_attn.q_proj.weight"], n_head)
        out[f"blk.{i}.attn_k.weight"] = _permute(sd[pre + "self_attn.k_proj.weight"], n_kv)
        out[f"blk.{i}.attn_v.weight"] = sd[pre + "self_attn.v_proj.weight"]
        out[f"blk.{i}.ffn_gate.weight"] = sd[pre + "mlp.gate_proj.weight"]
        out[f"blk.{i}.ffn_up.weight"] = sd[pre + "mlp.up_proj.weight"]
    return out


def write_gguf(path: Path, hf, arch: str, f16: bool = False) -> Path:
    """Write ``hf`` (a transformers Llama / Mistral / Phi-3 causal LM, untied) to ``path`` as a GGUF of ``arch``
    ("llama" or "phi3"); matrices F16 with ``f16`` (norms stay F32).  Returns ``path``."""
    import gguf

    from kvkeeper.weights.sources import resolve_model_path

    c = hf.config
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    if getattr(c, "sliding_window", None) and arch == "phi3":  # convert_hf_to_gguf.py's Phi3MiniModel writes it
        w.add_sliding_window(int(c.sliding_window))
    for key, value, vtype, sub in load_synth().tokenizer_fields(str(resolve_model_path())):
        w.add_key_value(key, value, vtype, sub)
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        tensors.update(_layer_tensors(sd, i, arch, c.num_attention_heads, c.num_key_value_heads))
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t.astype(np.float16 if f16 and t.ndim == 2 else np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
