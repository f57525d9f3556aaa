"""DeepSeek V2/V3 (Multi-head Latent Attention, mixture of experts) against transformers on tiny random checkpoints.

Each case builds a transformers DeepseekV2Config / DeepseekV3Config with tiny sizes, randomises the weights
(seeded), saves a Hugging Face folder with the embedded SmolLM2 tokenizer and loads it through ``LLMEngine``.
Checked in fp32: logits at every position (one-shot prefill; chunks over cached blocks, decode steps and two
sequences packed per step), greedy generations of 64 tokens for a batch of prompts of different lengths with
and without chunked prefill, the cached latent rows against transformers' cache, absorbed against expanded
decode at contexts 1, 17 and 1,000, and multi-turn prefix reuse against recomputation.
"""

from __future__ import annotations

import pytest
import torch

from kvkeeper import SamplingParams
from tests.utils.tiny_models import _one_thread, tokenizer  # noqa: F401 - fixtures
from tests.utils.tiny_models import kk_logits_chunked, randomise_weights
from tests.utils.engines import make_engine

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
GEN = 64
_MLA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=2048)
_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, n_group=4,
            topk_group=2)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

# id -> (config class, kwargs)
CASES = {
    # V2-Lite-like: no q LoRA, dense layers only, complex (adjacent-pair) RoPE
    "v2-dense-noqlora": ("DeepseekV2Config", dict(num_hidden_layers=2, q_lora_rank=None, first_k_dense_replace=2,
                                                  **{**_MOE, "n_routed_experts": 8})),
    # V2: first layer dense, then MoE with group-limited greedy softmax routing; YaRN with mscale correction
    "v2-moe-group-yarn": ("DeepseekV2Config", dict(num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=1,
                                                   topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                                   rope_parameters=_YARN, **_MOE)),
    # V3: q LoRA, interleaved RoPE, sigmoid router with correction bias and group top-k, YaRN
    "v3-moe-qlora-yarn": ("DeepseekV3Config", dict(num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1,
                                                   rope_interleave=True, norm_topk_prob=True,
                                                   routed_scaling_factor=2.5, rope_parameters=_YARN, **_MOE)),
    # V3 without rope_interleave (half-split RoPE), q LoRA, all layers MoE
    "v3-moe-half-rope": ("DeepseekV3Config", dict(num_hidden_layers=2, q_lora_rank=24, first_k_dense_replace=0,
                                                  rope_interleave=False, norm_topk_prob=False,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                                  **_MOE)),
}


def _make(name: str, folder, tokenizer):
    cls_name, kw = CASES[name]
    cfg = getattr(transformers, cls_name)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                          eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
                                          **_MLA, **kw)
    seed = sorted(CASES).index(name) + 100
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomise_weights(hf, seed)
    with torch.no_grad():  # the V3 router's correction bias: small, non-zero
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=torch.Generator().manual_seed(seed)))
    hf.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, _make(request.param, folder, tokenizer)


@pytest.fixture(scope="module")
def engine(case):
    return make_engine(model=str(case[1]), num_kv_blocks=128, block_size=16, kv_dtype="fp32", quantization="none")


@pytest.fixture(scope="module")
def small_engine(case):
    """Blocks of 4 tokens, 8 tokens per step: chunked prefill over many blocks."""
    return make_engine(model=str(case[1]), num_kv_blocks=128, block_size=4, max_num_batched_tokens=8,
                     kv_dtype="fp32", quantization="none")


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logits(hf, ids):
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def _hf_greedy(hf, ids, n=GEN):
    greedy = hf.__dict__.setdefault("_kvk_greedy_cache", {})  # on the model: an id(hf) key can be reused
    key = (tuple(ids), n)
    if key not in greedy:
        hf.generation_config.eos_token_id = None
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        greedy[key] = out[0, len(ids):].tolist()
    return greedy[key]


def _close(ours, ref, what):
    assert ours.shape == ref.shape, what
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"{what}: max |logit diff| {diff:.3g} >= {ATOL} (logits span {ref.abs().max():.3g})"


def test_config_and_cache_layout(case, engine):
    name, _, hf = case
    c, hc = engine.model_config, hf.config
    assert c.is_mla and c.kv_lora_rank == hc.kv_lora_rank and c.q_lora_rank == hc.q_lora_rank
    assert c.rope_layout == ("complex" if hc.model_type == "deepseek_v2" else
                             "interleave" if hc.rope_interleave else "half")
    cache = engine.kv.store[0]
    assert cache.latent and cache.v is None
    assert tuple(cache.k.shape[2:]) == (1, hc.kv_lora_rank + hc.qk_rope_head_dim)
    # one latent row per token and layer: (32 + 8) fp32 values x layers
    assert engine.kv.bytes_per_token == 4 * (hc.kv_lora_rank + hc.qk_rope_head_dim) * hc.num_hidden_layers
    moe = [hasattr(layer.mlp, "experts") for layer in engine.runner.model.model.layers]
    assert moe == [i >= hc.first_k_dense_replace for i in range(hc.num_hidden_layers)]


