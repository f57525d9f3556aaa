"""Weight formats (``--quantization``) through the engine, the CLI and the metrics.

* which format a model file gets and the errors for the ones it cannot run;
* int8 / int4 round-to-nearest on a tiny Hugging Face Llama: close to float32;
* the embedded model (slow): the default is ``gguf``, the fused decode step equals the layer-by-layer path,
  perplexity at 4k tokens within 1% of float32, top-1 agreement with float32 on the parity prompts;
* without the C++ kernels the engine runs float32 and says so.

The rest of the suite runs the library's default format unless a test names ``none`` (float32); these tests name
their format.
"""


import pytest
import torch

from tests.utils.kernels import kernels_or_skip  # noqa: E402
from kvkeeper import InvalidRequestError, SamplingParams
from kvkeeper.kernels import cpu as cpu_kernels
from kvkeeper.layers import quantized
from kvkeeper.weights import formats as qw
from tests.utils.engines import assert_fused_equals_mixed, make_engine


@pytest.fixture(scope="module")
def kernels():
    mod = kernels_or_skip()
    return mod


# ---- which format ---------------------------------------------------------------------------------------


def test_resolution_and_errors(kernels, monkeypatch):
    monkeypatch.delenv("KVKEEPER_QUANTIZATION", raising=False)
    r = qw.resolve_quantization
    assert r(None, source="gguf", gguf_types={"Q4_1", "Q8_0"}) == "gguf"
    assert r("auto", source="gguf", gguf_types={"Q4_0"}) == "gguf"
    assert r(None, source="gguf", gguf_types={"Q4_1", "Q3_K"}) == "none"  # a type no kernel runs
    assert r(None, source="gguf", gguf_types={"Q4_1", "Q5_0"}, mapped=False) == "none"  # Q5_0: only mapped
    assert r(None, source="gguf", gguf_types={"Q4_1", "Q6_K"}, mapped=False) == "none"  # K-quants: only mapped
    assert r(None, source="gguf", gguf_types={"Q4_1"}, dtype=torch.bfloat16) == "none"
    assert r(None, source="hf") == "none"
    assert r("int4", source="hf") == "int4" and r("FP32", source="hf") == "none"
    with pytest.raises(qw.QuantizationError, match=r"'q3'.*none, gguf, int8, int4"):
        r("q3", source="gguf")
    with pytest.raises(qw.QuantizationError, match=r"needs a GGUF file.*Hugging Face folder.*none, int8, int4"):
        r("gguf", source="hf")
    with pytest.raises(qw.QuantizationError, match="CPU only"):
        r("int8", source="hf", device="meta")
    with pytest.raises(qw.QuantizationError, match="--dtype float32"):
        r("gguf", source="gguf", dtype=torch.bfloat16)
    monkeypatch.setenv("KVKEEPER_QUANTIZATION", "int8")  # read at the CLI's edge only, never here
    assert r(None, source="gguf", gguf_types={"Q4_1"}) == "gguf"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.utils.tiny_models import tiny_llama_folder

    # head_dim 32: the AVX-512 attention path; hidden 64, intermediate 128: multiples of 32
    return tiny_llama_folder(tmp_path_factory.mktemp("tinyq"), hidden_size=64, head_dim=32, num_layers=2,
                             num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_round_to_nearest_formats_on_a_hf_folder(kernels, tiny_folder, fmt):
    ref = make_engine(str(tiny_folder), quantization="none", num_kv_blocks=32)
    eng = make_engine(str(tiny_folder), quantization=fmt, num_kv_blocks=32)
    assert eng.runner.weight_format == fmt and fmt in eng.runner.weight_description
    assert eng.runner.fused_decode is not None
    assert isinstance(eng.runner.model.model.layers[0].mlp.down_proj, quantized.QuantLinear)
    assert eng.stats()["weight_format"] == fmt
    ids = list(range(5, 45))
    for e in (ref, eng):
        e.capture_first_logits = True
    a = ref.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    b = eng.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    sa = ref.add_request(ids, SamplingParams(max_tokens=1))
    sb = eng.add_request(ids, SamplingParams(max_tokens=1))
    ref.run_until_done([sa])
    eng.run_until_done([sb])
    err = (sa.first_logits - sb.first_logits).abs().max().item() / sa.first_logits.abs().max().item()
    assert err < (0.05 if fmt == "int8" else 0.25), err  # random weights: int4 steps are coarse
    assert len(b.token_ids) == len(a.token_ids) == 8
    with pytest.raises(InvalidRequestError, match="needs a GGUF file"):
        make_engine(str(tiny_folder), quantization="gguf", num_kv_blocks=8)


@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp16", "int8", "fp8"])
def test_fused_decode_is_batch_invariant_and_equals_mixed_steps(kernels, tiny_folder, kv):
    """A decode token gives the same logits whether its step is decode-only (one fused C++ call, which also writes
    the KV) or mixed with a prefill (the layer-by-layer path, PagedKV.write), and whatever else is in the batch."""
    eng = make_engine(str(tiny_folder), quantization="int4", num_kv_blocks=64, kv_dtype=kv)
    assert_fused_equals_mixed(eng, list(range(7, 40)), list(range(100, 160)))


# ---- the embedded model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_engine(kernels):
    return make_engine(quantization="gguf", kv_cache_bytes=256 << 20)


@pytest.mark.slow
def test_embedded_model_defaults_to_gguf(kernels, monkeypatch):
    monkeypatch.delenv("KVKEEPER_QUANTIZATION", raising=False)
    eng = make_engine(num_kv_blocks=16, quantization=None)  # None: the library's own default, not the suite's
    assert eng.runner.weight_format == "gguf"
    assert "Q4_1" in eng.runner.weight_description and "Q8_0" in eng.runner.weight_description
    assert eng.runner.attention_backend == "cpu" and eng.runner.fused_decode is not None


@pytest.mark.slow
def test_fused_step_equals_layer_by_layer(gguf_engine):
    """One decode step of the real model: the fused C++ step against the PyTorch modules, after 1, 2 and 30 layers."""
    from types import SimpleNamespace

    from kvkeeper.worker.fused_decode import FusedDecode

    eng = gguf_engine
    r, m = eng.runner, eng.runner.model
    seq = eng.add_request(eng.encode_chat([{"role": "user", "content": "Write a haiku."}]),
                          SamplingParams(max_tokens=8), namespace=eng.isolated_namespace())
    for _ in range(4):
        eng.step()
    ids, pos, meta, _, _ = r.build_batch([(seq, 1)])
    with torch.inference_mode():
        for n in (1, 2, 30):
            x = m.model.embed_tokens(ids).float()
            cs = m.rope.cos_sin(pos, x.dtype)
            want = x.clone()
            for layer, kv in zip(m.model.layers[:n], r.kv_store[:n]):
                want = layer(want, cs, kv, meta)
            sub = SimpleNamespace(config=m.config, rope=m.rope,
                                  model=SimpleNamespace(layers=m.model.layers[:n], embed_tokens=m.model.embed_tokens,
                                                        norm=m.model.norm))
            fd = FusedDecode(sub, r.kv_store[:n], cpu_kernels.load())
            got = x.clone().contiguous()
            fd.dm.step(got, m.rope.cos[pos].contiguous(), m.rope.sin[pos].contiguous(), meta.slot_mapping,
                       meta.decode_block_tables.contiguous(), meta.decode_context_lens, fd.scale, 16)
            assert torch.equal(got, want), (n, (got - want).abs().max().item())
    eng.run_until_done([seq])


@pytest.mark.slow
def test_gguf_perplexity_within_one_percent_of_float32_at_2k(engine, gguf_engine, tmp_path_factory):
    from kvkeeper.eval.perplexity import perplexity

    from tests.utils.book import book_ids_2k, float32_perplexity_2k

    ids = book_ids_2k(engine)
    fp32 = float32_perplexity_2k(engine, tmp_path_factory)["ppl"]  # perplexity(engine, ids), shared with test_kv_quant
    q = perplexity(gguf_engine, ids)["ppl"]
    assert abs(q / fp32 - 1) < 0.01, (q, fp32)
    assert q != fp32  # the activations really were rounded


@pytest.mark.slow
def test_gguf_audit_tolerance_sits_above_activation_rounding(kernels, mt_bench):
    """Reused and recomputed KV differ by activation rounding flips under gguf; the reuse audit's default
    tolerance for quantized weights passes clean sessions and still names a foreign block."""
    from kvkeeper.diagnostics import faults

    from kvkeeper.diagnostics.audit import ReuseAuditor
    from kvkeeper.sessions import SessionManager

    eng = make_engine(quantization="gguf", num_kv_blocks=200, validate_every=0)
    eng.auditor = ReuseAuditor(1.0).attach(eng)
    sessions = SessionManager(eng)
    for q in mt_bench[:3]:
        s = sessions.open()
        for turn in q["turns"]:
            s.send(turn, SamplingParams(max_tokens=16))
        s.close()
    assert eng.auditor.total == 6 and eng.auditor.mismatches == 0
    from tests.unit.diagnostics.test_audit import TEXT_A, TEXT_B

    ids_a = eng.tokenizer.encode(TEXT_A)
    ids_b = ids_a[:5] + eng.tokenizer.encode(TEXT_B)
    ns_a = eng.isolated_namespace("a")
    eng.generate([ids_a], SamplingParams(max_tokens=2), namespace=ns_a)
    bid, _ = eng.pool.lookup(None, ns_a, ids_a[:16])
    seq = eng.add_request(ids_b, SamplingParams(max_tokens=2), namespace=eng.isolated_namespace("b"))
    faults.reuse_foreign_block(eng, seq, bid)
    eng.run_until_done([seq])
    rep = next(r for r in eng.auditor.reports if r.request_id == seq.request_id)
    assert not rep.ok and (rep.layer, rep.token, rep.tensor) == (0, 5, "k")


# ---- CLI, metrics, fallback --------------------------------------------------------------------------------


def test_metrics_say_which_format_runs():
    from kvkeeper.api.engine_client.metrics import ServerMetrics

    m = ServerMetrics()
    m.update({"weight_format": "gguf"})
    assert 'kvkeeper:weight_format{format="gguf"} 1.0' in m.render().decode()
