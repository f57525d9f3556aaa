"""A whole decode step in one C++ call, for models whose projections are packed (``--quantization`` gguf,
int8 or int4) or GGUF matrices computed in place (:class:`kvkeeper.layers.gguf_linear.GGUFLinear`: K-quants,
Q8_0), on the "cpu" attention backend.

Per token the PyTorch path runs some 25 small operators per layer (norms, RoPE, the KV write, splits,
SiLU, residual adds), each a few microseconds of dispatch: at SmolLM2-135M's 30 layers that is a large
share of a 10 ms decode step.  :class:`FusedDecode` hands the residual stream of a decode-only step to
``DecodeModel.step`` (csrc/cpu/fused_decode.cpp), which applies every layer in turn with the same operations as
:class:`kvkeeper.models.llama.DecoderLayer`: RMSNorm, the packed q/k/v projection (plus bias), RoPE
(half-split, as :func:`kvkeeper.layers.rope.apply_rope`), the new K/V written into the paged cache with
the rounding of :meth:`kvkeeper.kvcache.formats.plain.PlainPagedKV.write`, decode attention read in place
(:mod:`kvkeeper.attention.cpu`), the output projection, RMSNorm, gate/up, SiLU(gate) * up, down,
residual adds.  The embedding lookup, final norm and LM head stay in Python (one call each).

The layer-by-layer path of such a model calls the same C++ routines for RMSNorm, RoPE and SiLU(gate) * up
(:meth:`kvkeeper.models.llama.LlamaForCausalLM.use_cpu_kernels`), the same block matmul (``qmm`` or ``kq_matmul``,
the q/k output permutation of a llama GGUF applied the same way) and the same decode
attention, so a decode token's result is identical bit for bit on both paths (tested): whether a step runs
fused (decode only) or layer by layer (mixed with a prefill) does not change any output.
Gemma 3 runs through the same step with its own parts (``DecodeModel.set_style`` / ``set_layer_norms``): the
embedding scaled by sqrt(hidden), RMSNorm by 1 + weight over each q and k head and after attention and the
feed-forward, GELU(tanh)(gate) * up, and its sliding layers on the local RoPE tables and the window blocks'
slots and block tables (``meta.sliding``) with the window; its layer-by-layer path then takes the same C++
routines (:meth:`kvkeeper.models.gemma3.Gemma3ForCausalLM.use_cpu_kernels`).
``EngineConfig(fused_decode=False)`` (``--no-fused-decode``) turns the fused step off.
"""

from __future__ import annotations


import torch

from ..attention import cpu as cpu_attention
from ..kernels import cpu as cpu_kernels
from ..attention.metadata import AttentionMetadata
from ..models.gemma3 import Gemma3ForCausalLM, GemmaRMSNorm
from ..models.llama import LlamaForCausalLM
from ..models.sliding_window import sliding_meta
from ..layers.norm import RMSNorm
from ..layers.gguf_linear import GGUFLinear
from ..layers.quantized import QuantLinear

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}


