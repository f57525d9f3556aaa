"""Random-weight GGUF files of real model shapes in llama.cpp's Q4_K_M type mix (no download, any size).

    python -m kvkeeper.weights.synth_gguf --shape 1.7b --out /tmp/synth-1.7b.gguf [--seed 0]

Shapes (:data:`SHAPES`): ``tiny`` (tests: hidden 256, 2 layers, 4 heads, 2 KV heads, FFN 512), ``1.7b``
(SmolLM2-1.7B: hidden 2048, 24 layers, 32 / 32 heads, FFN 8192) and ``8b`` (Llama-3.1-8B's layers: hidden
4096, 32 layers, 32 / 8 heads, FFN 14336), all with SmolLM2's 49,152-token vocabulary and untied LM head.

Tensor types as llama.cpp's Q4_K_M assigns them (``llama_tensor_get_type``): Q6_K for ``output.weight``; Q6_K
for ``attn_v`` and ``ffn_down`` of the layers that get "more bits" -- the first eighth of the layers, the last
eighth, and every third layer in between (counting from the end of the first eighth) -- Q4_K for every other
matrix, ``token_embd`` included; norms F32 (ones).  Blocks are valid: random code and sub-block-scale bytes,
float16 super-block scales ``d`` (and ``dmin``) drawn around a value chosen so that the dequantized weights have
a standard deviation of about ``1/sqrt(K)`` (an activation of unit RMS stays of unit RMS through a matrix), so
hidden states and logits stay finite through 24-32 layers.  ``dmin`` is set so that the weights average zero.

The tokenizer (every ``tokenizer.*`` field, the chat template included) is copied from the embedded
SmolLM2-135M GGUF (:func:`kvkeeper.weights.sources.resolve_model_path`), so the engine serves these files as
it serves a real one.  Tensors are generated and written one at a time (memory: one tensor, not the file).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 49152
    context: int = 8192
    rope_theta: float = 100000.0


SHAPES = {
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512),
    "1.7b": Shape(hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192, rope_theta=130000.0),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_theta=500000.0),
}

QK_K = 256
# block bytes and the byte offsets of the float16 scales d (and dmin) inside a block (ggml-common.h)
_LAYOUT = {  # type: (block bytes, block elements, d offset, dmin offset or None, dmin / d for zero mean)
    "Q4_K": (144, QK_K, 0, 2, 7.5),   # d, dmin, scales[12], qs[128]; w = d*sc*q - dmin*m, q in [0, 15]
    "Q5_K": (176, QK_K, 0, 2, 15.5),  # d, dmin, scales[12], qh[32], qs[128]; q in [0, 31]
    "Q6_K": (210, QK_K, 208, None, 0.0),  # ql[128], qh[64], scales[16] int8, d; w = d*sc*(q - 32)
    "Q8_0": (34, 32, 0, None, 0.0),   # d, qs[32] int8
}
_UNIT_STD: dict[str, float] = {}


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: layer i of n gets the bigger type (first/last eighth, every third between)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, layer: int | None, n_layers: int) -> str:
    """The ggml type name llama.cpp's Q4_K_M gives tensor ``name`` (``layer``: its block index or None)."""
    if name.endswith("norm.weight"):
        return "F32"
    if name == "output.weight":
        return "Q6_K"
    if layer is not None and (".attn_v." in name or ".ffn_down." in name) and more_bits(layer, n_layers):
        return "Q6_K"
    return "Q4_K"


def _raw_blocks(rng: np.random.Generator, type_name: str, n: int, k: int, scale: float) -> np.ndarray:
    """(n, row bytes) uint8: random blocks of ``type_name`` whose d is ``scale`` times U(0.5, 1.5)."""
    bb, be, d_off, m_off, ratio = _LAYOUT[type_name]
    nb = k // be
    raw = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    d = (scale * rng.uniform(0.5, 1.5, size=(n, nb))).astype(np.float16)
    raw[:, :, d_off:d_off + 2] = d.view(np.uint8).reshape(n, nb, 2)
    if m_off is not None:
        dmin = (d.astype(np.float32) * ratio).astype(np.float16)
        raw[:, :, m_off:m_off + 2] = dmin.view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, nb * bb)


def _unit_std(type_name: str) -> float:
    """Standard deviation of the dequantized weights of random blocks with d = 1 (measured once on 64 rows)."""
    if type_name not in _UNIT_STD:
        import gguf

        raw = _raw_blocks(np.random.default_rng(1234), type_name, 64, 1024, 1.0)
        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
        _UNIT_STD[type_name] = float(np.asarray(w, dtype=np.float64).std())
    return _UNIT_STD[type_name]