def test_prefill_logits_all_positions(case, engine):
    name, _, hf = case
    ids = _prompt(len(engine.tokenizer), 37, 1234)
    ref = _hf_logits(hf, ids)
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 100 * ATOL and ref.std() > 0.5
    (ours,) = kk_logits_chunked(engine, [ids], [[len(ids)]])
    _close(ours, ref, f"{name} one-shot prefill")


def test_chunked_decode_and_packed_logits(case, small_engine):
    """Chunks over cached blocks, absorbed decode steps and two sequences packed per step (block size 4)."""
    name, _, hf = case
    vocab = len(small_engine.tokenizer)
    a, b = _prompt(vocab, 37, 1234), _prompt(vocab, 19, 99)
    schedule = [[10, 1], [1, 0], [1, 13], [6, 1], [19, 4]]
    ours_a, ours_b = kk_logits_chunked(small_engine, [a, b], schedule)
    _close(ours_a, _hf_logits(hf, a), f"{name} chunked/decode seq a")
    _close(ours_b, _hf_logits(hf, b), f"{name} chunked/decode seq b")


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_batch_of_prompts(case, engine, small_engine, chunked):
    """64 greedy tokens for three prompts of different lengths in one batch equal transformers' generate."""
    name, _, hf = case
    eng = small_engine if chunked else engine
    vocab = len(eng.tokenizer)
    prompts = [_prompt(vocab, n, 50 + n) for n in (5, 23, 41)]
    refs = [_hf_greedy(hf, p) for p in prompts]
    assert len(set(refs[2])) >= 8, f"{name}: degenerate reference {refs[2]}"
    outs = eng.generate(prompts, SamplingParams(max_tokens=GEN, ignore_eos=True))
    for p, o, r in zip(prompts, outs, refs):
        assert o.token_ids == r, f"{name} (chunked={chunked}): greedy tokens differ for a {len(p)}-token prompt"


def test_latent_rows_equal_transformers_cache(case, engine):
    """The cache holds, per layer, transformers' cached normalized latent and rotated RoPE key."""
    name, _, hf = case
    ids = _prompt(len(engine.tokenizer), 29, 5)
    kept = []
    kk_logits_chunked(engine, [ids], [[29]], keep_seqs=kept)
    seq = kept[0]
    with torch.no_grad():
        past = hf(torch.tensor([ids]), use_cache=True).past_key_values
    bt = torch.tensor(seq.block_table)
    try:
        for i, cache in enumerate(engine.kv.store):
            rows = cache.gather_keys(bt, len(ids), torch.float32)[:, 0]  # (L, R + rope)
            layer = past.layers[i]
            ref = torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)
            torch.testing.assert_close(rows, ref, atol=1e-5, rtol=1e-5, msg=f"{name} layer {i} latent rows")
    finally:
        engine.kv.free(seq)


@pytest.mark.parametrize("context", [1, 17, 1000])
def test_absorbed_equals_expanded_decode(case, engine, context):
    """The decode token's logits in the absorbed form equal the expanded form's (fp32) over the same cache."""
    name, _, _ = case
    if name != "v3-moe-qlora-yarn" and context == 1000:
        pytest.skip("one case covers the long context")
    ids = _prompt(len(engine.tokenizer), context, 77)
    model = engine.runner.model
    got = {}
    for mode in ("expanded", "absorbed"):
        model.set_decode_mode(mode)
        try:
            sched = ([[context - 1]] if context > 1 else []) + [[1]]
            (logits,) = kk_logits_chunked(engine, [ids], sched)
        finally:
            model.set_decode_mode("absorbed")
        got[mode] = logits[-1]
    diff = (got["absorbed"] - got["expanded"]).abs().max().item()
    assert diff < 1e-4, f"{name} context {context}: absorbed vs expanded decode differ by {diff:.3g}"


def test_multi_turn_reuse_equals_recompute(case, small_engine, engine):
    """Turn 2 extends turn 1 (prompt + answer + new tokens): the reused prefix is reported in cached_tokens and the
    answer equals a recompute from scratch (the other engine, a cold cache)."""
    name, _, _ = case
    vocab = len(small_engine.tokenizer)
    turn1 = _prompt(vocab, 21, 11)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    (o1,) = small_engine.generate([turn1], params)
    turn2 = turn1 + o1.token_ids + _prompt(vocab, 9, 12)
    (o2,) = small_engine.generate([turn2], params)
    cached_prefix = (len(turn1) + len(o1.token_ids) - 1) // 4 * 4  # full blocks of 4 holding computed KV
    assert o2.cached_tokens == cached_prefix, f"{name}: cached_tokens {o2.cached_tokens} != {cached_prefix}"
    (fresh,) = make_engine(model=str(case[1]), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8,
                         kv_dtype="fp32", quantization="none", enable_prefix_caching=False).generate([turn2], params)
    assert fresh.cached_tokens == 0
    assert o2.token_ids == fresh.token_ids, f"{name}: reused turn differs from recompute"
