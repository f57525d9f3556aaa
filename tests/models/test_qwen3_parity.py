"""Qwen3 and Qwen3-MoE: exact parity with transformers on tiny random checkpoints, from a Hugging Face folder and from
a GGUF file.

Each case builds a tiny transformers ``Qwen3Config`` / ``Qwen3MoeConfig`` (head_dim not hidden / heads, per-head q/k
norms; MoE: 8 or 4 experts, top-2, with and without renormalized weights, a dense layer among MoE ones), randomises
its weights (tests/utils/tiny_models.py) and saves it with the embedded model's tokenizer; the cases llama.cpp can
express are also written as a GGUF (``qwen3`` / ``qwen3moe``, float32 tensors under llama.cpp's names and metadata,
the tokenizer fields copied from the embedded GGUF).  On the exact path (``--quantization none``, float32) the
engine's logits at every position (one-shot, chunked over cached blocks, decode, packed sequences) are within 1e-4
of transformers', and its greedy tokens equal transformers' for a prompt, the same prompt again (a prefix-cache hit)
and a second turn (first prompt + answer + a new user message, which reuses the first turn's KV).  GGUFs of F16 and
Q8_0 matrices run ``--quantization gguf`` (F16 in place, Q8_0 repacked; Qwen3-MoE's experts dequantized at load)
with the logits of the dequantized path, and a Q4_K_M-mix file runs in place over the K-quant kernels; int8 / int4
run on a Qwen3 folder.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvkeeper import SamplingParams
from kvkeeper.errors import ModelFormatError, UnsupportedArchitectureError
from kvkeeper.model_config import ModelConfig

from tests.utils.engines import assert_fused_equals_mixed, make_engine
from tests.utils.tiny_gguf import write_qwen3_gguf
from tests.utils.tiny_models import _one_thread, tokenizer  # noqa: F401 - fixtures
from tests.utils.tiny_models import (hf_greedy, hf_logits, kk_logits_chunked, random_prompt, randomise_weights,
                                     save_tiny, tiny_hf)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

ATOL = 1e-4
GEN = 16
_BASE = dict(hidden_size=64, intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=1024)

# id -> (config class, kwargs, also written as a GGUF)
CASES = {
    # head_dim 32 with 4 heads of a 64-wide model (q width 128 != hidden), GQA 2, untied, large theta
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1000000.0}), True),
    # tied, q/k/v/o biases (attention_bias), MHA
    "qwen3-tied-bias": ("Qwen3Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                            head_dim=16, tie_word_embeddings=True, attention_bias=True), False),
    # every layer MoE (as llama.cpp's qwen3moe), 8 experts, top-2, renormalized weights (llama.cpp always does)
    "qwen3moe": ("Qwen3MoeConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, norm_topk_prob=True), True),
    # a dense layer between two MoE ones (mlp_only_layers), 4 experts, top-2, weights not renormalized
    "qwen3moe-dense-layer": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                                    head_dim=16, tie_word_embeddings=False, num_experts=4,
                                                    num_experts_per_tok=2, moe_intermediate_size=48,
                                                    norm_topk_prob=False, mlp_only_layers=[1]), False),
}
SOURCES = [(name, src) for name, (_, _, has_gguf) in CASES.items() for src in (("hf", "gguf") if has_gguf else ("hf",))]


# ---- fixtures ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):  # noqa: F811
    """name -> (transformers model fp32, {"hf": folder, "gguf": file}) for every case (built once)."""
    out = {}
    for seed, (name, (cls_name, kw, has_gguf)) in enumerate(CASES.items()):
        cfg = getattr(transformers, cls_name)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                              eos_token_id=tokenizer.eos_token_id, **_BASE, **kw)
        hf = tiny_hf(cfg, seed)
        paths = {"hf": save_tiny(hf, tokenizer, tmp_path_factory.mktemp(name))}
        if has_gguf:
            paths["gguf"] = write_qwen3_gguf(hf, tmp_path_factory.mktemp(f"{name}-gguf") / f"{name}.gguf")
        out[name] = hf, paths
    return out


@pytest.fixture(scope="module", params=SOURCES, ids=[f"{n}-{s}" for n, s in SOURCES])
def case(request, models, tmp_path_factory):
    """(name, transformers model, engine on the exact path: blocks of 4 tokens, 8 tokens per step)."""
    name, src = request.param
    hf, paths = models[name]
    eng = make_engine(model=str(paths[src]), quantization="none", num_kv_blocks=96, block_size=4,
                      max_num_batched_tokens=8, cache_dir=str(tmp_path_factory.mktemp("cache")))
    return name, hf, eng


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"{what}: max |logit diff| {diff:.3g} >= {ATOL} (logits span {ref.abs().max():.3g})"


GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


# ---- parity --------------------------------------------------------------------------------------------------------
def test_config_read_back(case):
    name, hf, eng = case
    c, hc = eng.model_config, hf.config
    assert c.architecture == hc.model_type
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        hc.num_hidden_layers, hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert c.tie_word_embeddings == hc.tie_word_embeddings and c.attention_bias == hc.attention_bias
    assert c.rope_theta == hc.rope_parameters["rope_theta"] and c.sliding_window is None
    if hc.model_type == "qwen3_moe":
        assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (
            hc.num_experts, hc.num_experts_per_tok, hc.moe_intermediate_size, hc.norm_topk_prob)
        layers = eng.runner.model.model.layers
        assert [type(layer.mlp).__name__ for layer in layers] == [
            "MLP" if i in hc.mlp_only_layers else "MoE" for i in range(hc.num_hidden_layers)]


def test_logits_every_position(case):
    """One-shot prefill, then chunks over cached blocks, decode steps and two sequences packed per step: the
    logits of every position are within 1e-4 of transformers'."""
    name, hf, eng = case
    a, b = random_prompt(37, 1), random_prompt(19, 2)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    top2 = ref_a.topk(2, dim=-1).values  # logits far from tied: the comparison means something
    assert (top2[:, 0] - top2[:, 1]).median() > 100 * ATOL and len(set(ref_a.argmax(-1).tolist())) > 10
    (one_shot,) = kk_logits_chunked(eng, [a], [[len(a)]])
    _assert_close(one_shot, ref_a, f"{name} one-shot prefill")
    ours_a, ours_b = kk_logits_chunked(eng, [a, b], [[10, 1], [1, 0], [1, 13], [6, 1], [19, 4]])
    _assert_close(ours_a, ref_a, f"{name} chunked/decode a")
    _assert_close(ours_b, ref_b, f"{name} chunked/decode b")


