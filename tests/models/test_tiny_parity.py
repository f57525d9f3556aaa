"""Exact parity with transformers on tiny random Llama / Qwen2 / Mistral checkpoints.

Each case builds a transformers config with tiny sizes, initialises the model
at random (seeded, with weights large enough that logits are far from tied),
saves it as a Hugging Face folder (config.json + model.safetensors + the
embedded SmolLM2 tokenizer) and loads that folder through ``LLMEngine``.
transformers is the reference implementation: we compare fp32 logits at every
position (one-shot prefill, chunked prefill over a cached context, decode, and
several sequences packed into one step) and greedy generations, with large and
small KV blocks (chunked prefill, many blocks, prefix-cache reuse).

The loader's error paths (unsupported architecture, missing or corrupt
weights, corrupt GGUF, unknown model id) are checked at the end.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from kvkeeper import SamplingParams
from kvkeeper.errors import (
    ModelFormatError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from kvkeeper.model_config import ModelConfig
from kvkeeper.weights.loader import load_weights
from kvkeeper.weights.sources import resolve_model_path
from kvkeeper.layers.rope import RotaryEmbedding
from kvkeeper.worker.runner import ModelRunner

from tests.utils.tiny_models import _one_thread, tokenizer  # noqa: F401 - fixtures
from tests.utils.tiny_models import kk_logits_chunked as _kk_logits_chunked
from tests.utils.tiny_models import randomise_weights as _randomise
from tests.utils.engines import make_engine

transformers = pytest.importorskip("transformers")

PROMPT_LEN = 37  # not a multiple of any block size used
GEN_TOKENS = 20
ATOL = 1e-4

_BASE = dict(hidden_size=64, intermediate_size=128, head_dim=16, rms_norm_eps=1e-5)

# id -> (transformers config class name, extra config kwargs)
CASES = {
    # GQA ratio 2, untied, plain RoPE
    "llama-gqa2": ("LlamaConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # MHA (ratio 1), tied, linear position interpolation
    "llama-mha-tied-linear": ("LlamaConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                  tie_word_embeddings=True,
                                                  rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                   "factor": 4.0})),
    # GQA ratio 4, q width (8*16) != hidden, 3 layers, Llama 3.1 RoPE with all three frequency bands present
    "llama-gqa4-llama3": ("LlamaConfig", dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                              tie_word_embeddings=False,
                                              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                               "factor": 8.0, "low_freq_factor": 1.0,
                                                               "high_freq_factor": 16.0,
                                                               "original_max_position_embeddings": 1024},
                                              max_position_embeddings=8192)),
    # Qwen2: q/k/v bias, tied, GQA ratio 2, YaRN (interpolation ramp and attention factor both active)
    "qwen2-bias-tied-yarn": ("Qwen2Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 tie_word_embeddings=True,
                                                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                  "factor": 4.0,
                                                                  "original_max_position_embeddings": 256},
                                                 max_position_embeddings=1024)),
    # Qwen2: untied, GQA ratio 4 with bias, large theta
    "qwen2-bias-gqa4": ("Qwen2Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                            tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                            max_position_embeddings=2048)),
    # Mistral: GQA ratio 4, untied, sliding window far above the context we use
    "mistral-gqa4": ("MistralConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                           tie_word_embeddings=False, sliding_window=4096,
                                           max_position_embeddings=4096,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


# ---- fixtures ----------------------------------------------------------------


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tokenizer):
    """(case id, folder, transformers model in fp32) for one tiny random checkpoint."""
    name = request.param
    cls_name, kw = CASES[name]
    cfg_cls = getattr(transformers, cls_name)
    cfg = cfg_cls(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, **_BASE, **kw)
    seed = sorted(CASES).index(name)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    _randomise(hf, seed)
    if kw.get("tie_word_embeddings"):
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return name, folder, hf


@pytest.fixture(scope="module")
def engine(case):
    _, folder, _ = case
    return make_engine(model=str(folder), num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def small_engine(case):
    """Blocks of 4 tokens, 8 tokens per step: chunked prefill over many blocks."""
    _, folder, _ = case
    return make_engine(model=str(folder), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)


def _prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 1234) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], n: int = GEN_TOKENS) -> list[int]:
    # cached on the model itself: a module-level cache keyed by id(hf) handed one case's tokens to another case
    # whose model was allocated where the freed one had been (seen in the full suite, llama-mha-tied-linear)
    cache = hf.__dict__.setdefault("_kvk_greedy_cache", {})
    key = (tuple(ids), n)
    if key not in cache:
        cache[key] = _hf_greedy_uncached(hf, ids, n)
    return cache[key]


def _hf_greedy_uncached(hf, ids: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # never stop early
    out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    toks = out[0, len(ids):].tolist()
    assert len(toks) == n
    return toks


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"{what}: max |logit diff| {diff:.3g} >= {ATOL} (reference logits span {ref.abs().max():.3g})"


# ---- parity ------------------------------------------------------------------


def test_config_read_back(case, engine):
    """The folder's config.json becomes the ModelConfig the case asked for."""
    name, _, hf = case
    c, hc = engine.model_config, hf.config
    assert c.architecture == hc.model_type
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        hc.num_hidden_layers, hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert c.tie_word_embeddings == bool(hc.tie_word_embeddings)
    assert c.attention_bias == (hc.model_type == "qwen2")
    rtype = hc.rope_parameters.get("rope_type", "default")
    assert (c.rope_scaling or {}).get("rope_type", "default") == rtype
    assert c.rope_theta == hc.rope_parameters["rope_theta"]


