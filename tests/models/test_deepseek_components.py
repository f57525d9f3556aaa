"""The engine's components on a Multi-head Latent Attention model (tiny random DeepSeek-V3, int8 latent cache).

Sessions, offload tiers, validators, the reuse audit and KV dumps work on the latent cache; KV compression,
the C++ / Triton attention backends and weight quantization are refused with a clear error (README, DeepSeek).
"""

from __future__ import annotations

import pytest
import torch

from kvkeeper import SamplingParams
from kvkeeper.diagnostics.audit import audit_sequence
from kvkeeper.diagnostics.kvdump import dump_prompt
from kvkeeper.errors import InvalidRequestError
from kvkeeper.kvcache.compression import KVCompression
from kvkeeper.kvcache.validate import check_engine
from kvkeeper.sessions import SessionManager
from tests.utils.tiny_models import kk_logits_chunked, tiny_deepseek_folder
from tests.utils.engines import make_engine

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=6, temperature=0)
TURNS = ["Name three colours.", "And three animals?", "Which of them is the largest?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_deepseek_folder(tmp_path_factory.mktemp("tiny-dsv3"), seed=3)


@pytest.fixture(scope="module")
def eng(folder):
    """int8 latent cache (one scale per token row), blocks of 8."""
    return make_engine(model=str(folder), num_kv_blocks=128, block_size=8, kv_dtype="int8", quantization="none")


def test_int8_latent_rows_have_one_scale_per_token(eng):
    c = eng.kv.store[0]
    assert c.latent and c.k.dtype == torch.int8 and c.v is None and c.v_scale is None
    assert tuple(c.k_scale.shape) == (128, 8, 1)
    # (32 + 8) int8 values + one fp16 scale, per token and layer
    assert eng.kv.bytes_per_token == 2 * (32 + 8 + 2)


def test_sessions_offload_round_trip_bit_exact(eng, tmp_path):
    sessions = SessionManager(eng, data_dir=tmp_path)
    ref = sessions.open(system="You are terse.")
    want = [ref.send(t, GREEDY) for t in TURNS]
    ref.close()
    eng.pool.reset_prefix_cache()
    s = sessions.open(system="You are terse.")
    out = [s.send(t, GREEDY) for t in TURNS[:2]]
    assert out[1].cached_tokens > 0, "turn 2 reuses turn 1's latent rows"
    nb = -(-s.kv.num_computed // eng.block_size)
    before = [c.read_blocks(s.kv.block_table[:nb]) for c in eng.kv.store]
    s.offload("host")
    s.offload("disk")
    assert s.tier == "disk"
    eng.pool.reset_prefix_cache()
    free = torch.tensor([b.block_id for b in eng.pool.blocks if b.ref_count == 0], dtype=torch.int64)
    for c in eng.kv.store:  # scribble over every free block: only the disk tier can give the KV back
        for t in c._parts().values():
            c._raw(t).index_fill_(0, free, 7)
    assert sessions.store.restore(s)
    after = [c.read_blocks(s.kv.block_table[:nb]) for c in eng.kv.store]
    for x, y in zip(before, after):
        assert set(x) == {"k", "k_scale"}
        assert all(torch.equal(x[k], y[k]) for k in x)
    out.append(s.send(TURNS[2], GREEDY))
    for g, r in zip(out, want):
        assert g.token_ids == r.token_ids and g.prompt_token_ids == r.prompt_token_ids
    assert out[2].cached_tokens == want[2].cached_tokens
    assert not check_engine(eng)
    s.close()
    assert eng.pool.num_used == 0 and not check_engine(eng)


def test_audit_and_dump_on_latent_cache(eng):
    ids = list(range(100, 140))
    tensors, meta = dump_prompt(eng, ids, layers=[0, 1])
    assert meta["kv_layout"] == "mla_latent" and sorted(tensors) == ["layers.0.k", "layers.1.k"]
    assert tuple(tensors["layers.0.k"].shape) == (40, 1, 40)
    kept = []
    kk_logits_chunked(eng, [ids], [[16], [16], [8]], keep_seqs=kept)  # prefilled in three chunks
    try:
        rep = audit_sequence(eng, kept[0])  # against a one-piece recompute
        assert rep.ok, rep
        assert len(rep.layer_max_abs_diff) == 2
        stored, _ = eng.kv.store[1].gather(torch.tensor(kept[0].block_table), 40, torch.float32)
        assert torch.equal(stored.to(tensors["layers.1.k"].dtype), tensors["layers.1.k"])
    finally:
        eng.kv.free(kept[0])


def test_refusals(folder, eng):
    with pytest.raises(InvalidRequestError, match="KV compression is not supported"):
        eng.add_request(list(range(50)), GREEDY, compression=KVCompression("streaming_llm", 0.5))
    with pytest.raises(InvalidRequestError, match="no Multi-head Latent Attention kernel"):
        make_engine(model=str(folder), num_kv_blocks=16, attention_backend="cpu")
    with pytest.raises(InvalidRequestError, match="does not run DeepSeek"):
        make_engine(model=str(folder), num_kv_blocks=16, quantization="int8")
    assert eng.runner.attention_backend == "torch" and eng.runner.fused_decode is None


def test_dummy_configs(folder):
    """Shipped DeepSeek shapes are counted on the meta device; a dummy engine runs a DeepSeek config."""
    from kvkeeper.weights import dummy

    counts = {n: dummy.parameter_count(dummy.load_config(n)[0]) for n in ("deepseek-v2-lite", "deepseek-v3")}
    assert round(counts["deepseek-v2-lite"] / 1e9, 1) == 15.7
    assert round(counts["deepseek-v3"] / 1e9, 1) == 671.0
    e = make_engine(model=str(folder / "config.json"), load_format="dummy", num_kv_blocks=16, quantization="none")
    (out,) = e.generate([list(range(10, 30))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3 and e.model_config.is_mla
