"""GGUF K-quant matrices computed in place (kvkeeper.layers.gguf_linear, the ``gguf`` weight format).

* :class:`GGUFLinear` / :class:`GGUFEmbedding` on awkward shapes (N = 1, N not a multiple of 16, M = 1, M = 17),
  fused parts, output permutation and bias, against ``x @ gguf.quants.dequantize(w).T`` computed here;
* the tiny synthetic Q4_K_M file (tests/weights/conftest.py) loads with its matrices mapped: no file under the
  weights cache, resident memory growth below a bound that the float32 path exceeds;
* its logits and greedy tokens equal the ``--quantization none`` path's; the load line says what was mapped.

Tolerances: the PyTorch reference dequantizes the same blocks with the same function (``gguf.quants.dequantize``)
as the float32 path, so the only difference is float32 summation order (separate q/k/v products against one fused
one, another BLAS layout): 1e-5 relative on a product, 1e-4 absolute on logits of size ~5.  With the C++
``kq_matmul`` (activations rounded to 8 bits per block inside the kernel, as llama.cpp's vec_dot does) products
differ by the activation rounding: :func:`_tol` bounds it then, and the logits test allows 5% of the largest logit (parity against the
float32 path then belongs to a perplexity test).
"""

import gc
import re

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvkeeper.layers.gguf_linear import (GGUFEmbedding, GGUFLinear, GGUFWeight, kernel_ops,  # noqa: E402
                                         rope_out_perm)

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"]


def _weight(synth, type_name: str, n: int, k: int, seed: int = 0) -> tuple[GGUFWeight, torch.Tensor]:
    """A random (n, k) GGUF matrix of type_name and its float32 dequantization (computed with gguf directly)."""
    raw = synth.random_tensor(np.random.default_rng(seed), type_name, n, k)
    qt = gguf.GGMLQuantizationType[type_name]
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qt), dtype=np.float32).reshape(n, k))
    return GGUFWeight(torch.from_numpy(raw), int(qt), n, k), ref


def _tol(layer_uses_kernel: bool, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Bound (M, N) on |y - x @ w.T| for x (M, K), w (N, K) float32.  The PyTorch reference: float32 summation
    order only, 1e-5 * |x| |w_n|.  The C++ kernel rounds each activation to int8 of its block's max / 127
    (error <= max|x_m| / 254 per element), so by Cauchy-Schwarz |dy| <= sqrt(K) max|x_m| / 254 * |w_n| plus the
    float32 rounding of the scaling (2e-6 |x_m| |w_n|; the kernel tests' bound, tests/kernels/test_kquant.py)."""
    xn, wn = x.norm(dim=-1, keepdim=True), w.norm(dim=-1)[None, :]
    if not layer_uses_kernel:
        return 1e-5 * xn * wn + 1e-6
    xq = x.abs().amax(-1, keepdim=True) * x.shape[-1] ** 0.5 / 254
    return (xq + 2e-6 * xn) * wn + 1e-6


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n, m", [(1, 1), (17, 1), (17, 17), (40, 3), (1, 17)])
def test_linear_awkward_shapes(synth, type_name, n, m):
    k = 512
    w, ref = _weight(synth, type_name, n, k)
    layer = GGUFLinear(w.data, w.ggml_type, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n * 100 + m))
    y = layer(x)
    want = x @ ref.T
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y - want).abs() <= _tol(kernel_ops(type_name)[2], x, ref)).all()
    assert layer(x[0]).shape == (n,)  # a 1-D input keeps its leading shape