def test_rope_tables_match_transformers(case, engine):
    """cos/sin tables (incl. the YaRN attention factor) equal transformers' rotary embedding."""
    _, _, hf = case
    pos = torch.arange(PROMPT_LEN + GEN_TOKENS)[None]
    x = torch.zeros(1, pos.shape[1], 64)
    cos, sin = hf.model.rotary_emb(x, pos)
    rope = engine.runner.model.rope
    torch.testing.assert_close(rope.cos[: pos.shape[1]], cos[0].float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rope.sin[: pos.shape[1]], sin[0].float(), atol=1e-6, rtol=1e-6)


def test_prefill_logits_all_positions(case, engine):
    """One-shot prefill: logits at every position match transformers (fp32)."""
    name, _, hf = case
    ids = _prompt(len(engine.tokenizer))
    ref = _hf_logits(hf, ids)
    # logits spread out and far from tied, so the comparisons are meaningful
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 100 * ATOL
    assert ref.std() > 0.5 and len(set(ref.argmax(-1).tolist())) > PROMPT_LEN // 2
    (ours,) = _kk_logits_chunked(engine, [ids], [[len(ids)]])
    _assert_close(ours, ref, f"{name} one-shot prefill")


def test_chunked_decode_and_packed_logits(case, small_engine):
    """Chunks over cached blocks, single-token decode steps and two sequences packed per step."""
    name, _, hf = case
    vocab = len(small_engine.tokenizer)
    a = _prompt(vocab)
    b = _prompt(vocab, n=19, seed=99)
    # a: 10 (prefill), 1 (decode), 1 (decode), 6 (chunk mid-block), 19 (chunk)
    # b: 1 (single first token: decode path with no context), skip, 13, 1, 4
    schedule = [[10, 1], [1, 0], [1, 13], [6, 1], [19, 4]]
    ours_a, ours_b = _kk_logits_chunked(small_engine, [a, b], schedule)
    _assert_close(ours_a, _hf_logits(hf, a), f"{name} chunked/decode seq a")
    _assert_close(ours_b, _hf_logits(hf, b), f"{name} chunked/decode seq b")


def test_greedy_generation_matches(case, engine):
    name, _, hf = case
    ids = _prompt(len(engine.tokenizer))
    ref = _hf_greedy(hf, ids)
    assert len(set(ref)) >= 8, f"{name}: degenerate reference generation {ref}"
    out = engine.generate([ids], SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == ref, f"{name}: greedy tokens differ"


def test_greedy_generation_small_blocks_chunked_prefill(case, small_engine):
    """block_size 4, 8 tokens per step: prompt prefilled in 5 chunks over 10 blocks; batched and prefix-cached runs agree."""
    name, _, hf = case
    vocab = len(small_engine.tokenizer)
    a = _prompt(vocab)
    b = _prompt(vocab, n=23, seed=7)
    ref_a, ref_b = _hf_greedy(hf, a), _hf_greedy(hf, b)
    params = SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True)
    steps0 = small_engine.num_steps
    (out,) = small_engine.generate([a], params)
    assert out.token_ids == ref_a, f"{name}: greedy tokens differ (chunked prefill)"
    # 37 prompt tokens at 8 per step -> 5 prefill steps (the last samples the first token), then 19 decode steps
    assert small_engine.num_steps - steps0 == 5 + GEN_TOKENS - 1
    # again, batched with another prompt: a hits the prefix cache (9 full blocks of 4)
    out_a, out_b = small_engine.generate([a, b], params)
    assert out_a.cached_tokens == (PROMPT_LEN - 1) // 4 * 4
    assert out_a.token_ids == ref_a, f"{name}: greedy tokens differ (prefix-cached, batched)"
    assert out_b.token_ids == ref_b, f"{name}: greedy tokens differ (batched second prompt)"


