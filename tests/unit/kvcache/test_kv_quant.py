"""KV cache storage formats: int8 / fp8 quantization, the paged store, and quality through the engine.

* hypothesis properties of quantize / dequantize (error bounds per format, zero and huge vectors);
* ``PagedKV``: what is written to random slots is what a block table gathers back;
* a tiny random Llama (HF folder): int8 / fp8 logits close to fp32, and a quantized cache gives the
  same logits whether a prompt is prefilled at once or in chunks;
* the real model: perplexity through the engine equals transformers' at fp32; int8 KV within 1% of
  fp32 at 4,096 tokens with a quarter of the bytes; ``kvkeeper eval perplexity --json``.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvkeeper import LLMEngine
from kvkeeper.sampling.params import SamplingParams
from kvkeeper.engine.sequence import Sequence
from kvkeeper.kvcache.formats.base import FORMATS, PagedKV, parse_kv_format
from kvkeeper.kvcache.formats.int8 import dequantize, quantize
from tests.utils.engines import make_engine
from tests.utils.book import BOOK, book_ids_2k, float32_perplexity_2k


# ---- quantize / dequantize ----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(["int8", "fp8"]), rows=st.integers(1, 6), d=st.integers(1, 40),
       log_mag=st.floats(-6, 4), seed=st.integers(0, 2**31 - 1))
def test_quantization_error_is_bounded(fmt, rows, d, log_mag, seed):
    f = parse_kv_format(fmt)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, d, generator=g) * 10.0 ** log_mag
    q, s = quantize(x, f)
    assert q.dtype == f.storage and s.shape == (rows, 3) and s.dtype == torch.float16
    y = dequantize(q, s, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    step = s.float().unsqueeze(-1)
    if fmt == "int8":  # rounding to the nearest multiple of the scale
        assert torch.all((y - x).abs() <= step * 0.5 + 1e-6 * amax + 1e-12)
    else:  # e4m3: 3 mantissa bits -> relative error <= 2^-4, plus subnormal spacing near zero
        assert torch.all((y - x).abs() <= x.abs() * 2.0 ** -4 + step * 2.0 ** -9 + 1e-12)
    assert torch.all(y.abs() <= amax * (1 + 2.0 ** -4) + step)  # never blows up


def test_zero_and_plain_formats():
    z = torch.zeros(2, 3, 8)
    for name in ("int8", "fp8"):
        q, s = quantize(z, parse_kv_format(name))
        assert torch.equal(dequantize(q, s, torch.float32), z) and torch.all(s > 0)
    assert parse_kv_format("fp32") is FORMATS["float32"] and parse_kv_format(torch.bfloat16).name == "bfloat16"
    with pytest.raises(ValueError, match="int8"):
        parse_kv_format("int3")


def test_bytes_per_token_smollm2_shape():
    args = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head_dim
    fp32 = parse_kv_format("fp32").bytes_per_token(*args)
    assert fp32 == 46080 and parse_kv_format("bf16").bytes_per_token(*args) == fp32 // 2
    for name in ("int8", "fp8"):
        b = parse_kv_format(name).bytes_per_token(*args)
        assert b == 2 * 30 * 3 * (64 + 2)  # one byte per value plus a float16 scale per token and head
        assert b / fp32 < 0.26


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "int8", "fp8"])
def test_paged_store_gathers_what_was_written(fmt):
    f = parse_kv_format(fmt)
    kv = PagedKV(num_blocks=9, block_size=4, num_kv_heads=2, head_dim=8, fmt=f)
    g = torch.Generator().manual_seed(0)
    table = torch.tensor([7, 2, 5], dtype=torch.int64)  # a sequence of 10 tokens over 3 scattered blocks
    pos = torch.arange(10)
    slots = table[pos // 4] * 4 + pos % 4
    k, v = torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    kv.write(k, v, slots)
    gk, gv = kv.gather(table, 10, torch.float32)
    pk, pv = kv.gather_padded(table[None], torch.float32)  # (1, KVH, 12, D)
    for x, got, padded in ((k, gk, pk), (v, gv, pv)):
        if f.quantized:
            want = dequantize(*quantize(x, f), torch.float32)
        else:
            want = x.to(f.storage).float()
        assert torch.equal(got, want)
        assert torch.equal(padded[0].transpose(0, 1)[:10], want)


# ---- a tiny random Llama ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from kvkeeper.weights.sources import resolve_model_path
    from kvkeeper.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, head_dim=16,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    folder = tmp_path_factory.mktemp("tiny-quant")
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _prompt_logits(eng: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position of ``ids`` prefilled in chunks of ``chunk`` tokens: (len, vocab)."""
    seq = Sequence("t", list(ids), SamplingParams(), eng.isolated_namespace("t"))
    assert eng.kv.allocate(seq, len(ids))
    out = []
    try:
        while seq.num_computed < len(ids):
            m = min(chunk, len(ids) - seq.num_computed)
            out.append(eng.runner.forward(eng.runner.build_batch([(seq, m)]), "prompt"))
            seq.num_computed += m
    finally:
        eng.kv.free(seq)
    return torch.cat(out)


