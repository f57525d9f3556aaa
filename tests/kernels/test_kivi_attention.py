"""The KIVI int4 / int2 attention kernel (csrc/cpu/attention.cpp section 2c) against the reference path.

The reference (:func:`kvkeeper.attention.reference.kivi_span_attention`) dequantizes every block of the context
and applies the own-block rule (a query's own block from the 16-bit window) with plain matrix products; the
kernel reads the packed codes and the 16-bit window in place.  Tolerance: max |kernel - reference| / max |reference| <= 1e-5 (float32 rounding of two
summation orders; measured 1e-7 to 6e-7 on these cases, 2026-12-06).
"""

from __future__ import annotations

import pytest
import torch

from kvkeeper.attention import cpu, reference
from kvkeeper.attention.metadata import AttentionMetadata, PrefillSpan
from kvkeeper.kernels import cpu as cpu_kernels
from kvkeeper.kvcache.formats.base import PagedKV, parse_kv_format
from kvkeeper.kvcache.formats.kivi import KiviPagedKV
from kvkeeper.worker.kernel_check import random_step

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("fmt", ["int4", "int2"])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 301, 7001])
def test_kernel_equals_reference_decode_and_prefill(fmt, length):
    """A decode token and a prefill chunk ending at ``length`` (plus a short second sequence), GQA 9/3."""
    seqs = [(length, 1), (length, min(length, 37)), (40, 1)] if length > 1 else [(1, 1), (3, 3)]
    q, k, v, c1, c2, m1, m2 = random_step(seqs, 9, 3, 64, 16, fmt, seed=length)
    assert isinstance(c2, KiviPagedKV)
    ref = reference.paged_attention(q, k, v, c1, m1, 0.125)
    got = cpu.paged_attention(q, k, v, c2, m2, 0.125)
    assert _rel(ref, got) <= TOL


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 32), (6, 1, 128)])
@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_gqa_shapes_and_block_size_32(heads, kv_heads, head_dim, fmt):
    for bs in (16, 32):
        q, k, v, c1, c2, m1, m2 = random_step([(203, 1), (90, 21), (33, 33)], heads, kv_heads, head_dim, bs, fmt,
                                              seed=heads + bs)
        assert _rel(reference.paged_attention(q, k, v, c1, m1, head_dim ** -0.5),
                    cpu.paged_attention(q, k, v, c2, m2, head_dim ** -0.5)) <= TOL


