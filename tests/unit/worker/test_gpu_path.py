"""The CUDA path's pieces that can be checked without a GPU: device and dtype resolution, dummy
weights from configs, the decode CUDA-graph batch padding (run eagerly on the padded static
buffers, kernels under Triton's interpreter), the eager fallback on CPU, the kernel backend inside
the engine (same greedy tokens as the PyTorch path), and CUDA refused without one (the command line's and
benchmarks/models/gpu.py's refusals: tests/e2e/test_cli_processes.py)."""

import os
from tests.utils.engines import make_engine

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import json
from types import SimpleNamespace

import pytest
import torch

from kvkeeper import SamplingParams
from kvkeeper.errors import InvalidRequestError, ModelNotFoundError
from kvkeeper.weights import dummy
from kvkeeper.worker.cuda_graphs import BATCH_SIZES, pick_batch_size, sizes_up_to

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 300,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny") / "config.json"
    p.write_text(json.dumps(TINY))
    return str(p)


def test_pick_batch_size_pads_to_next_captured_size():
    assert [pick_batch_size(n) for n in (1, 2, 3, 5, 16, 17, 200, 256)] == [1, 2, 4, 8, 16, 32, 256, 256]
    assert pick_batch_size(257) is None  # larger than every graph: eager
    assert sizes_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert sizes_up_to(65) == BATCH_SIZES[:8]
    assert sizes_up_to(1000) == BATCH_SIZES
    with pytest.raises(ValueError):
        pick_batch_size(0)


def test_parameter_count_of_shipped_configs_without_allocating():
    for name in dummy.known_configs():
        cfg, path = dummy.load_config(name)
        if cfg.architecture.startswith("deepseek"):
            continue  # MLA and MoE shapes: counted in tests/models/test_deepseek_components.py (15.7 B, 671.0 B)
        h, L, kvd, V = cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads * cfg.head_dim, cfg.vocab_size
        qd = cfg.num_heads * cfg.head_dim
        per_layer = h * (qd + 2 * kvd) + qd * h + 3 * h * cfg.intermediate_size + 2 * h
        if cfg.attention_bias:
            per_layer += qd + 2 * kvd
        want = V * h * (1 if cfg.tie_word_embeddings else 2) + L * per_layer + h
        assert dummy.parameter_count(cfg) == want
    cfg, _ = dummy.load_config("llama-3.1-8b")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 32, 8, 128)
    assert 8.0e9 < dummy.parameter_count(cfg) < 8.1e9  # "8B"
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.context_length == 131072


def test_dummy_load_errors_name_the_choices(tmp_path):
    with pytest.raises(ModelNotFoundError, match="llama-3.1-8b"):
        dummy.resolve_config("no-such-config")
    with pytest.raises(ModelNotFoundError):
        make_engine("no-such-config", load_format="dummy")
    with pytest.raises(InvalidRequestError, match="load format"):
        make_engine("x", load_format="pt")


def test_cuda_device_refused_clearly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidRequestError, match="no CUDA device"):
        make_engine("llama-3-8b", load_format="dummy", device="cuda")
    # the command line's refusal and benchmarks/models/gpu.py's: tests/e2e/test_cli_processes.py


def test_dummy_weights_seeded_and_engine_runs_on_cpu(tiny_config):
    a = make_engine(tiny_config, load_format="dummy", seed=1, kv_cache_bytes=1 << 20, block_size=4)
    b = make_engine(tiny_config, load_format="dummy", seed=1, kv_cache_bytes=1 << 20, block_size=4)
    c = make_engine(tiny_config, load_format="dummy", seed=2, kv_cache_bytes=1 << 20, block_size=4)
    wa = dict(a.runner.model.named_parameters())
    wb, wc = dict(b.runner.model.named_parameters()), dict(c.runner.model.named_parameters())
    name = "model.layers.1.self_attn.qkv_proj.weight"
    assert torch.equal(wa[name], wb[name]) and not torch.equal(wa[name], wc[name])
    assert abs(wa[name].std().item() - 0.02) < 0.003
    assert torch.equal(wa["model.norm.weight"], torch.ones(64))
    # CPU: the C++ decode kernel when built (else the reference attention) and no CUDA graphs (eager)
    from kvkeeper.kernels import cpu as cpu_kernels

    assert a.runner.attention_backend == ("cpu" if cpu_kernels.available() else "torch") and a.runner.graphs is None
    assert a.runner.dtype == torch.float32
    out = a.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and all(0 <= t < 300 for t in out.token_ids)
    assert isinstance(out.text, str)


