"""The AVX2 path of the portable attention routine (csrc/cpu/attention.cpp, ``attend_rows_avx2``): the prefill
("extend") and the invariant decode kernels give the generic path's floats bit for bit (the same sequential score
sums and softmax updates, keys converted once per tile or row instead of once per query), for every KV format,
GQA groups, head sizes that are not a multiple of 8, block sizes that do not divide 8, cached and fresh spans,
mixed steps and sliding windows.  The reference comparisons of tests/kernels/test_cpu_kernels.py run it too
(its ``avx2`` level).  Skips on a CPU without AVX2 + FMA + F16C.
"""

import pytest
import torch

from kvkeeper.attention import cpu as cpu_attention
from kvkeeper.worker import kernel_check
from tests.utils.kernels import kernels_or_skip


@pytest.fixture(scope="module")
def kernels():
    mod = kernels_or_skip()
    if not mod.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    yield mod
    mod.set_isa("auto")


def _both(kernels, fn):
    kernels.set_isa("generic")
    try:
        want = fn()
    finally:
        kernels.set_isa("avx2")
    try:
        got = fn()
    finally:
        kernels.set_isa("auto")
    return want, got


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("H,KVH,D,bs,window", [(9, 3, 64, 16, 0), (8, 2, 20, 5, 0), (4, 1, 36, 16, 7),
                                               (6, 6, 128, 8, 100)])
def test_avx2_attention_equals_generic_bit_for_bit(kernels, kv, H, KVH, D, bs, window):
    seqs = [(301, 40), (33, 33), (9, 1), (120, 1), (1, 1)]
    q, k, v, c_a, c_b, m_a, m_b = kernel_check.random_step(seqs, H, KVH, D, bs, kv, torch.float32, "cpu",
                                                           seed=H + D + bs, extra_cols=1)
    m_a.window = m_b.window = window or None
    caches = iter((c_a, m_a, c_b, m_b))
    want, got = _both(kernels, lambda: cpu_attention.paged_attention(q, k, v, next(caches), next(caches), D**-0.5))
    assert torch.equal(want, got), float((want - got).abs().max())
    # decode over the keys the step wrote, a row per span's last token
    tables = [p.block_table for p in m_a.prefills][:2]
    table = torch.zeros(2, max(t.numel() for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, : t.numel()] = t
    lens = torch.tensor([301, 33])
    meta = kernel_check.AttentionMetadata(slot_mapping=torch.zeros(2, dtype=torch.int64),
                                          decode_indices=torch.arange(2), decode_block_tables=table,
                                          decode_context_lens=lens, window=window or None)
    qd = torch.randn(2, H, D, generator=torch.Generator().manual_seed(D))
    want, got = _both(kernels, lambda: cpu_attention.decode_attention(qd, c_a, meta, D**-0.5))
    assert torch.equal(want, got), float((want - got).abs().max())