def random_tensor(rng: np.random.Generator, type_name: str, n: int, k: int) -> np.ndarray:
    """A (n, k) matrix of ``type_name`` as the bytes GGUF stores: (n, row bytes) uint8 for block types,
    (n, k) float16 / float32 otherwise; weight standard deviation about 1 / sqrt(k)."""
    target = 1.0 / np.sqrt(k)
    if type_name == "F32":
        return (rng.standard_normal((n, k)) * target).astype(np.float32)
    if type_name == "F16":
        return (rng.standard_normal((n, k)) * target).astype(np.float16)
    if k % _LAYOUT[type_name][1]:
        raise ValueError(f"{type_name} needs the input dimension to be a multiple of {_LAYOUT[type_name][1]}, got {k}")
    return _raw_blocks(rng, type_name, n, k, target / _unit_std(type_name) / 1.04)  # 1.04: RMS of U(0.5, 1.5)


def tensor_plan(shape: Shape) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, ggml type name, (rows N, columns K) or (K,) for vectors) of every tensor, in file order."""
    head_dim = shape.hidden // shape.heads
    h, L = shape.hidden, shape.layers
    plan = [("token_embd.weight", "Q4_K", (shape.vocab, h))]
    for i in range(L):
        mats = {"attn_q": (shape.heads * head_dim, h), "attn_k": (shape.kv_heads * head_dim, h),
                "attn_v": (shape.kv_heads * head_dim, h), "attn_output": (h, shape.heads * head_dim),
                "ffn_gate": (shape.ffn, h), "ffn_up": (shape.ffn, h), "ffn_down": (h, shape.ffn)}
        plan.append((f"blk.{i}.attn_norm.weight", "F32", (h,)))
        for part, nk in mats.items():
            name = f"blk.{i}.{part}.weight"
            plan.append((name, q4_k_m_type(name, i, L), nk))
        plan.append((f"blk.{i}.ffn_norm.weight", "F32", (h,)))
    plan.append(("output_norm.weight", "F32", (h,)))
    plan.append(("output.weight", q4_k_m_type("output.weight", None, L), (shape.vocab, h)))
    return plan


@functools.lru_cache(maxsize=4)
def tokenizer_fields(source: str) -> tuple[tuple[str, object, object, object], ...]:
    """(key, value, value type, array element type) of every ``tokenizer.*`` field (vocabulary, merges, special
    ids, chat template) of the GGUF at ``source`` (read once per process: parsing a 49k vocabulary takes seconds)."""
    import gguf

    reader = gguf.GGUFReader(source)
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            out.append((key, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None))
    return tuple(out)


def _copy_tokenizer(writer, source: Path) -> None:
    for key, value, vtype, sub in tokenizer_fields(str(source)):
        writer.add_key_value(key, value, vtype, sub)


def _tensor_bytes(type_name: str, nk: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype, int]:
    """(stored shape, numpy dtype, bytes) of a tensor as add_tensor_info expects them."""
    if len(nk) == 1 or type_name == "F32":
        return nk, np.dtype(np.float32), int(np.prod(nk)) * 4
    if type_name == "F16":
        return nk, np.dtype(np.float16), int(np.prod(nk)) * 2
    bb, be = _LAYOUT[type_name][:2]
    n, k = nk
    return (n, k // be * bb), np.dtype(np.uint8), n * (k // be) * bb


def write_synthetic_gguf(path, shape: str | Shape = "tiny", seed: int = 0, tokenizer_from=None) -> Path:
    """Write a random-weight llama GGUF of ``shape`` (a :data:`SHAPES` name or a :class:`Shape`) to ``path``.

    seed: the weights' random seed (same seed, same file).  tokenizer_from: the GGUF whose ``tokenizer.*``
    fields are copied (default: the embedded SmolLM2-135M).  Returns the path.  Raises KeyError for an unknown
    shape name and ValueError for a shape whose dimensions are not multiples of 256 (K-quant super-blocks).
    """
    import gguf

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise KeyError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
        name, shape = shape, SHAPES[shape]
    else:
        name = "custom"
    for dim in (shape.hidden, shape.ffn):
        if dim % QK_K:
            raise ValueError(f"dimension {dim} is not a multiple of {QK_K} (a K-quant super-block)")
    if tokenizer_from is None:
        from kvkeeper.weights.sources import resolve_model_path

        tokenizer_from = resolve_model_path()
    path = Path(path)
    head_dim = shape.hidden // shape.heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"kvkeeper synthetic {name} Q4_K_M (random weights, seed {seed})")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _copy_tokenizer(w, Path(tokenizer_from))
    plan = tensor_plan(shape)
    for tname, ttype, nk in plan:
        stored, dtype, nbytes = _tensor_bytes(ttype, nk)
        w.add_tensor_info(tname, stored, dtype, nbytes,
                          raw_dtype=gguf.GGMLQuantizationType[ttype] if dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, ttype, nk in plan:
        if len(nk) == 1:
            data = np.ones(nk, dtype=np.float32)
        else:
            data = random_tensor(rng, ttype, *nk)
        w.write_tensor_data(data)
    w.close()
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = write_synthetic_gguf(args.out, args.shape, args.seed)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.3f} GB, shape {args.shape}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
