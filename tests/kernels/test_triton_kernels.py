"""The Triton paged-attention kernels under Triton's interpreter (CPU tensors) against the PyTorch
reference (kvkeeper.attention.reference.paged_attention), on awkward sizes: lengths that are not
multiples of the block size, one token, many blocks, GQA ratios 1, 4 and 8, fp32 / bf16 / int8 /
fp8 caches, decode-only, prefill-only and mixed steps.  A kernel broken on purpose (block-table
index off by one) must fail the same comparison."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported (read at import time)

import pytest
import torch

triton = pytest.importorskip("triton")

from kvkeeper.kvcache.formats.base import PagedKV, parse_kv_format  # noqa: E402
from kvkeeper.attention import reference as ref  # noqa: E402
from kvkeeper.worker import kernel_check  # noqa: E402
from kvkeeper.attention import triton_backend as tk  # noqa: E402

TOL = {"float32": 2e-5, "int8": 2e-5, "fp8_e4m3": 2e-5, "bfloat16": 2e-2}


def make_step(seqs, H, KVH, D, bs, kv, dtype=torch.float32, seed=0, extra_cols=0):
    """seqs: list of (context_len, q_len); see ``triton_attention.random_step`` (on CPU tensors)."""
    return kernel_check.random_step(seqs, H, KVH, D, bs, kv, dtype, "cpu", seed, extra_cols)


def run_both(seqs, H, KVH, D, bs, kv, dtype=torch.float32, seed=0, **kw):
    q, k, v, c_ref, c_tk, m_ref, m_tk = make_step(seqs, H, KVH, D, bs, kv, dtype, seed)
    for name, val in kw.items():
        setattr(m_tk, name, val)
    scale = D**-0.5
    want = ref.paged_attention(q, k, v, c_ref, m_ref, scale)
    got = tk.triton_paged_attention(q, k, v, c_tk, m_tk, scale)
    return want, got, c_ref, c_tk


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("kv", ["float32", "int8", "fp8_e4m3"])
def test_decode_matches_reference(ratio, kv):
    # lengths 1 (one token), 17 and 33 (one past a block), 70 (many blocks of 4 with a partial tail)
    seqs = [(1, 1), (17, 1), (33, 1), (70, 1)]
    want, got, c_ref, c_tk = run_both(seqs, H=2 * ratio, KVH=2, D=16, bs=4, kv=kv, seed=ratio)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert max_err(got, want) < TOL[kv]
    # the store kernel wrote exactly what PagedKV.write writes (values and scales)
    assert torch.equal(c_tk.k.view(torch.uint8) if c_tk.k.element_size() == 1 else c_tk.k,
                       c_ref.k.view(torch.uint8) if c_ref.k.element_size() == 1 else c_ref.k)
    if c_ref.k_scale is not None:
        assert torch.equal(c_tk.k_scale, c_ref.k_scale) and torch.equal(c_tk.v_scale, c_ref.v_scale)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_decode_split_k_long_context(splits):
    # 301 tokens over 76 blocks of 4, several splits (some empty for the short sequence): same answer
    seqs = [(301, 1), (5, 1)]
    want, got, *_ = run_both(seqs, H=8, KVH=2, D=32, bs=4, kv="float32", decode_num_splits=splits)
    assert max_err(got, want) < TOL["float32"]


def test_decode_padding_row_gives_zeros():
    q, k, v, c, _, m, _ = make_step([(9, 1)], H=4, KVH=1, D=16, bs=4, kv="float32")
    tk.store_kv(k, v, c, m.slot_mapping)
    bt = torch.cat([m.decode_block_tables, torch.zeros_like(m.decode_block_tables)])
    lens = torch.tensor([9, 0])
    out = tk.decode_attention(torch.cat([q, q]), c, bt, lens, 0.25, max_len=9)
    assert torch.all(out[1] == 0) and torch.isfinite(out).all()
    assert out[0].abs().sum() > 0
    # a negative slot is skipped by the store kernel
    before = c.k.clone()
    tk.store_kv(k + 1, v + 1, c, torch.tensor([-1]))
    assert torch.equal(before, c.k)


@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_prefill_and_extend_match_reference(ratio, kv):
    # a fresh 23-token prompt, a 7-token chunk after 43 cached tokens, a 2-token chunk after 1
    seqs = [(23, 23), (50, 7), (3, 2)]
    want, got, *_ = run_both(seqs, H=2 * ratio, KVH=2, D=16, bs=4, kv=kv, seed=10 + ratio)
    assert max_err(got, want) < TOL[kv]


def test_mixed_step_fp8_and_block_size_16():
    # prefill chunks and decode tokens in one step, block size 16, D not a power of two (24)
    seqs = [(40, 1), (37, 37), (1, 1), (100, 19), (16, 1)]
    want, got, *_ = run_both(seqs, H=8, KVH=2, D=24, bs=16, kv="fp8_e4m3", seed=3)
    assert max_err(got, want) < TOL["fp8_e4m3"]


def test_bf16_close_to_reference():
    seqs = [(30, 1), (45, 9), (12, 12)]
    want, got, *_ = run_both(seqs, H=4, KVH=1, D=32, bs=8, kv="bfloat16", dtype=torch.bfloat16, seed=5)
    assert got.dtype == torch.bfloat16
    assert max_err(got, want) < TOL["bfloat16"]


def test_choose_num_splits():
    assert tk.choose_num_splits(1, 8, 100) == 1  # short: no split
    assert tk.choose_num_splits(1, 8, 32768) == 64  # long, one sequence: as many as allowed
    assert tk.choose_num_splits(256, 8, 32768) == 1  # the batch fills the GPU already
    assert 1 < tk.choose_num_splits(4, 8, 8192) < 64


# ---- a kernel broken on purpose must fail the comparison --------------------------------------


def test_broken_decode_kernel_is_caught():
    q, k, v, c_ref, c_tk, m_ref, m_tk = make_step([(33, 1), (21, 1)], H=8, KVH=2, D=16, bs=4, kv="float32",
                                                  extra_cols=2)
    want = ref.paged_attention(q, k, v, c_ref, m_ref, 0.25)
    tk.store_kv(k, v, c_tk, m_tk.slot_mapping)
    ok = tk.decode_attention(q, c_tk, m_tk.decode_block_tables, m_tk.decode_context_lens, 0.25, max_len=33)
    bad = tk.decode_attention(q, c_tk, m_tk.decode_block_tables, m_tk.decode_context_lens, 0.25, max_len=33,
                              _bt_fault=1)
    assert max_err(ok, want) < TOL["float32"]
    assert max_err(bad, want) > 1e-2  # the off-by-one block index reads other blocks


def test_broken_extend_kernel_is_caught():
    q, k, v, c_ref, c_tk, m_ref, m_tk = make_step([(30, 6), (9, 9)], H=4, KVH=2, D=16, bs=4, kv="int8",
                                                  extra_cols=2)
    want = ref.paged_attention(q, k, v, c_ref, m_ref, 0.25)
    tk.store_kv(k, v, c_tk, m_tk.slot_mapping)
    starts, lens, ctx, bt, mq = tk._extend_inputs(m_tk, q.device)
    ok = tk.extend_attention(q, c_tk, starts, lens, ctx, bt, 0.25, mq)
    bad = tk.extend_attention(q, c_tk, starts, lens, ctx, bt, 0.25, mq, _bt_fault=1)
    assert max_err(ok, want) < TOL["int8"]
    assert max_err(bad, want) > 1e-2


@pytest.mark.parametrize("kv,dtype,bs", [("float32", torch.float32, 16), ("int8", torch.float32, 4),
                                         ("bfloat16", torch.bfloat16, 16), ("fp8_e4m3", torch.bfloat16, 8)])
def test_start_up_self_check(kv, dtype, bs):
    # what the runner runs on CUDA before trusting the kernels: small against tolerance here, large when broken
    err = kernel_check.self_check(8, 2, 16, parse_kv_format(kv), dtype, "cpu", bs)
    assert err < kernel_check.SELF_CHECK_TOL[dtype]
    orig = tk.decode_attention

    def broken(q, cache, tables, lens, scale, **k):  # a wrong softmax scale (memory-safe, unlike a bad index here)
        return orig(q, cache, tables, lens, scale * 1.5, **k)

    tk.decode_attention = broken
    try:
        err = kernel_check.self_check(8, 2, 16, parse_kv_format(kv), dtype, "cpu", bs)
        assert err > kernel_check.SELF_CHECK_TOL[dtype]
    finally:
        tk.decode_attention = orig
