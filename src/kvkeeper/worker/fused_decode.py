"""A whole decode step in one C++ call, for models whose projections are packed (``--quantization`` gguf,
int8 or int4) or GGUF matrices computed in place (:class:`kvkeeper.layers.gguf_linear.GGUFLinear`: K-quants,
Q8_0), on the "cpu" attention backend.

Per token the PyTorch path runs some 25 small operators per layer (norms, RoPE, the KV write, splits,
SiLU, residual adds), each a few microseconds of dispatch: at SmolLM2-135M's 30 layers that is a large
share of a 10 ms decode step.  :class:`FusedDecode` hands the residual stream of a decode-only step to
``DecodeModel.step`` (csrc/cpu/fused_decode.cpp), which applies every layer in turn with the same operations as
:class:`kvkeeper.models.llama.DecoderLayer`: RMSNorm, the packed q/k/v projection (plus bias), RoPE
(half-split, as :func:`kvkeeper.layers.rope.apply_rope`), the new K/V written into the paged cache with
the rounding of :meth:`kvkeeper.kvcache.store.PagedKV.write`, decode attention read in place
(:mod:`kvkeeper.attention.cpu`), the output projection, RMSNorm, gate/up, SiLU(gate) * up, down,
residual adds.  The embedding lookup, final norm and LM head stay in Python (one call each).

The layer-by-layer path of such a model calls the same C++ routines for RMSNorm, RoPE and SiLU(gate) * up
(:meth:`kvkeeper.models.llama.LlamaForCausalLM.use_cpu_kernels`), the same block matmul (``qmm`` or ``kq_matmul``,
the q/k output permutation of a llama GGUF applied the same way) and the same decode
attention, so a decode token's result is identical bit for bit on both paths (tested): whether a step runs
fused (decode only) or layer by layer (mixed with a prefill) does not change any output.
``EngineConfig(fused_decode=False)`` (``--no-fused-decode``) turns the fused step off.
"""

from __future__ import annotations


import torch

from ..attention import cpu as cpu_attention
from ..kernels import cpu as cpu_kernels
from ..attention.metadata import AttentionMetadata
from ..models.llama import LlamaForCausalLM
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
        self.scale = cfg.head_dim**-0.5
        kind = _KIND[kv_caches[0].k.dtype]
        self.dm = mod.DecodeModel(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, cfg.rms_norm_eps, kind)
        empty = torch.empty(0)
        for layer, kv in zip(model.model.layers, kv_caches):
            at, mlp = layer.self_attn, layer.mlp
            k, v = kv.k, kv.v
            if kind == 4:
                k, v = k.view(torch.uint8), v.view(torch.uint8)
            projs = (at.qkv_proj, at.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                     at.qkv_proj.bias.detach() if at.qkv_proj.bias is not None else empty)
            cache = (k, v, kv.k_scale if kv.k_scale is not None else empty,
                     kv.v_scale if kv.v_scale is not None else empty)
            if isinstance(at.qkv_proj, GGUFLinear):
                self.dm.add_layer_gguf(*norms, *(_gguf_parts(p) for p in projs), *cache)
            else:
                self.dm.add_layer(*norms, *(t for p in projs for t in (p.packed.qs, p.packed.sc, p.packed.bits)),
                                  *cache)

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
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(isinstance(n, RMSNorm) and n.weight.dtype == torch.float32 for n in norms):
                return None
        if len(kinds) != 1:  # one kind of weight for the whole model (add_layer or add_layer_gguf throughout)
            return None
        return cls(model, kv_caches, mod)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = self.model
        x = m.model.embed_tokens(input_ids).float().contiguous()
        cos, sin = m.rope.cos[positions].contiguous(), m.rope.sin[positions].contiguous()
        self.dm.step(x, cos, sin, meta.slot_mapping, meta.decode_block_tables.contiguous(),
                     meta.decode_context_lens, self.scale, cpu_attention.SPLIT_BLOCKS)
        return m.model.norm(x)


def _gguf_fusable(p) -> bool:
    """A GGUFLinear whose every part runs on the C++ kernels (not F16: its prefill takes torch's GEMM, so the
    fused step could not match the layer-by-layer path bit for bit)."""
    return (isinstance(p, GGUFLinear) and p.on_kernels and all(w.type_name != "F16" for w in p.parts))


def _gguf_parts(p: GGUFLinear) -> list[tuple]:
    """The DecodeModel form of a GGUFLinear: (bytes, ggml type, N, K, perm or empty) per part."""
    empty = torch.empty(0, dtype=torch.int64)
    return [(w.data, w.ggml_type, w.n, w.k, empty if w.out_perm is None else w.out_perm.contiguous())
            for w in p.parts]