class FusedDecode:
    """``(input_ids (B,), positions (B,), meta) -> hidden (B, hidden_size)`` after the final norm, for a
    decode-only step (one token per sequence, rows in ``meta.decode_indices`` order = token order)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches, mod):
        cfg = model.config
        self.model = model
        self.kernels = mod
        self.gemma = isinstance(model, Gemma3ForCausalLM)
        self.scale = model.model.layers[0].self_attn.scale if self.gemma else cfg.head_dim**-0.5
        kind = _KIND[kv_caches[0].k.dtype]
        self.dm = mod.DecodeModel(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, cfg.rms_norm_eps, kind)
        if self.gemma:
            self.dm.set_style(1, cfg.sliding_window or 0)  # GELU(tanh); the sliding layers' window
        empty = torch.empty(0)
        for i, (layer, kv) in enumerate(zip(model.model.layers, kv_caches)):
            at, mlp = layer.self_attn, layer.mlp
            k, v = kv.k, kv.v
            if kind == 4:
                k, v = k.view(torch.uint8), v.view(torch.uint8)
            projs = (at.qkv_proj, at.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ln2 = layer.pre_feedforward_layernorm if self.gemma else layer.post_attention_layernorm
            norms = (_norm_weight(layer.input_layernorm), _norm_weight(ln2),
                     at.qkv_proj.bias.detach() if at.qkv_proj.bias is not None else empty)
            cache = (k, v, kv.k_scale if kv.k_scale is not None else empty,
                     kv.v_scale if kv.v_scale is not None else empty)
            if isinstance(at.qkv_proj, GGUFLinear):
                self.dm.add_layer_gguf(*norms, *(_gguf_parts(p) for p in projs), *cache)
            else:
                self.dm.add_layer(*norms, *(t for p in projs for t in (p.packed.qs, p.packed.sc, p.packed.bits)),
                                  *cache)
            if self.gemma:
                self.dm.set_layer_norms(i, _norm_weight(at.q_norm), _norm_weight(at.k_norm),
                                        _norm_weight(layer.post_attention_layernorm),
                                        _norm_weight(layer.post_feedforward_layernorm), bool(layer.sliding))
            elif getattr(at, "q_norm", None) is not None:  # Qwen3: RMSNorm over each q and k head before RoPE
                self.dm.set_layer_norms(i, _norm_weight(at.q_norm), _norm_weight(at.k_norm), empty, empty, False)

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv_caches) -> FusedDecode | None:
        """A FusedDecode when every layer's projections are packed, norms and cache are as the kernel expects
        and the kernels load; otherwise None (the layer-by-layer path runs)."""
        mod = cpu_kernels.load()
        if mod is None or not kv_caches or kv_caches[0].k.dtype not in _KIND or kv_caches[0].k.device.type != "cpu":
            return None
        kinds = set()
        for layer in model.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            projs = (at.qkv_proj, at.o_proj, mlp.gate_up_proj, mlp.down_proj)
            kinds |= {type(p) for p in projs}
            if not all(isinstance(p, QuantLinear) or _gguf_fusable(p) for p in projs):
                return None
            if at.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if isinstance(model, Gemma3ForCausalLM):
                norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
            norms += [n for n in (getattr(at, "q_norm", None), getattr(at, "k_norm", None)) if n is not None]
            if not all(isinstance(n, (RMSNorm, GemmaRMSNorm)) and n.weight.dtype == torch.float32 for n in norms):
                return None
        if len(kinds) != 1:  # one kind of weight for the whole model (add_layer or add_layer_gguf throughout)
            return None
        return cls(model, kv_caches, mod)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = self.model
        x = m.model.embed_tokens(input_ids).float()
        if self.gemma:  # as Gemma3ForCausalLM.forward: the scale in the activations' dtype
            x = x * torch.tensor(m.embed_scale, dtype=x.dtype)
        x = x.contiguous()
        cos, sin = m.rope.cos[positions].contiguous(), m.rope.sin[positions].contiguous()
        full = (meta.slot_mapping, meta.decode_block_tables.contiguous(), meta.decode_context_lens)
        if self.gemma:
            local = sliding_meta(meta, m.config.sliding_window)
            cos_l, sin_l = m.rope_local.cos[positions].contiguous(), m.rope_local.sin[positions].contiguous()
            self.dm.step_hybrid(x, cos, sin, *full, self.scale, cpu_attention.SPLIT_BLOCKS, cos_l, sin_l,
                                local.slot_mapping, local.decode_block_tables.contiguous(),
                                local.decode_context_lens)
        else:
            self.dm.step(x, cos, sin, *full, self.scale, cpu_attention.SPLIT_BLOCKS)
        return m.model.norm(x)


def _norm_weight(n) -> torch.Tensor:
    """The float32 (dim,) weight the C++ RMSNorm multiplies by: Gemma's 1 + weight, else the weight."""
    if isinstance(n, GemmaRMSNorm):
        return n.scale if n.scale is not None else (1.0 + n.weight.detach().float()).contiguous()
    return n.weight.detach()


def _gguf_fusable(p) -> bool:
    """A GGUFLinear whose every part runs on the C++ kernels (not F16: its prefill takes torch's GEMM, so the
    fused step could not match the layer-by-layer path bit for bit)."""
    return (isinstance(p, GGUFLinear) and p.on_kernels and all(w.type_name != "F16" for w in p.parts))


def _gguf_parts(p: GGUFLinear) -> list[tuple]:
    """The DecodeModel form of a GGUFLinear: (bytes, ggml type, N, K, perm or empty) per part."""
    empty = torch.empty(0, dtype=torch.int64)
    return [(w.data, w.ggml_type, w.n, w.k, empty if w.out_perm is None else w.out_perm.contiguous())
            for w in p.parts]