def test_fused_parts_permutation_and_bias(synth):
    k = 256
    (q, rq), (kk, rk), (v, rv) = (_weight(synth, t, n, k, s) for s, (t, n) in
                                  enumerate([("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)]))
    q.out_perm, kk.out_perm = rope_out_perm(64, 2), rope_out_perm(32, 1)
    bias = torch.randn(128)
    layer = GGUFLinear.fused([q, kk, v], bias)
    x = torch.randn(5, k)
    want = x @ torch.cat([rq[q.out_perm], rk[kk.out_perm], rv]).T + bias
    y = layer(x)
    assert layer.out_features == 128
    w_all = torch.cat([rq[q.out_perm], rk[kk.out_perm], rv])
    assert ((y - want).abs() <= _tol(kernel_ops("Q4_K")[2] or kernel_ops("Q6_K")[2], x, w_all)).all()
    assert torch.equal(q.dequantize(), rq[q.out_perm])
    with pytest.raises(ValueError, match="same K"):
        GGUFLinear.fused([q, _weight(synth, "Q4_K", 8, 512)[0]])
    with pytest.raises(ValueError, match="bias"):
        GGUFLinear.fused([q], torch.zeros(3))


def test_rope_out_perm_is_the_loaders_row_permutation():
    from kvkeeper.weights.loader import _unpermute_rope

    w = np.random.default_rng(0).standard_normal((96, 8)).astype(np.float32)
    perm = rope_out_perm(96, 3)
    assert np.array_equal(w[perm.numpy()], _unpermute_rope(w, 3))
    assert sorted(perm.tolist()) == list(range(96)) and perm.tolist() != list(range(96))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_embedding_rows_and_tied_head(synth, type_name):
    w, ref = _weight(synth, type_name, 33, 256)
    emb = GGUFEmbedding(w)
    ids = torch.tensor([[0, 32, 5], [5, 17, 1]])
    assert torch.allclose(emb(ids), ref[ids], atol=1e-6)
    h = torch.randn(4, 256)
    assert ((emb.gguf_logits(h) - h @ ref.T).abs() <= _tol(kernel_ops(type_name)[2], h, ref)).all()
    with pytest.raises(IndexError):
        emb(torch.tensor([33]))


# ---- the tiny synthetic model ---------------------------------------------------------------------------
def _rss_bytes() -> int:
    """Resident memory of this process (bytes, VmRSS): heap and the pages of mapped files it has touched (a
    float32 copy read from the safetensors cache is file-backed, so RssAnon alone would miss it)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def _file_maps(path) -> list[tuple[int, int]]:
    """(start, end) addresses of this process's memory maps of ``path`` (/proc/self/maps)."""
    real = str(path.resolve())
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                out.append((lo, hi))
    return out


def _build(path, cache, quantization):
    from kvkeeper.models.llama import LlamaForCausalLM, skip_init
    from kvkeeper.weights.formats import may_map_gguf, prepare_weights
    from kvkeeper.weights.loader import load_weights

    cfg, state = load_weights(path, cache, in_place=may_map_gguf(quantization))
    prepared = prepare_weights(state, cfg, quantization, cache=cache)
    with skip_init(), torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.load_weights(prepared.state)
    with torch.no_grad():  # touch the weights (a lazily mapped float32 copy becomes resident only when read)
        h = model.model.embed_tokens(torch.tensor([1, 2, 3]))
        for layer in model.model.layers:
            h = h + layer.mlp(h)
        assert bool(model.compute_logits(h).isfinite().all())
    return model, prepared.description


def test_tiny_q4_k_m_loads_mapped_without_a_float32_copy(tiny_gguf, tmp_path):
    from kvkeeper.kernels import cpu as cpu_kernels

    cache = tmp_path / "cache"
    cpu_kernels.load()
    # warm-up (one-time imports and initialisation are not the weights), kept alive so that the memory it holds
    # is not handed to the measured load again
    warm = _build(tiny_gguf, cache, "gguf")
    gc.collect()
    before = _rss_bytes()
    model, desc = _build(tiny_gguf, cache, "gguf")
    gc.collect()
    grew = _rss_bytes() - before
    size = tiny_gguf.stat().st_size
    bound = size + (16 << 20)  # the file (20 MB) plus 16 MB; its float32 weights are ~105 MB
    assert grew < bound, f"resident memory grew by {grew / 1e6:.1f} MB loading a {size / 1e6:.1f} MB file"
    assert not (cache / "weights").exists() or not any((cache / "weights").iterdir())
    layer = model.model.layers[0]
    for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                model.lm_head):
        assert isinstance(mod, GGUFLinear)
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert [p.type_name for p in model.model.layers[1].self_attn.qkv_proj.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    maps = _file_maps(tiny_gguf)
    weights = [p for m in model.modules() if isinstance(m, GGUFLinear) for p in m.parts]
    weights.append(model.model.embed_tokens.weight_gguf)
    assert maps and all(any(lo <= w.data.data_ptr() and w.data.data_ptr() + w.nbytes <= hi for lo, hi in maps)
                        for w in weights), "a GGUF matrix is not a view of the file's memory map"
    assert re.search(r"gguf: 18\.\d\d MB mapped in place \(Q4_K [\d.]+, Q6_K [\d.]+\), 0\.00 MB repacked", desc), desc
    # the bound excludes a float32 copy: the exact path holds more float32 weight bytes than the bound and writes its
    # cache (counted from its parameters: in a process that already ran many tests, freed memory is reused and RSS
    # need not grow)
    del model
    gc.collect()
    ref, desc = _build(tiny_gguf, cache, "none")
    assert sum(p.numel() * p.element_size() for p in ref.parameters()) > bound
    assert any((cache / "weights").iterdir())
    assert desc == "float32 weights" and warm[0] is not ref


def test_tiny_q4_k_m_logits_equal_the_float32_path(tiny_gguf, tiny_cache):
    from kvkeeper import SamplingParams
    from tests.utils.engines import make_engine

    # the C++ kq_matmul rounds activations to int8 per block: measured up to 1.8% of the largest logit on this
    # file (2 prompts); bound 5%, and the first token kept wherever the float32 top-2 margin exceeds twice that
    kernel = any(kernel_ops(t)[2] for t in ("Q4_K", "Q6_K"))
    prompts = [list(range(1, 40)), [1, 9038, 2409, 314, 253, 1115, 30]]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    out = {}
    for q in ("gguf", "none"):
        eng = make_engine(str(tiny_gguf), quantization=q, num_kv_blocks=32, cache_dir=str(tiny_cache),
                        kv_dtype="float32")
        assert eng.runner.weight_format == q
        norms = []
        hooks = [m.register_forward_hook(lambda mod, a, y: norms.append(float(y.pow(2).mean().sqrt())))
                 for m in eng.runner.model.model.layers]
        eng.capture_first_logits = True
        seqs = [eng.add_request(p, greedy) for p in prompts]
        eng.run_until_done(seqs)
        for h in hooks:
            h.remove()
        out[q] = [(s.first_logits, s.output_token_ids) for s in seqs]
        assert norms and all(0.01 < r < 100 for r in norms), norms  # hidden states stay of unit-ish RMS
        if q == "gguf":
            assert "mapped in place" in eng.runner.weight_description
    for (lg, tg), (lf, tf) in zip(out["gguf"], out["none"]):
        assert bool(lg.isfinite().all()) and lg.abs().max() > 1.0  # random weights still give peaked logits
        if not kernel:
            assert (lg - lf).abs().max() < 1e-4
            assert tg == tf
            continue
        diff = float((lg - lf).abs().max())
        assert diff <= 0.05 * float(lf.abs().max()), diff
        top2 = lf.topk(2).values
        if float(top2[0] - top2[1]) > 2 * diff:
            assert tg[0] == tf[0]


def test_kernels_with_kq_matmul_are_used_and_make_k_quants_the_default(synth, monkeypatch):
    """With a kernels module that has kq_matmul / kq_dequantize_rows, the layers call them and the default format of a
    mapped K-quant file is gguf (here a stand-in module that records its calls)."""
    from types import SimpleNamespace

    from kvkeeper.layers import gguf_linear
    from kvkeeper.weights import formats

    calls = []

    def mm(x, w, t, n, k):
        calls.append(("mm", n))
        return gguf_linear.reference_kq_matmul(x, w, t, n, k)

    r = formats.resolve_quantization
    fake = SimpleNamespace(kq_matmul=mm, kq_dequantize_rows=gguf_linear.reference_kq_dequantize_rows)
    monkeypatch.setattr(gguf_linear.cpu_kernels, "load", lambda: fake)
    monkeypatch.setattr(formats.cpu_kernels, "available", lambda: True)
    assert r(None, source="gguf", gguf_types={"Q4_K", "Q6_K"}) == "gguf"
    assert r(None, source="gguf", gguf_types={"Q4_K", "Q6_K"}, mapped=False) == "none"  # e.g. Gemma 3: not mapped
    assert r(None, source="gguf", gguf_types={"Q4_K", "IQ2_XS"}) == "none"  # a type kq_matmul does not run
    w, ref = _weight(synth, "Q4_K", 17, 256)
    layer = GGUFLinear(w.data, w.ggml_type, 17, 256)
    x = torch.randn(3, 256)
    assert (layer(x) - x @ ref.T).abs().max() < 1e-4 and calls == [("mm", 17)]
    assert "(kernel)" in layer.extra_repr()


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_fused_decode_over_mapped_k_quants_equals_the_layer_path(tiny_gguf, tiny_cache, kv):
    """The tiny Q4_K_M file (Q4_K and Q6_K matrices in place, llama q/k rows permuted) takes the fused decode step
    (one C++ call per step over the mapped bytes).  Within that engine a sequence's tokens and logprobs are the same
    bit for bit alone (every decode step fused) and with a prefill landing in the middle of its decode (those mixed
    steps run layer by layer, with the same C++ routines).  Against the engine without the fused step (PyTorch's
    RMSNorm, RoPE and SiLU: other float rounding) the tokens agree and the logprobs within 1e-3 (bf16 KV) or 2e-2
    (int8 KV, whose rounding steps magnify the difference: measured 0.0066)."""
    from kvkeeper import SamplingParams
    from tests.utils.engines import alone_and_mixed, make_engine
    from tests.utils.kernels import kernels_or_skip

    mod = kernels_or_skip()
    if not hasattr(mod, "kq_matmul"):
        pytest.skip("kernels without kq_matmul")
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    p1, p2 = list(range(7, 40)), list(range(100, 170))
    runs = {}
    for fused in (True, False):
        eng = make_engine(str(tiny_gguf), quantization="gguf", num_kv_blocks=32, kv_dtype=kv, fused_decode=fused,
                          cache_dir=str(tiny_cache))
        assert (eng.runner.fused_decode is not None) is fused and eng.runner.attention_backend == "cpu"
        alone, s1, s2 = alone_and_mixed(eng, p1, p2, params)
        runs[fused] = (alone.token_ids, [lp["top"] for lp in alone.logprobs], list(s1.output_token_ids),
                       [lp["top"] for lp in s1.logprobs], list(s2.output_token_ids))
    fused, plain = runs[True], runs[False]
    assert fused[0] == fused[2] and fused[1] == fused[3]  # batch-invariant decode, bit for bit
    assert plain[0] == plain[2]
    assert fused[0] == plain[0] and fused[4] == plain[4]
    diff = max(abs(a[1] - b[1]) for ta, tb in zip(fused[1], plain[1]) for a, b in zip(ta, tb))
    assert diff < {"bf16": 1e-3, "int8": 2e-2}[kv], diff


def test_lora_over_mapped_k_quants(tiny_gguf, tiny_cache, tmp_path):
    """A PEFT adapter on every projection of the tiny Q4_K_M file run in place: it changes the logits by the same
    low-rank term as on the float32 path of the same file (within the kernels' rounding), and a batch mixing the
    adapter and the base model gives each sequence what it gets alone, bit for bit (a step with an adapter runs layer
    by layer, a base-only decode step fused: the same C++ routines)."""
    peft = pytest.importorskip("peft")
    import transformers
    from kvkeeper import SamplingParams
    from tests.utils.engines import make_engine

    # an adapter for the file's shapes (hidden 256, 2 layers, 4 heads / 2 KV heads of 64, FFN 512)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64))
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm = peft.get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    pm.save_pretrained(tmp_path / "adapter")
    prompt = list(range(7, 40))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    delta, alone = {}, {}
    for q in ("gguf", "none"):
        eng = make_engine(str(tiny_gguf), quantization=q, num_kv_blocks=32, kv_dtype="float32",
                          cache_dir=str(tiny_cache))
        eng.load_lora("a", tmp_path / "adapter")
        eng.capture_first_logits = True
        runs = {}
        for lora in ("a", None):
            s = eng.add_request(prompt, params, namespace=eng.isolated_namespace(), lora=lora)
            eng.run_until_done([s])
            runs[lora] = (s.first_logits, list(s.output_token_ids))
        delta[q] = runs["a"][0] - runs[None][0]
        alone[q] = runs
        if q == "gguf":
            assert eng.runner.fused_decode is not None
            mixed = [eng.add_request(prompt, params, namespace=eng.isolated_namespace(), lora=lora)
                     for lora in ("a", None)]
            eng.run_until_done(mixed)
            assert [list(s.output_token_ids) for s in mixed] == [runs["a"][1], runs[None][1]]
            assert torch.equal(mixed[0].first_logits, runs["a"][0]) and torch.equal(mixed[1].first_logits, runs[None][0])
    scale = float(delta["none"].abs().max())
    assert scale > 0.1  # the adapter moves the logits
    assert float((delta["gguf"] - delta["none"]).abs().max()) < 0.1 * scale