@pytest.mark.parametrize("fmt,tol", [("int8", 0.05), ("fp8", 0.3)])
def test_quantized_cache_is_close_to_fp32_and_chunk_invariant(tiny_folder, fmt, tol):
    ids = torch.randint(0, 40000, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = _prompt_logits(make_engine(str(tiny_folder), num_kv_blocks=16, block_size=4), ids, 45)
    eng = make_engine(str(tiny_folder), num_kv_blocks=16, block_size=4, kv_dtype=fmt)
    assert eng.namespace.kv_dtype == parse_kv_format(fmt).name  # never shares prefixes with the fp32 cache
    whole = _prompt_logits(eng, ids, 45)
    chunked = _prompt_logits(eng, ids, 7)
    assert torch.allclose(whole, chunked, atol=1e-5, rtol=0)
    err = ((whole - ref).abs().max() / ref.abs().max()).item()  # relative to the largest logit
    assert 0 < err < tol, err  # quantization shows, but only a little
    assert eng.pool.num_free == eng.pool.num_blocks


# ---- the real model -----------------------------------------------------------------------


@pytest.mark.slow
def test_perplexity_matches_transformers_at_fp32(engine, hf_reference):
    from kvkeeper.eval.perplexity import perplexity, read_text_tokens

    ids = read_text_tokens(engine, BOOK, 1024, skip_tokens=2000)
    used = engine.pool.num_used
    ours = perplexity(engine, ids, chunk=300)
    with torch.inference_mode():
        ref = hf_reference(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert abs(ours["nll_mean"] - ref) < 1e-4, (ours["nll_mean"], ref)
    assert ours["scored_tokens"] == 1023 and engine.pool.num_used == used  # its blocks went back


@pytest.mark.slow
def test_int8_kv_perplexity_within_one_percent_at_2k_with_a_quarter_of_the_bytes(engine, tmp_path_factory):
    from kvkeeper.eval.perplexity import perplexity

    ids = book_ids_2k(engine)  # 4k: benchmarks/kv/kv_bench.py
    fp32 = float32_perplexity_2k(engine, tmp_path_factory)  # perplexity(engine, ids), shared with test_quant_engine
    q = make_engine(kv_dtype="int8", kv_cache_bytes=256 << 20, quantization="none")
    int8 = perplexity(q, ids)
    assert int8["kv_dtype"] == "int8" and int8["kv_bytes_per_token"] * 4 <= fp32["kv_bytes_per_token"] * 1.04
    assert abs(int8["ppl"] / fp32["ppl"] - 1) < 0.01, (int8["ppl"], fp32["ppl"])
    assert int8["ppl"] != fp32["ppl"]  # the cache really was quantized
