"""Phi-3 (issue 24): tiny random ``Phi3Config`` checkpoints against transformers' ``Phi3ForCausalLM``.

The model is saved as a Hugging Face folder (fused ``qkv_proj`` / ``gate_up_proj`` as transformers stores them)
and written as a GGUF the way llama.cpp's converter writes ``phi3`` (``attn_qkv``, ``ffn_up`` holding gate then up,
F32; and F16 for the in-place path).  On the exact path (``--quantization none``, float32) greedy tokens equal
transformers' and the logits of every position agree within 1e-4 (one-shot and chunked prefill, decode, packed
sequences), with a prefix hit (the same prompt twice) and a second turn.  In place (``--quantization gguf``) the
fused GGUF tensors run whole as one projection each.  A config with ``sliding_window`` slides every layer from a
folder (as transformers masks it); its GGUF runs full attention (llama.cpp disables Phi-3's window).  LongRoPE and
partial rotary embeddings are refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from kvkeeper import SamplingParams
from kvkeeper.errors import UnsupportedArchitectureError
from kvkeeper.model_config import ModelConfig

from tests.utils.engines import make_engine
from tests.utils.tiny_gguf import write_gguf
from tests.utils.tiny_models import _one_thread, tokenizer  # noqa: F401 - fixtures
from tests.utils.tiny_models import (hf_greedy, hf_logits, kk_logits_chunked, random_prompt, save_tiny, tiny_hf,
                                     without_window)

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
WINDOW = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _hf(tokenizer, seed: int, **kw):  # noqa: F811
    cfg = transformers.Phi3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0, **kw)
    return tiny_hf(cfg, seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):  # noqa: F811
    """(transformers model, {"hf": folder, "gguf": F32 file, "gguf16": F16 file}) of a tiny random Phi-3."""
    hf = _hf(tokenizer, 5)
    out = save_tiny(hf, tokenizer, tmp_path_factory.mktemp("phi3-tiny"))
    return hf, {"hf": out, "gguf": write_gguf(out / "phi3-f32.gguf", hf, "phi3"),
                "gguf16": write_gguf(out / "phi3-f16.gguf", hf, "phi3", f16=True)}


@pytest.fixture(scope="module", params=["hf", "gguf"])
def engine(request, tiny):
    """An engine on the folder or the F32 GGUF, float32 weights; blocks of 4, 8 tokens a step."""
    return request.param, make_engine(model=str(tiny[1][request.param]), num_kv_blocks=64, block_size=4,
                                      max_num_batched_tokens=8, quantization="none")



def test_checkpoint_is_fused_and_config_read_back(tiny, engine):
    hf, _ = tiny
    kind, eng = engine
    names = set(hf.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    c = eng.model_config
    assert c.architecture == "phi3" and type(eng.runner.model).__name__ == "Phi3ForCausalLM"
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (3, 4, 2, 16, 96)
    assert not c.tie_word_embeddings and not c.attention_bias and not c.is_hybrid
    assert eng.runner.weight_format == "none"
    attn = eng.runner.model.model.layers[0].self_attn
    assert tuple(attn.qkv_proj.weight.shape) == (64 + 2 * 32, 64)
    torch.testing.assert_close(attn.qkv_proj.weight, hf.model.layers[0].self_attn.qkv_proj.weight, atol=0, rtol=0)


def test_logits_all_positions(tiny, engine):
    """One-shot prefill, then chunks over cached blocks, decode steps and two sequences packed per step."""
    hf, _ = tiny
    kind, eng = engine
    a, b = random_prompt(37, 1), random_prompt(19, 2)
    ref = hf_logits(hf, a)
    assert (ref.topk(2, dim=-1).values.diff(dim=-1).abs()).median() > 100 * ATOL  # logits far from tied
    (one,) = kk_logits_chunked(eng, [a], [[len(a)]])
    assert (one - ref).abs().max().item() < ATOL, kind
    got_a, got_b = kk_logits_chunked(eng, [a, b], [[10, 1], [1, 0], [1, 13], [6, 1], [19, 4]])
    assert (got_a - ref).abs().max().item() < ATOL, kind
    assert (got_b - hf_logits(hf, b)).abs().max().item() < ATOL, kind


def test_greedy_prefix_hit_and_second_turn(tiny, engine):
    """Greedy tokens equal transformers'; the same prompt again hits the prefix cache with the same tokens; a
    second turn (history, reply, new text) reuses the history and equals transformers."""
    hf, _ = tiny
    kind, eng = engine
    p = random_prompt(29, 3)
    want = hf_greedy(hf, p, 20)
    assert len(set(want)) >= 8, want
    first = eng.generate([p], SamplingParams(max_tokens=20, **GREEDY))[0]
    again = eng.generate([p], SamplingParams(max_tokens=20, **GREEDY))[0]
    assert first.token_ids == again.token_ids == want, kind
    assert again.cached_tokens == (len(p) - 1) // 4 * 4
    follow = p + first.token_ids + random_prompt(6, 4)
    second = eng.generate([follow], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert second.cached_tokens >= len(p) + 16
    assert second.token_ids == hf_greedy(hf, follow, 12), kind
    eng.pool.check_invariants()


def test_gguf_in_place_runs_the_fused_tensors_whole(tiny):
    """--quantization gguf on the F16 file: attn_qkv and ffn_up (gate + up) each run as one GGUFLinear over the
    mapped tensor (one part, not split, not copied), and the logits equal transformers' with the weights rounded
    to float16 (the file's values) within 1e-4; greedy tokens equal."""
    from kvkeeper.layers.gguf_linear import GGUFLinear

    hf, files = tiny
    eng = make_engine(model=str(files["gguf16"]), num_kv_blocks=64, block_size=4, quantization="gguf",
                      kv_dtype="fp32")  # (a quantized format defaults to a bf16 KV cache)
    assert eng.runner.weight_format == "gguf"
    layer = eng.runner.model.model.layers[1]
    for mod, n in ((layer.self_attn.qkv_proj, 128), (layer.mlp.gate_up_proj, 192), (layer.mlp.down_proj, 64)):
        assert isinstance(mod, GGUFLinear) and len(mod.parts) == 1 and mod.out_features == n
        assert mod.parts[0].type_name == "F16"
    assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 2 for p in layer.parameters())  # no float copy
    h16 = _hf(eng.tokenizer, 5)
    with torch.no_grad():
        for p in h16.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    p = random_prompt(23, 9)
    out = eng.generate([p], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert out.token_ids == hf_greedy(h16, p, 12)
    f = p + out.token_ids
    (got,) = kk_logits_chunked(eng, [f], [[len(f)]])
    assert (got - hf_logits(h16, f)).abs().max().item() < ATOL


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tokenizer):  # noqa: F811
    """(folder, GGUF, transformers model with window 8, the same model without it)."""
    hf = _hf(tokenizer, 6, sliding_window=WINDOW)
    out = save_tiny(hf, tokenizer, tmp_path_factory.mktemp("phi3-window"))
    full = without_window(hf)
    return out, write_gguf(out / "phi3-window.gguf", hf, "phi3"), hf, full