def test_triton_backend_in_engine_gives_same_greedy_tokens(tiny_config):
    # kernels under the interpreter inside the whole engine: chunked prefill (mixed steps), decode, prefix reuse
    prompts = [list(range(3, 3 + n)) for n in (1, 13, 22)] + [list(range(3, 25)) + [40, 41]]
    kw = dict(load_format="dummy", seed=3, kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=16)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_config, **kw)
    tri = make_engine(tiny_config, attention_backend="triton", **kw)
    assert tri.runner.attention_backend == "triton"
    want = [o.token_ids for o in ref.generate(prompts, sp)]
    got = tri.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    assert got[3].cached_tokens > 0  # the last prompt reused the third one's full blocks


def _fake_seq(tokens, block_table):
    return SimpleNamespace(token_ids=list(tokens), num_computed=len(tokens) - 1, kv_offset=0,
                           block_table=list(block_table), observer=None)


def test_decode_graph_buffers_padding_equals_unpadded_eager(tiny_config):
    from kvkeeper.worker.cuda_graphs import DecodeGraphs

    eng = make_engine(tiny_config, load_format="dummy", seed=4, num_kv_blocks=40, block_size=4,
                    attention_backend="triton", kv_dtype="int8")
    runner = eng.runner
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_store:  # random history in every block
        n = cache.k.shape[0] * cache.block_size
        cache.write(torch.randn(n, 1, 16, generator=g), torch.randn(n, 1, 16, generator=g), torch.arange(n))
    seqs = [_fake_seq(range(10, 10 + L), bt) for L, bt in ((9, [7, 3, 11]), (1, [20]), (14, [1, 2, 30, 31]))]
    ids, pos, meta, rows, _ = runner.build_batch([(s, 1) for s in seqs])
    with torch.inference_mode():
        want = runner.model.compute_logits(runner.model(ids, pos, runner.kv_store, meta))
    after_eager = [c.k.clone() for c in runner.kv_store]
    graphs = DecodeGraphs(runner, max_model_len=64, sizes=(1, 2, 4, 8))
    size = graphs.can_replay(3, meta.decode_block_tables.shape[1])
    assert size is None  # nothing captured on CPU: the runner runs this step eagerly
    graphs.fill(4, ids, pos, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
    assert graphs.slots[3].item() == -1 and graphs.context_lens[3].item() == 0
    with torch.inference_mode():
        got = graphs.forward_static(4)
    assert got.shape == (4, 300) and torch.isfinite(got).all()
    assert torch.allclose(got[:3], want, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, c.k) for a, c in zip(after_eager, runner.kv_store))  # padding wrote nothing
    with pytest.raises(ValueError, match="does not fit"):
        graphs.fill(2, ids, pos, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)


def test_runner_replays_padded_graph_batches_for_decode_steps(tiny_config):
    # The runner's graph dispatch on CPU: "replay" runs the captured computation (forward_static) eagerly on
    # the padded static buffers.  Decode-only steps of 3 sequences go through size 4; tokens equal the
    # PyTorch path's; prefill and mixed steps stay eager.
    from kvkeeper.worker.cuda_graphs import DecodeGraphs

    class EagerReplay(DecodeGraphs):
        def replay(self, size, *batch):
            self.fill(size, *batch)
            self.replays += 1
            self.sizes_used.add(size)
            return self.forward_static(size)[: batch[0].shape[0]]

    kw = dict(load_format="dummy", seed=5, kv_cache_bytes=1 << 20, block_size=4)
    prompts = [list(range(7, 7 + n)) for n in (3, 9, 14)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in make_engine(tiny_config, **kw).generate(prompts, sp)]
    eng = make_engine(tiny_config, attention_backend="triton", **kw)
    graphs = EagerReplay(eng.runner, max_model_len=eng.context_length, sizes=(1, 2, 4, 8))
    graphs.graphs = {s: None for s in graphs.sizes}  # "captured"
    graphs.sizes_used = set()
    eng.runner.graphs = graphs
    got = [o.token_ids for o in eng.generate(prompts, sp)]
    assert got == want
    assert graphs.replays >= 5 and graphs.sizes_used == {4}
    assert graphs.eager_steps == 0  # the prefill step has prefills: it never asks for a graph
