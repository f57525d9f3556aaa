"""Mistral's sliding-window attention on every layer (issue 24), on the hybrid KV cache.

A tiny random ``MistralConfig`` with ``sliding_window`` 8 (far below its 512-token context) is saved as a Hugging
Face folder and compared with transformers' ``MistralForCausalLM`` (eager attention; its mask applies the window)
at prompts shorter than, equal to and longer than the window, decoding across it: greedy tokens equal, logits of
every position within 1e-4 (float32, ``--quantization none``), with the hybrid KV cache (every layer's KV in window
blocks, given back once they fall out of the window) and with every layer keeping every block.  A prefix hit and a
second turn give the same tokens; a long generation runs in a pool of 6 window blocks, which only works if the
out-of-window blocks come back.  The same weights as a GGUF (llama.cpp converts Mistral as ``llama``, with no
window key) run full attention, as llama.cpp runs them.
"""

from __future__ import annotations

import pytest
import torch
from kvkeeper import SamplingParams

from tests.utils.engines import make_engine
from tests.utils.tiny_models import _one_thread, tokenizer  # noqa: F401 - fixtures
from tests.utils.tiny_models import hf_greedy, kk_logits_chunked, random_prompt, save_tiny, tiny_hf, without_window

transformers = pytest.importorskip("transformers")

WINDOW = 8
CONTEXT = 512
ATOL = 1e-4
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):  # noqa: F811
    """(folder, transformers model with the window, the same model without it) of a tiny random Mistral."""
    cfg = transformers.MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, head_dim=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=CONTEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    hf = tiny_hf(cfg, 3)
    full = without_window(hf)
    return save_tiny(hf, tokenizer, tmp_path_factory.mktemp("mistral-window")), hf, full


def _engine(model, hybrid=True, **kw):
    kw = {"num_kv_blocks": 48, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, **kw}
    return make_engine(model=str(model), hybrid_kv_cache=hybrid, **kw)


def test_window_binds_in_the_reference(tiny):
    """transformers applies the window: logits past it differ from full attention, and agree before it."""
    _, hf, full = tiny
    ids = torch.tensor([random_prompt(3 * WINDOW, 1)])
    with torch.no_grad():
        a, b = hf(ids).logits[0], full(ids).logits[0]
    assert (a[:WINDOW] - b[:WINDOW]).abs().max() < ATOL
    assert (a[WINDOW:] - b[WINDOW:]).abs().max() > 1.0


