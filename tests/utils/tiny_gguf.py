"""Tiny transformers models written as GGUF files the way llama.cpp's converter writes their architecture (tests).

``write_gguf(path, hf, arch)`` stores the model's float32 weights (F32, or F16 matrices with ``f16=True``) under
llama.cpp's tensor names and metadata keys for ``arch`` "llama" (q/k rows permuted for llama.cpp's RoPE, as
``convert_hf_to_gguf.py``'s LlamaModel does; Mistral checkpoints are converted as "llama") or "phi3" (fused
``attn_qkv`` and ``ffn_up`` holding gate then up, nothing permuted); ``write_qwen3_gguf(hf, path, matrices)`` writes
a Qwen3 / Qwen3-MoE as ``qwen3`` / ``qwen3moe`` (F32, F16, Q8_0 or random Q4_K_M matrices).  Both carry the
embedded SmolLM2 GGUF's tokenizer and share the header writer :func:`_hparams`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvkeeper.weights import synth_gguf


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

    c = hf.config
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    _hparams(w, c, head_dim)
    w.add_rope_dimension_count(head_dim)
    if getattr(c, "sliding_window", None) and arch == "phi3":  # convert_hf_to_gguf.py's Phi3MiniModel writes it
        w.add_sliding_window(int(c.sliding_window))
    _tokenizer(w)
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        tensors.update(_layer_tensors(sd, i, arch, c.num_attention_heads, c.num_key_value_heads))
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t.astype(np.float16 if f16 and t.ndim == 2 else np.float32)))
    return _finish(w, path)


def _hparams(w, c, head_dim: int) -> None:
    """The hyperparameters every architecture here writes (context, widths, heads, RoPE base, RMSNorm epsilon)."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))


def _tokenizer(w) -> None:
    """Copy every ``tokenizer.*`` field of the embedded GGUF (read once per process by synth_gguf)."""
    from kvkeeper.weights.sources import resolve_model_path

    for key, value, vtype, sub in synth_gguf.tokenizer_fields(str(resolve_model_path())):
        w.add_key_value(key, value, vtype, sub)


def _finish(w, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- Qwen3 / Qwen3-MoE ----------------------------------------------------------------------------------------------
def _qwen3_tensors(hf) -> dict[str, np.ndarray]:
    """llama.cpp's tensor names (numpy shapes: (rows, cols), experts (E, rows, cols)) for a Qwen3 / Qwen3-MoE."""
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not hf.config.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
    for i in range(hf.config.num_hidden_layers):
        for g, h in names.items():
            if f"model.layers.{i}.{h}.weight" in sd:
                out[f"blk.{i}.{g}.weight"] = sd[f"model.layers.{i}.{h}.weight"]
        gate_up = sd.get(f"model.layers.{i}.mlp.experts.gate_up_proj")
        if gate_up is not None:  # transformers' stacked experts: gate rows first, then up
            inter = gate_up.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :inter]
            out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, inter:]
            out[f"blk.{i}.ffn_down_exps.weight"] = sd[f"model.layers.{i}.mlp.experts.down_proj"]
    return out


def _matrix(name: str, arr: np.ndarray, matrices: str, n_layers: int, rng: np.random.Generator):
    """(data, raw_dtype) of tensor ``name`` for a file of ``matrices``: F32, F16 or Q8_0 (``arr`` itself, quantized
    with the gguf package), or Q4_K_M (random valid blocks of arr's shape in llama.cpp's Q4_K_M type choice: the
    gguf package has no K-quant quantizer).  Vectors and the router stay F32, as llama.cpp keeps them."""
    import gguf

    if arr.ndim == 1 or name.endswith("ffn_gate_inp.weight") or matrices == "F32":
        return np.ascontiguousarray(arr, dtype=np.float32), None
    if matrices == "F16":
        return np.ascontiguousarray(arr, dtype=np.float16), None
    if matrices == "Q4_K_M":
        synth = synth_gguf
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        type_name = synth.q4_k_m_type(name, layer, n_layers)
        rows = int(np.prod(arr.shape[:-1]))
        raw = synth.random_tensor(rng, type_name, rows, arr.shape[-1])
        return raw.reshape(*arr.shape[:-1], raw.shape[-1]), gguf.GGMLQuantizationType[type_name]
    qt = gguf.GGMLQuantizationType[matrices]
    return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qt), qt


def write_qwen3_gguf(hf, path: Path, matrices: str = "F32") -> Path:
    """Write ``hf`` (Qwen3 / Qwen3-MoE) as llama.cpp's ``qwen3`` / ``qwen3moe`` GGUF; matrices (2-D and 3-D tensors)
    as ``matrices`` (F32, F16, Q8_0, or Q4_K_M with random blocks: :func:`_matrix`), norms F32.  Returns the path."""
    import gguf

    c = hf.config
    moe = c.model_type == "qwen3_moe"
    w = gguf.GGUFWriter(str(path), "qwen3moe" if moe else "qwen3")
    _hparams(w, c, c.head_dim)
    w.add_vocab_size(c.vocab_size)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    _tokenizer(w)
    rng = np.random.default_rng(0)
    for name, arr in _qwen3_tensors(hf).items():
        data, raw = _matrix(name, arr, matrices, c.num_hidden_layers, rng)
        w.add_tensor(name, data, raw_dtype=raw)
    return _finish(w, path)