def test_greedy_prefix_hit_and_second_turn(case, tokenizer):  # noqa: F811
    """Greedy tokens equal transformers' for a prompt; the same prompt again hits the prefix cache and gives them
    again; a second turn (prompt + answer + a new user message) reuses the first turn's KV and equals
    transformers' greedy continuation of the whole conversation."""
    name, hf, eng = case
    first = random_prompt(23, 3)
    ref = hf_greedy(hf, first, GEN)
    assert len(set(ref)) >= 4, f"{name}: degenerate reference generation {ref}"
    out1 = eng.generate([first], GREEDY)[0]
    assert out1.token_ids == ref, f"{name}: greedy tokens differ"
    again = eng.generate([first], GREEDY)[0]
    assert again.cached_tokens == (len(first) - 1) // 4 * 4 > 0
    assert again.token_ids == ref, f"{name}: greedy tokens differ on a prefix-cache hit"
    user = tokenizer.encode("<|im_start|>user\nAnd what comes next?<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
    second = first + out1.token_ids + user
    out2 = eng.generate([second], GREEDY)[0]
    assert out2.cached_tokens >= len(first) // 4 * 4
    assert out2.token_ids == hf_greedy(hf, second, GEN), f"{name}: greedy tokens differ on the second turn"
    eng.pool.check_invariants()


# ---- GGUF matrices in place -----------------------------------------------------------------------------------------
GGUF_CASES = [n for n, (_, _, g) in CASES.items() if g]


@pytest.mark.parametrize("matrices, layer, atol", [("F16", "GGUFLinear", ATOL), ("Q8_0", None, None)])
@pytest.mark.parametrize("name", GGUF_CASES)
def test_gguf_in_place(models, tmp_path, name, matrices, layer, atol):
    """A GGUF of F16 or Q8_0 matrices runs ``--quantization gguf`` with its matrices mapped in place (GGUFLinear),
    except Qwen3's Q8_0, repacked for its fused decode step as Llama's is (QuantLinear; Qwen3-MoE has no fused
    step, so its Q8_0 stays mapped); Qwen3-MoE's experts (3-D tensors)
    dequantized at load.  Its logits equal the dequantized path's on the same file: F16 within 1e-4 (float32
    summation order), Q8_0 within 5% of the largest logit (kq_matmul's int8 activations; for Qwen3-MoE at 75% of
    the positions at least, its random router's near-ties flipping elsewhere); greedy tokens are the same."""
    from tests.utils.kernels import kernels_or_skip

    kernels_or_skip()
    hf, _ = models[name]
    path = write_qwen3_gguf(hf, tmp_path / f"{name}-{matrices}.gguf", matrices=matrices)
    engines = {fmt: make_engine(model=str(path), quantization=fmt, kv_dtype="fp32", num_kv_blocks=32,
                                block_size=4, cache_dir=str(tmp_path / "cache")) for fmt in ("gguf", "none")}
    desc = engines["gguf"].runner.weight_description
    assert engines["gguf"].runner.weight_format == "gguf", desc
    moe = hf.config.model_type == "qwen3_moe"
    layer = layer or ("GGUFLinear" if moe else "QuantLinear")
    if matrices == "F16":
        assert "mapped in place (F16" in desc and ("MoE router and experts" in desc) == moe, desc
    for block in engines["gguf"].runner.model.model.layers:
        assert type(block.self_attn.qkv_proj).__name__ == type(block.self_attn.o_proj).__name__ == layer
        experts = getattr(block.mlp, "experts", None)
        assert experts is None or experts.gate_up_proj.dtype == torch.float32  # MoE: dequantized at load
    a, b = random_prompt(21, 4), random_prompt(9, 5)
    got, want = (kk_logits_chunked(e, [a, b], [[8, 3], [13, 1], [0, 5]]) for e in (engines["gguf"], engines["none"]))
    if atol is None and moe:
        # Q8_0 mapped (kq_matmul's int8 activations) under a random router: a near-tied expert choice can flip at a
        # position and move its logits far (see test_k_quant_file_in_place); most positions stay within 5%
        rows = [(g - w).abs().amax(-1) <= 0.05 * w.abs().amax(-1) for g, w in zip(got, want)]
        ok = torch.cat(rows).float().mean().item()
        assert ok >= 0.75, f"{name} {matrices}: {ok:.0%} of positions within 5% of the largest logit"
        return
    for g, w in zip(got, want):
        diff = (g - w).abs().max().item()
        bound = atol if atol is not None else 0.05 * w.abs().max().item()  # Q8_0: int8 activations in kq_matmul
        assert diff < bound, f"{name} {matrices}: gguf vs none max |logit diff| {diff:.3g} (bound {bound:.3g})"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert engines["gguf"].generate([a], params)[0].token_ids == engines["none"].generate([a], params)[0].token_ids


K_QUANT_ARCHS = {"qwen3": ("Qwen3Config", {}), "qwen3moe": ("Qwen3MoeConfig", dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True))}