def test_config_slides_every_layer_and_keeps_the_context(tiny):
    eng = _engine(tiny[0])
    cfg = eng.model_config
    assert cfg.architecture == "mistral" and cfg.sliding_window == WINDOW
    assert cfg.layer_types == ["sliding_attention"] * 3 and cfg.is_hybrid
    assert cfg.context_length == CONTEXT and eng.context_length == CONTEXT  # no longer capped at the window
    assert type(eng.runner.model).__name__ == "SlidingMistralForCausalLM"
    # every layer's KV is in the 48 window blocks; the pool's blocks are bookkeeping only
    assert [c.k.shape[0] for c in eng.kv.store] == [48] * 3 and eng.pool.window_blocks == 48
    assert eng.pool.num_blocks > 48 and eng.runner.kv_bytes_per_token_full_layers == 0
    caps = eng.runner.capabilities
    assert caps.kv_layout == "hybrid" and not caps.fused_decode and not caps.cuda_graphs and not caps.kv_compression


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "all-full"])
@pytest.mark.parametrize("block_size,chunk", [(4, 512), (3, 5)], ids=["bs4", "bs3-chunk5"])
def test_parity_across_window(tiny, hybrid, block_size, chunk):
    """Prompts of window-1, window, window+1 and 2*window+3 tokens, 16 greedy tokens across the window: tokens
    equal transformers', and the logits of every position agree (several sequences packed, chunked prefill)."""
    folder, hf, _ = tiny
    eng = _engine(folder, hybrid, block_size=block_size, max_num_batched_tokens=chunk)
    prompts = [random_prompt(n, n) for n in (WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 3)]
    refs = [hf_greedy(hf, p, 16) for p in prompts]
    assert all(len(set(r)) >= 6 for r in refs), refs  # not a degenerate repetition
    outs = eng.generate(prompts, SamplingParams(max_tokens=16, **GREEDY))
    assert [o.token_ids for o in outs] == refs
    fulls = [p + r for p, r in zip(prompts, refs)]
    with torch.no_grad():
        want = [hf(torch.tensor([f])).logits[0] for f in fulls]
    steps = [[min(5, max(0, len(f) - 5 * s)) for f in fulls] for s in range(-(-max(map(len, fulls)) // 5))]
    got = kk_logits_chunked(eng, fulls, steps, commit=True)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < ATOL
    eng.pool.check_invariants()
    assert eng.pool.num_used == 0


def test_prefix_hit_and_second_turn(tiny):
    """The same prompt twice: the second run reuses its cached prefix (its last window still has window blocks)
    with the same tokens; a second turn (history + reply + new text) reuses the history and equals transformers."""
    folder, hf, _ = tiny
    eng = _engine(folder)
    p = random_prompt(3 * WINDOW + 2, 7)
    want = hf_greedy(hf, p, 2)
    first = eng.generate([p], SamplingParams(max_tokens=2, **GREEDY))[0]
    again = eng.generate([p], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert first.token_ids == again.token_ids == want
    assert first.cached_tokens == 0 and again.cached_tokens == (len(p) - 1) // 4 * 4  # every full block but the last
    reply = eng.generate([p], SamplingParams(max_tokens=12, **GREEDY))[0]
    follow = p + reply.token_ids + random_prompt(5, 8)
    second = eng.generate([follow], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert second.cached_tokens >= len(p)
    assert second.token_ids == hf_greedy(hf, follow, 12)
    eng.pool.check_invariants()


def test_out_of_window_blocks_are_freed(tiny):
    """100 tokens decoded from a 9-token prompt (28 blocks of 4) in a pool of 6 window blocks: only possible if
    the blocks that fall out of the window give their KV back; at most 4 are held at a time, and the tokens equal
    transformers'."""
    folder, hf, _ = tiny
    eng = _engine(folder, num_kv_blocks=6, max_num_seqs=1, max_num_batched_tokens=4)
    prompt = random_prompt(WINDOW + 1, 5)
    seq = eng.add_request(prompt, SamplingParams(max_tokens=100, **GREEDY))
    blocks, windows = [], []
    while eng.has_unfinished():
        eng.step()
        if not seq.finished:
            blocks.append(len(seq.block_table))
            windows.append(sum(eng.pool.window_id(b) is not None for b in seq.block_table))
    assert max(blocks) >= (len(prompt) + 99) // 4 and max(windows) <= -(-WINDOW // 4) + 1 < max(blocks)
    assert seq.output_token_ids == hf_greedy(hf, prompt, 100)
    eng.pool.check_invariants()


def test_gguf_runs_full_attention_as_llama_cpp(tiny, tmp_path):
    """The same weights as a GGUF written as llama.cpp converts Mistral (architecture llama, q/k permuted, no
    window key): kvkeeper reads it as Llama with full attention, as llama.cpp runs it, and equals transformers
    without the window (greedy tokens; logits within 1e-4)."""
    from tests.utils.tiny_gguf import write_gguf

    _, hf, full = tiny
    path = write_gguf(tmp_path / "mistral.gguf", hf, "llama")
    eng = _engine(path, num_kv_blocks=64)
    assert eng.model_config.architecture == "llama" and not eng.model_config.is_hybrid
    assert eng.runner.weight_format == "none" and eng.context_length == CONTEXT
    p = random_prompt(2 * WINDOW + 5, 11)
    out = eng.generate([p], SamplingParams(max_tokens=16, **GREEDY))[0]
    assert out.token_ids == hf_greedy(full, p, 16)
    f = p + out.token_ids
    (got,) = kk_logits_chunked(eng, [f], [[len(f)]])
    with torch.no_grad():
        assert (got - full(torch.tensor([f])).logits[0]).abs().max().item() < ATOL


def test_sizing_of_an_all_sliding_cache():
    """Every layer slides: the KV budget becomes window blocks (at most room for max_num_seqs windows plus a
    prefill chunk each), the bookkeeping blocks cover every such sequence up to the context and no more than
    max_num_seqs whole contexts; an explicit block count is the window-block count."""
    from kvkeeper.kvcache.formats.base import parse_kv_format
    from kvkeeper.kvcache.sizing import KVSizing, bytes_per_block, kv_blocks
    from kvkeeper.model_config import ModelConfig

    cfg = ModelConfig(architecture="mistral", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, sliding_window=256,
                      layer_types=["sliding_attention"] * 3)
    fp32 = parse_kv_format("fp32")
    per_block = bytes_per_block(fp32, cfg, 16)
    small = KVSizing(40 * per_block, 16, None, max_num_seqs=8, max_num_batched_tokens=64)
    assert kv_blocks(fp32, cfg, small, hybrid=True) == (40 * (4096 // 256 + 2), 40)  # the budget: 40 window blocks
    big = KVSizing(1 << 30, 16, None, max_num_seqs=8, max_num_batched_tokens=64)
    want = 8 * ((256 + 64) // 16 + 1)
    assert kv_blocks(fp32, cfg, big, hybrid=True) == (8 * 4096 // 16 + want, want)
    assert kv_blocks(fp32, cfg, KVSizing(0, 16, 12), hybrid=True) == (12 * 18, 12)
    assert kv_blocks(fp32, cfg, small, hybrid=False) == (40, None)  # --no-hybrid-kv-cache: every layer every block