def test_sliding_window_folder_slides_every_layer(windowed):
    """From a folder every layer attends within the window (transformers' mask), across the window boundary."""
    folder, _, hf, full = windowed
    eng = make_engine(model=str(folder), num_kv_blocks=32, block_size=4, max_num_batched_tokens=8)
    assert type(eng.runner.model).__name__ == "SlidingPhi3ForCausalLM" and eng.pool.window_blocks == 32
    p = random_prompt(2 * WINDOW + 3, 10)
    want = hf_greedy(hf, p, 16)
    assert want != hf_greedy(full, p, 16)  # the window changes the reference's tokens
    assert eng.generate([p], SamplingParams(max_tokens=16, **GREEDY))[0].token_ids == want
    f = p + want
    (got,) = kk_logits_chunked(eng, [f], [[8]] * (len(f) // 8) + [[len(f) % 8]], commit=True)  # chunks of 8
    assert (got - hf_logits(hf, f)).abs().max().item() < ATOL


def test_sliding_window_gguf_runs_full_attention_as_llama_cpp(windowed):
    """The GGUF carries phi3.attention.sliding_window; llama.cpp ignores it ("Phi SWA is currently disabled"),
    and so does kvkeeper: full attention, equal to transformers without the window."""
    _, path, _, full = windowed
    eng = make_engine(model=str(path), num_kv_blocks=64, block_size=4)
    assert not eng.model_config.is_hybrid and type(eng.runner.model).__name__ == "Phi3ForCausalLM"
    p = random_prompt(2 * WINDOW + 3, 10)
    assert eng.generate([p], SamplingParams(max_tokens=16, **GREEDY))[0].token_ids == hf_greedy(full, p, 16)


_BASE = {"model_type": "phi3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 4096}


@pytest.mark.parametrize("extra, match", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "LongRoPE"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "LongRoPE"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_phi3_configs_are_refused(extra, match):
    assert ModelConfig.from_hf_dict(_BASE).architecture == "phi3"
    with pytest.raises(UnsupportedArchitectureError, match=match):
        ModelConfig.from_hf_dict({**_BASE, **extra})


def test_longrope_gguf_is_refused(tiny, tmp_path):
    """A GGUF with rope_factors_long / rope_factors_short (the 128k variants) is refused when loaded."""
    import gguf
    import numpy as np

    from kvkeeper.gguf_file import GGUFFile
    from kvkeeper.weights.loader import load_weights

    src = GGUFFile.open(tiny[1]["gguf"])  # (gguf.GGUFReader takes seconds over the 49k-token vocabulary)
    w = gguf.GGUFWriter(str(tmp_path / "longrope.gguf"), "phi3")
    for key, f in src.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            vtype = f.types[0]
            w.add_key_value(key, f.contents(), vtype, f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="LongRoPE"):
        load_weights(tmp_path / "longrope.gguf", cache=tmp_path)


def test_q8_0_gguf_packs_the_fused_tensors(tiny, tmp_path):
    """A Q8_0 Phi-3 file: attn_qkv and ffn_up are repacked whole for the C++ block matmul (one packed matrix
    each, like Llama's q/k/v fused from three), and greedy tokens equal the file's dequantized float32 path."""
    import gguf
    import numpy as np

    from kvkeeper.layers.quantized import QuantLinear
    from kvkeeper.gguf_file import GGUFFile
    from tests.utils.kernels import kernels_or_skip

    kernels_or_skip()
    src = GGUFFile.open(tiny[1]["gguf"])  # (gguf.GGUFReader takes seconds over the 49k-token vocabulary)
    path = tmp_path / "phi3-q8_0.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    for key, f in src.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            vtype = f.types[0]
            w.add_key_value(key, f.contents(), vtype, f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        data = np.array(t.data)
        if data.ndim == 2:
            q8 = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    packed = make_engine(model=str(path), num_kv_blocks=64, block_size=4, quantization="gguf", kv_dtype="fp32")
    exact = make_engine(model=str(path), num_kv_blocks=64, block_size=4, quantization="none")
    layer = packed.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert "matrices in place" in packed.runner.weight_description, packed.runner.weight_description
    p = random_prompt(23, 12)
    a, b = (e.generate([p], SamplingParams(max_tokens=12, **GREEDY))[0].token_ids for e in (packed, exact))
    assert a == b


def test_generation_config_eos_ends_a_reply(tiny, tmp_path):
    """Phi-3 instruct folders list ``<|end|>`` among generation_config.json's eos_token_id, not in config.json:
    the engine stops there too, as transformers' generate does."""
    import shutil

    folder = tmp_path / "phi3-gen-eos"
    shutil.copytree(tiny[1]["hf"], folder, ignore=shutil.ignore_patterns("*.gguf"))
    gen = json.loads((folder / "generation_config.json").read_text())
    base = gen["eos_token_id"]
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [base, 1234]}))
    eng = make_engine(model=str(folder), num_kv_blocks=16, block_size=4)
    assert {base, 1234} <= set(eng.eos_token_ids) and eng.model_config.eos_token_ids.count(base) == 1
    p = random_prompt(9, 13)
    first = hf_greedy(tiny[0], p, 4)
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [base, first[2]]}))
    eng = make_engine(model=str(folder), num_kv_blocks=16, block_size=4)
    out = eng.generate([p], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids[:2] == first[:2] and len(out.token_ids) <= 3