@pytest.fixture(scope="module", params=list(K_QUANT_ARCHS))
def k_quant_file(request, tmp_path_factory, tokenizer):  # noqa: F811
    """(moe options, the Q4_K_M-mix file, its cache folder, the engine on the file dequantized (``none``: the
    reference), Qwen3-MoE's layer-1 experts as the gguf package dequantizes them or None) for one architecture,
    built once for both matmul paths of test_k_quant_file_in_place (each path built the same seeded file, the
    reference engine and the gguf package's experts again before; the reference's sequences are freed after
    every use and nothing is committed to its prefix cache, so both paths see the same engine state)."""
    from tests.utils.kernels import kernels_or_skip

    kernels_or_skip()
    cls_name, moe = K_QUANT_ARCHS[request.param]
    cfg = getattr(transformers, cls_name)(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=64, tie_word_embeddings=False, max_position_embeddings=1024, **moe)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    randomise_weights(hf, 0)  # (only the norms are kept: the matrices are random blocks)
    out = tmp_path_factory.mktemp(f"k-quant-{request.param}")
    path = write_qwen3_gguf(hf, out / "q4_k_m.gguf", matrices="Q4_K_M")
    cache = out / "cache"
    reference = make_engine(model=str(path), quantization="none", kv_dtype="fp32", num_kv_blocks=32, block_size=4,
                            cache_dir=str(cache))
    experts = None
    if moe:  # layer 1's experts as the gguf package reads and dequantizes them (gate, up, down)
        reader = gguf.GGUFReader(str(path))
        t = {x.name: x for x in reader.tensors}
        experts = [torch.from_numpy(np.asarray(gguf.quants.dequantize(t[f"blk.1.{k}.weight"].data,
                                                                      t[f"blk.1.{k}.weight"].tensor_type)))
                   for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    return moe, path, cache, reference, experts


@pytest.mark.parametrize("kernels", [False, True], ids=["reference-matmul", "kq-kernels"])
def test_k_quant_file_in_place(k_quant_file, monkeypatch, kernels):
    """A file in llama.cpp's Q4_K_M mix (random valid Q4_K / Q6_K blocks; shapes multiples of 256) runs the default
    format, gguf: attention, dense MLP, embedding and LM head mapped in place (GGUFLinear); Qwen3-MoE's 3-D expert
    tensors dequantized at load, equal to the gguf package's dequantization in transformers' gate/up order.
    With the PyTorch reference of the in-place matmul the logits equal the dequantized path's within 1e-4; with
    the C++ K-quant kernels (activations rounded to int8 per block) Qwen3's are within 5% of the largest logit
    (the bound of tests/unit/weights/test_gguf_in_place.py; measured 3.3%); Qwen3-MoE's too at the positions
    where every layer picked the same experts (measured 20 of 21 positions, 4.1%): the rounding flips a near-tied
    expert choice of these random routers now and then, which moves that position's logits (measured 25%)."""
    from kvkeeper.layers import gguf_linear

    moe, path, cache, reference, want = k_quant_file
    if not kernels:
        monkeypatch.setattr(gguf_linear, "KERNEL_TYPES", frozenset())  # every GGUFLinear on the reference
    auto = None if kernels else "gguf"  # (auto picks gguf where the kernels run the file's types)
    engines = {auto: make_engine(model=str(path), quantization=auto, kv_dtype="fp32", num_kv_blocks=32,
                                 block_size=4, cache_dir=str(cache)), "none": reference}
    eng = engines[auto]
    desc = eng.runner.weight_description
    assert eng.runner.weight_format == "gguf" and "mapped in place (Q4_K" in desc, desc
    assert ("MoE router and experts" in desc) == bool(moe), desc
    for block in eng.runner.model.model.layers:
        assert type(block.self_attn.qkv_proj).__name__ == type(block.self_attn.o_proj).__name__ == "GGUFLinear"
    if moe:
        experts = eng.runner.model.model.layers[1].mlp.experts
        assert torch.equal(experts.gate_up_proj, torch.cat(want[:2], dim=1))
        assert torch.equal(experts.down_proj, want[2])
    a, b = random_prompt(21, 4), random_prompt(9, 5)
    got, ref = (kk_logits_chunked(e, [a, b], [[8, 3], [13, 1], [0, 5]]) for e in engines.values())
    for g, r in zip(got, ref):
        assert bool(g.isfinite().all()) and r.abs().max() > 1.0
        diff = float((g - r).abs().max())
        if not kernels:
            assert diff < ATOL, f"{diff:.3g}"
        elif not moe:
            assert diff <= 0.05 * float(r.abs().max()), f"{diff:.3g} vs largest logit {float(r.abs().max()):.3g}"
    if kernels and moe:  # where every layer picked the same experts, the 5% bound holds (measured: 20 of 21)
        (g, route_g), (r, route_r) = (_routed_logits(e, a) for e in engines.values())
        same = torch.stack([(x == y).all(-1) for x, y in zip(route_g, route_r)]).all(0)
        assert int(same.sum()) >= len(a) - 3, f"expert choices differ at {int((~same).sum())} of {len(a)} positions"
        assert float((g - r).abs().amax(-1)[same].max()) <= 0.05 * float(r.abs().max())


def _routed_logits(eng, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits (T, vocab), per MoE layer the experts each position picked, sorted (T, k)) of a one-shot prefill."""
    from kvkeeper.layers.moe import Router

    routes = []
    hooks = [m.register_forward_hook(lambda mod, args, out: routes.append(out[1].sort(-1).values))
             for m in eng.runner.model.modules() if isinstance(m, Router)]
    try:
        (logits,) = kk_logits_chunked(eng, [ids], [[len(ids)]])
    finally:
        for h in hooks:
            h.remove()
    return logits, routes


@pytest.mark.parametrize("fmt, rel", [("int8", 0.05), ("int4", 0.35)])
def test_qwen3_packed_formats(models, tmp_path, fmt, rel):
    """int8 / int4 round-to-nearest on a Qwen3 folder: packed projections, the q/k norms applied on the layer-by-layer
    path and in the fused C++ decode step (a decode token equal bit for bit either way), logits near transformers'
    (relative error
    bounded per format: measured 1.9% (int8) and 23% (int4) on this model, 2.2% and 26% on a tiny Llama of the same
    shapes and weights: the formats' rounding of these random weights; with the q/k norms skipped, 36% and 42%)."""
    from tests.utils.kernels import kernels_or_skip

    kernels_or_skip()
    hf, paths = models["qwen3"]
    eng = make_engine(model=str(paths["hf"]), quantization=fmt, kv_dtype="fp32", num_kv_blocks=32, block_size=4,
                      cache_dir=str(tmp_path / "cache"))
    assert eng.runner.weight_format == fmt and eng.runner.fused_decode is not None
    assert type(eng.runner.model.model.layers[0].self_attn.qkv_proj).__name__ == "QuantLinear"
    assert_fused_equals_mixed(eng, random_prompt(30, 1), random_prompt(40, 2))
    a = random_prompt(21, 4)
    (got,) = kk_logits_chunked(eng, [a], [[8], [12], [1]])
    ref = hf_logits(hf, a)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < rel, f"{fmt}: relative logit error {err:.3g}"


# ---- configuration --------------------------------------------------------------------------------------------------
def _moe_dict(**over) -> dict:
    return {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 6, "num_attention_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, **over}


@pytest.mark.parametrize("step, dense", [(1, []), (2, []), (1, [0, 5]), (3, [2])])
def test_moe_layers_follow_transformers(step, dense):
    """Which layers are MoE: transformers' rule ((i + 1) % decoder_sparse_step == 0, not in mlp_only_layers)."""
    raw = _moe_dict(decoder_sparse_step=step, mlp_only_layers=dense)
    cfg = ModelConfig.from_hf_dict(raw)
    want = [i not in dense and (i + 1) % step == 0 for i in range(6)]
    assert [cfg.is_moe_layer(i) for i in range(6)] == want
    hc = transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    layers = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer
    with torch.device("meta"):
        assert [type(layers(hc, i).mlp).__name__ == "Qwen3MoeSparseMoeBlock" for i in range(6)] == want


def test_configs_refused_with_a_reason():
    with pytest.raises(ModelFormatError, match="num_experts"):
        ModelConfig.from_hf_dict({k: v for k, v in _moe_dict().items() if k != "num_experts"})
    with pytest.raises(UnsupportedArchitectureError, match="use_sliding_window"):
        ModelConfig.from_hf_dict({**_moe_dict(), "model_type": "qwen3", "use_sliding_window": True})
    with pytest.raises(UnsupportedArchitectureError, match="hidden_act"):
        ModelConfig.from_hf_dict(_moe_dict(hidden_act="gelu"))
    # transformers writes num_experts as num_local_experts; the architectures entry alone names the family
    cfg = ModelConfig.from_hf_dict({**{k: v for k, v in _moe_dict().items() if k not in ("num_experts", "model_type")},
                                    "num_local_experts": 4, "architectures": ["Qwen3MoeForCausalLM"]})
    assert (cfg.architecture, cfg.n_routed_experts) == ("qwen3_moe", 4)


def test_moe_refusals_say_why():
    """int8 / int4 and LoRA are refused for Qwen3-MoE with the reason; the dense Qwen3 takes every format."""
    from kvkeeper.errors import InvalidRequestError
    from kvkeeper.models.registry import capabilities, family_options

    moe = ModelConfig.from_hf_dict(_moe_dict())
    with pytest.raises(InvalidRequestError, match=r"'int8' does not run Qwen3-MoE models \(int8 / int4 have no "
                                                  r"packed path for the experts\); use --quantization none or gguf"):
        family_options(moe, "auto", "int8")
    assert family_options(moe, "auto", "gguf") == ("auto", "gguf")
    assert "experts (MoE) have no LoRA path" in capabilities(moe).refusal("lora")
    dense = ModelConfig.from_hf_dict({**_moe_dict(), "model_type": "qwen3"})
    assert family_options(dense, "auto", "int4") == ("auto", "int4") and not dense.is_moe_layer(0)