# rope variants beyond the model cases, in the transformers-5 format (rope_parameters) and the
# transformers-4 format (top-level rope_theta, rope_scaling with "type"); cos/sin tables only
ROPE_VARIANTS = {
    "default-5": dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "default-4": dict(rope_theta=500000.0, rope_scaling=None),
    "linear-4": dict(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}),
    "llama3.1-4": dict(rope_theta=500000.0, max_position_embeddings=131072,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3-no-original-5": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                                 max_position_embeddings=4096),
    "qwen2.5-yarn-4": dict(rope_theta=1000000.0, max_position_embeddings=32768,
                           rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn-betas-no-truncate-5": dict(max_position_embeddings=4096,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                                      "original_max_position_embeddings": 512, "beta_fast": 16.0,
                                                      "beta_slow": 2.0, "truncate": False}),
    "yarn-attention-factor-5": dict(max_position_embeddings=4096,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 1024,
                                                     "attention_factor": 1.5}),
    "yarn-mscale-5": dict(max_position_embeddings=4096,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 1024, "mscale": 0.707,
                                           "mscale_all_dim": 1.0}),
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_match_transformers(tmp_path, variant):
    """A config.json as written (either format) gives transformers' cos/sin, attention factor included."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1000,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           **_BASE, "max_position_embeddings": 2048, **ROPE_VARIANTS[variant]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = RotaryEmbedding(ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text())))
    n = raw["max_position_embeddings"]
    pos = torch.cat([torch.arange(min(n, 4096)), torch.tensor([n // 2, n - 1])])
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, 1, 64), pos[None])
    torch.testing.assert_close(ours.cos[pos], cos[0].float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.sin[pos], sin[0].float(), atol=1e-6, rtol=1e-5)


def test_sharded_folder_reads_only_indexed_shards(tmp_path):
    """With model.safetensors.index.json, only the shards it names are read (a Mistral-style
    consolidated.safetensors beside them is ignored); a missing shard is a ModelFormatError."""
    from safetensors.torch import save_file

    cfg = transformers.MistralConfig(vocab_size=1000, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=1, **_BASE)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for fname, ks in shards.items():
        save_file({k: state[k] for k in ks}, tmp_path / fname, metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (tmp_path / "consolidated.safetensors").write_bytes(b"not the HF weights")
    _, loaded = load_weights(tmp_path)
    assert sorted(loaded) == keys
    for k in keys:
        assert torch.equal(loaded[k], state[k].float()), k
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="model-00002-of-00002"):
        load_weights(tmp_path)


# ---- error paths of the loader -------------------------------------------------


def _llama_config_dict(**over) -> dict:
    cfg = transformers.LlamaConfig(vocab_size=1000, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, **_BASE).to_dict()
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("cfg", [
    {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 1000, "n_embd": 64},
    {"architectures": ["GPT2LMHeadModel"], "vocab_size": 1000},
], ids=["model_type", "architectures-only"])
def test_unsupported_architecture(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as ei:
        make_engine(model=str(tmp_path))
    msg = str(ei.value)
    assert ("gpt2" if "model_type" in cfg else "GPT2LMHeadModel") in msg
    for supported in ("llama", "mistral", "qwen2"):
        assert supported in msg


def test_unsupported_rope_type(tmp_path):
    cfg = _llama_config_dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="longrope"):
        make_engine(model=str(tmp_path))


def test_architectures_only_config_is_accepted():
    cfg = _llama_config_dict()
    del cfg["model_type"]
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf_dict(cfg).architecture == "qwen2"


def test_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama_config_dict()))
    with pytest.raises(ModelFormatError, match="safetensors"):
        make_engine(model=str(tmp_path))


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(ModelFormatError, match="config.json"):
        make_engine(model=str(tmp_path))


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama_config_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + b"\xff" * 64)
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        make_engine(model=str(tmp_path))


def test_config_weights_mismatch(tmp_path):
    """Weights that do not fit the config (a layer more, or another MLP width) are a ModelFormatError."""
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(vocab_size=1000, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, **_BASE)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    weights = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, weights, metadata={"format": "pt"})
    raw = cfg.to_dict()
    for key, value, pattern in [("num_hidden_layers", 3, "lack"), ("intermediate_size", 96, "shape")]:
        d = tmp_path / key
        d.mkdir()
        shutil.copy(weights, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(ModelFormatError, match=pattern):
            cfg, state = load_weights(d)
            ModelRunner(cfg, state, num_blocks=4, block_size=4)


@pytest.mark.parametrize("content", [
    b"GGUF" + bytes(range(256)) * 4,  # the magic, then garbage
    b"GGUF\x03\x00\x00\x00",  # the magic and a version, then nothing
    b"not a model at all" * 10,  # no magic
], ids=["magic-garbage", "magic-truncated", "no-magic"])
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError) as ei:
        make_engine(model=str(path))
    assert str(path) in str(ei.value)
    if not content.startswith(b"GGUF"):
        assert "magic" in str(ei.value)


def test_truncated_real_gguf(tmp_path):
    """The first megabyte of the real SmolLM2 GGUF: header fine, tensor data missing."""
    src = resolve_model_path()
    path = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelFormatError):
        make_engine(model=str(path))


def test_unknown_model_id():
    with pytest.raises(ModelNotFoundError) as ei:
        resolve_model_path("no-such-model")
    assert "smollm2-135m-instruct" in str(ei.value)
    assert "no-such-model" in str(ei.value)
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        make_engine(model="no-such-model")
