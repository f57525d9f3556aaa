"""kvkeeper.weights.synth_gguf: random-weight GGUF files of real shapes in llama.cpp's Q4_K_M type mix.

* the type rule (Q6_K for output.weight and for attn_v / ffn_down of the "more bits" layers) on the real layer
  counts, 24 and 32;
* the tiny file: every tensor reads back with ``gguf.quants.dequantize`` as finite weights of standard deviation
  about 1/sqrt(K); its tokenizer fields are the embedded model's; today's loader parses it into the shape asked;
* the 1.7B and 8B shapes' tensor plans (no file is written: they are 1.1 and 5 GB).
"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def test_q4_k_m_type_rule(synth):
    # llama.cpp's use_more_bits: i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2
    assert [i for i in range(24) if synth.more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    assert [i for i in range(32) if synth.more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    plan = {name: t for name, t, _ in synth.tensor_plan(synth.SHAPES["1.7b"])}
    assert plan["output.weight"] == "Q6_K" and plan["token_embd.weight"] == "Q4_K"
    assert plan["blk.5.attn_v.weight"] == "Q6_K" and plan["blk.5.ffn_down.weight"] == "Q6_K"
    assert plan["blk.6.attn_v.weight"] == "Q4_K" and plan["blk.5.attn_q.weight"] == "Q4_K"
    assert plan["blk.0.attn_norm.weight"] == "F32"
    assert {t for n, t in plan.items() if n.endswith(("ffn_gate.weight", "ffn_up.weight", "attn_k.weight"))} == {"Q4_K"}


@pytest.mark.parametrize("shape, layers, gb", [("1.7b", 24, (1.0, 1.2)), ("8b", 32, (4.2, 4.8))])
def test_real_shapes_plan(synth, shape, layers, gb):
    s = synth.SHAPES[shape]
    plan = synth.tensor_plan(s)
    assert len(plan) == 3 + 9 * layers
    nbytes = sum(synth._tensor_bytes(t, nk)[2] for _, t, nk in plan)
    assert gb[0] < nbytes / 1e9 < gb[1]  # Q4_K_M of these layers, 49k vocab, untied head (Llama-3.1-8B, 128k vocab: 4.9 GB)
    assert dict((n, nk) for n, _, nk in plan)["blk.0.attn_k.weight"] == (s.kv_heads * s.hidden // s.heads, s.hidden)


def test_tiny_file_reads_back(synth, tiny_gguf):
    r = gguf.GGUFReader(str(tiny_gguf))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.1.attn_v.weight"] == "Q6_K"  # 2 layers: both "more bits"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["token_embd.weight"] == "Q4_K"
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if w.ndim == 2:
            k = w.shape[1]
            assert 0.5 / np.sqrt(k) < w.std() < 2.0 / np.sqrt(k), (t.name, w.std())
            assert abs(w.mean()) < 0.2 / np.sqrt(k), t.name
        else:
            assert (w == 1.0).all()  # norms: ones


def test_tiny_file_has_the_embedded_tokenizer(tiny_gguf):
    from kvkeeper.weights.sources import resolve_model_path

    ours, ref = gguf.GGUFReader(str(tiny_gguf)), gguf.GGUFReader(str(resolve_model_path()))
    keys = {k for k in ref.fields if k.startswith("tokenizer.")}
    assert keys and keys == {k for k in ours.fields if k.startswith("tokenizer.")}
    for k in ("tokenizer.chat_template", "tokenizer.ggml.model", "tokenizer.ggml.eos_token_id"):
        assert ours.fields[k].contents() == ref.fields[k].contents(), k
    assert ours.fields["tokenizer.ggml.tokens"].contents(1000) == ref.fields["tokenizer.ggml.tokens"].contents(1000)
    assert len(ours.fields["tokenizer.ggml.merges"].data) == len(ref.fields["tokenizer.ggml.merges"].data)
    assert ours.fields["general.architecture"].contents() == "llama"


def test_todays_loader_parses_it(synth, tiny_gguf):
    from kvkeeper.weights.loader import load_gguf

    cfg, state = load_gguf(tiny_gguf)
    s = synth.SHAPES["tiny"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size) == (
        s.hidden, s.layers, s.heads, s.kv_heads, s.ffn, s.vocab)
    assert not cfg.tie_word_embeddings
    assert state["model.layers.1.mlp.down_proj.weight"].shape == (s.hidden, s.ffn)
    assert all(bool(v.isfinite().all()) for v in state.values())


def test_seed_decides_the_weights(synth, tmp_path):
    a = synth.random_tensor(np.random.default_rng(3), "Q4_K", 4, 256)
    b = synth.random_tensor(np.random.default_rng(3), "Q4_K", 4, 256)
    c = synth.random_tensor(np.random.default_rng(4), "Q4_K", 4, 256)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    with pytest.raises(ValueError, match="multiple of 256"):
        synth.random_tensor(np.random.default_rng(0), "Q6_K", 4, 300)
    with pytest.raises(KeyError, match="unknown shape"):
        synth.write_synthetic_gguf(tmp_path / "x.gguf", "70b")