def _decode_meta(tables, lens, window=None):
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.as_tensor(t)
    n = len(tables)
    return AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), decode_indices=torch.arange(n),
                             decode_block_tables=bt, decode_context_lens=torch.tensor(lens), decode_max_len=max(lens),
                             window=window)


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_window_straddling_block_boundaries(fmt):
    """Open (16-bit) blocks next to each other across a block boundary, and an open block before closed ones."""
    g = torch.Generator().manual_seed(3)
    cache = PagedKV(12, 16, 3, 64, parse_kv_format(fmt))
    table = torch.tensor([7, 2, 9, 4])
    n = 57
    pos = torch.arange(n)
    slots = table[pos // 16] * 16 + pos % 16
    k, v = torch.randn(n, 3, 64, generator=g), torch.randn(n, 3, 64, generator=g)
    cache.write(k, v, slots)  # blocks 7, 2, 9 closed (their 16-bit copies kept for this step), 4 open (9 tokens)
    assert cache.kept == {7, 2, 9} and int(cache.res_of[4]) >= 0
    q = torch.randn(2, 9, 64, generator=g)
    meta = _decode_meta([table.tolist(), table[:3].tolist()], [n, 41])  # row 1's own block 9 read in 16 bits
    assert _rel(reference.decode_attention(q, cache, meta, 0.125), cpu.decode_attention(q, cache, meta, 0.125)) <= TOL
    cache.write(k[40:41], v[40:41], slots[40:41])  # rewrite a slot of block 9: reopened
    assert int(cache.res_of[9]) >= 0 and not cache.kept  # the window: tokens 32..56, straddling the boundary at 48
    cache.write(k[3:4], v[3:4], slots[3:4])  # an open block before closed ones
    assert int(cache.res_of[7]) >= 0
    kd, _ = cache.gather(table, n, torch.float32)
    assert torch.equal(kd[48:], k[48:].bfloat16().float())  # the tail is held in 16 bits
    q = torch.randn(2, 9, 64, generator=g)
    for window in (None, 20):
        meta = _decode_meta([table.tolist(), table[:3].tolist()], [n, 41], window)
        ref = reference.decode_attention(q, cache, meta, 0.125)
        assert _rel(ref, cpu.decode_attention(q, cache, meta, 0.125)) <= TOL


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_a_token_decoded_equals_the_same_token_prefilled_bit_for_bit(fmt, isa):
    """The kernel's lane arithmetic does not depend on the tile or on the segment split (invariance)."""
    g = torch.Generator().manual_seed(5)
    n = 1100  # three 512-key segments
    cache = PagedKV(80, 16, 3, 64, parse_kv_format(fmt))
    table = torch.randperm(80, generator=g)[: -(-n // 16)]
    pos = torch.arange(n)
    slots = table[pos // 16] * 16 + pos % 16
    cache.write(torch.randn(n, 3, 64, generator=g), torch.randn(n, 3, 64, generator=g), slots)
    q = torch.randn(40, 9, 64, generator=g)
    span = cpu.kivi_attention(q, cache, torch.tensor([0]), torch.tensor([40]), torch.tensor([n]), table[None], 0.125,
                              None)
    for j in (0, 17, 39):
        one = cpu.kivi_attention(q[j: j + 1], cache, torch.tensor([0]), torch.tensor([1]),
                                 torch.tensor([n - 40 + j + 1]), table[None], 0.125, None)
        assert torch.equal(one[0], span[j])


@pytest.fixture(params=["generic", "avx512_vnni"])
def isa(request):
    """Each instruction set the kernels can dispatch to on this CPU (the AVX-512 one skipped where it lacks it)."""
    mod = cpu_kernels.load()
    if request.param == "avx512_vnni" and not mod.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512 VNNI")
    mod.set_isa(request.param)
    yield request.param
    mod.set_isa("auto")


@pytest.mark.parametrize("fmt", ["int4", "int2"])
@pytest.mark.parametrize("hit", [16, 22, 32, 512, 520], ids=lambda h: f"hit{h}")
def test_a_prefix_hit_reads_what_the_cold_prefill_read_bit_for_bit(fmt, hit, isa):
    """Cold: n tokens written and attended in one step (each closed block keeps its 16-bit copy for the step, the
    own-block rule).  Hit: the first ``hit`` tokens written in an earlier step (their closed blocks hold codes only,
    a partial block stays in the window), the rest written and attended in the next step.  The suffix's outputs
    are the cold run's bit for bit on each ISA, at block boundaries (16, 32, 512: also a segment boundary) and
    mid-block (22, 520)."""
    g = torch.Generator().manual_seed(11)
    n, fm = 600, parse_kv_format(fmt)
    table = torch.randperm(48, generator=g)[: -(-n // 16)]
    pos = torch.arange(n)
    slots = table[pos // 16] * 16 + pos % 16
    k, v = torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)
    q = torch.randn(n, 8, 64, generator=g)
    cold_cache, hit_cache = PagedKV(48, 16, 2, 64, fm), PagedKV(48, 16, 2, 64, fm)
    cold_cache.write(k, v, slots)
    cold = cpu.kivi_attention(q, cold_cache, torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), table[None],
                              0.125, None)
    hit_cache.write(k[:hit], v[:hit], slots[:hit])
    hit_cache.write(k[hit:], v[hit:], slots[hit:])
    warm = cpu.kivi_attention(q[hit:], hit_cache, torch.tensor([0]), torch.tensor([n - hit]), torch.tensor([n]),
                              table[None], 0.125, None)
    assert torch.equal(hit_cache.k, cold_cache.k) and torch.equal(hit_cache.k_scale, cold_cache.k_scale)
    assert torch.equal(warm, cold[hit:]), f"max difference {float((warm - cold[hit:]).abs().max())}"


def test_bad_arguments_are_refused():
    cache = PagedKV(4, 16, 1, 64, parse_kv_format("int4"))
    q = torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu.kivi_attention(q, cache, torch.tensor([0]), torch.tensor([1]), torch.tensor([65]),
                           torch.tensor([[0, 1, 2, 3]]), 0.1, None)
    with pytest.raises(RuntimeError, match="bits"):
        cpu_kernels.load().kivi_attention(q, cache.k, cache.v, cache.k_scale, cache.k_min, cache.v_scale,
                                          cache.v_min, cache.res_of, cache.res_k, cache.res_v, torch.tensor([0]),
                                          torch.tensor([1]), torch.tensor([1]), torch.tensor([[0]]), 0.1, 3, 0)
