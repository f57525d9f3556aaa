"""The C++ CPU kernels (csrc/cpu/) against their references, in both instruction sets.

* block matmul (``qmm``): 4- and 8-bit blocks, random and the embedded GGUF file's own Q4_1 / Q8_0
  tensors, against (a) float64 over the dequantized weights and the int8-rounded activations (only float32
  rounding differs: relative 1e-5) and (b) the float32 product of the dequantized weights (the activation
  rounding per 32 values: relative 1e-3 with 16-bit codes, 5e-2 with 8-bit ones; measured about 2e-5 and 6e-3);
* the interleaved packing, GGUF block decoding and round-to-nearest quantization;
* decode and prefill ("extend") attention read in place against the gathering reference
  (:mod:`kvkeeper.attention.reference`) on awkward lengths, GQA and every KV format.

The kernels are built by ``make setup``.  Without them these tests skip locally and fail under CI (CI=true).
"""


import numpy as np
import pytest
import torch

from tests.utils.kernels import kernels_or_skip  # noqa: E402
from kvkeeper.attention import reference as ref
from kvkeeper.attention import cpu as cpu_attention
from kvkeeper.worker import kernel_check
from kvkeeper.layers import quantized
from kvkeeper.weights import formats as qw

ISAS = ["generic", "avx512_vnni"]  # attention: the AVX2 level gives the generic code's bits (tested below)
QMM_ISAS = ["generic", "avx2", "avx512_vnni"]


@pytest.fixture(scope="module")
def kernels():
    mod = kernels_or_skip()
    yield mod
    mod.set_isa("auto")


def _set_isa(request, kernels):
    if request.param == "avx512_vnni" and not kernels.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512 VNNI")
    if request.param == "avx2" and not kernels.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    kernels.set_isa(request.param)


@pytest.fixture(params=ISAS)
def isa(request, kernels):
    _set_isa(request, kernels)
    yield request.param
    kernels.set_isa("auto")


@pytest.fixture(params=QMM_ISAS)
def qmm_isa(request, kernels):
    _set_isa(request, kernels)
    yield request.param
    kernels.set_isa("auto")


def _random_packed(n, k, bits, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half()
    return u, d, m, quantized.pack_blocks(u, d, m, bits, f"random{bits}")


def _exact_ref(kernels, x, w):
    """float64 product of the int8-rounded activations (as the kernel rounds them) and the weights."""
    xq, dx, _ = kernels.quantize_activations(x)
    xd = (xq.double().view(x.shape[0], -1, 32) * dx.double()[..., None]).view(x.shape)
    return xd @ w.double().T


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


# ---- packing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (17, 64), (3, 32)])
def test_pack_round_trip_and_rows(bits, n, k):
    u, d, m, pw = _random_packed(n, k, bits, seed=n + k + bits)
    assert pw.qs.shape == (-(-n // 16), k // 32, 256 if bits == 4 else 512)
    assert torch.equal(quantized.unpack_codes(pw), u)
    want = (u.view(n, -1, 32).float() * d.float()[..., None] + m.float()[..., None]).view(n, k)
    assert torch.equal(pw.dequantize(), want)
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(pw.rows(ids), want[ids])


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantized.pack_blocks(torch.zeros(4, 40, dtype=torch.int32), torch.zeros(4, 1).half(), torch.zeros(4, 1).half(), 4, "x")
    with pytest.raises(ValueError, match="codes outside"):
        quantized.pack_blocks(torch.full((4, 32), 16, dtype=torch.int32), torch.zeros(4, 1).half(), torch.zeros(4, 1).half(),
                       4, "x")


@pytest.mark.parametrize("fmt,bits", [("int8", 8), ("int4", 4)])
def test_round_to_nearest_error_is_half_a_step(fmt, bits):
    w = torch.randn(48, 128) * torch.linspace(0.01, 3, 128)  # groups of very different ranges
    w[3, 32:64] = 0.0  # an all-zero group
    u, d, m, b = qw.quantize_rtn(w, fmt)
    assert b == bits
    pw = quantized.pack_numpy(u, d, m, b, fmt)
    err = (pw.dequantize() - w).abs().view(48, -1, 32)
    step = torch.from_numpy(d.astype(np.float32))[..., None]
    # half a step, plus float16 rounding of the scale (and, for int4, of the minimum)
    bound = step * 0.5 + w.abs().view(48, -1, 32).amax(-1, keepdim=True) * 2e-3
    assert (err <= bound).all(), (err - bound).max()
    assert (pw.dequantize()[3, 32:64] == 0).all()


# ---- block matmul ------------------------------------------------------------------------------------


@pytest.fixture(params=[16, 8])
def act_bits(request, kernels):
    """16-bit activation codes (the default) and 8-bit ones (llama.cpp's Q8_1 precision)."""
    kernels.set_activation_bits(request.param)
    yield request.param
    kernels.set_activation_bits(16)


# relative error against the float32 product of the dequantized weights: the activations' rounding only
FP32_TOL = {16: 1e-3, 8: 5e-2}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,m", [(40, 96, 1), (17, 64, 3), (64, 128, 8), (48, 32, 13), (16, 256, 17)])
def test_qmm_random_blocks(kernels, qmm_isa, act_bits, bits, n, k, m):
    _, _, _, pw = _random_packed(n, k, bits, seed=n * k * m + bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = kernels.qmm(x, pw.qs, pw.sc, bits, n)
    w = pw.dequantize()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _rel(y, _exact_ref(kernels, x, w)) < 1e-5
    assert _rel(y, x @ w.T) < FP32_TOL[act_bits]


def test_activation_codes_split_exactly(kernels):
    """16-bit codes stay within +-32639 and reproduce x within half a step; 8-bit within +-127."""
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 96)
    xb = x.view(7, -1, 32)
    for bits, qmax in ((16, 32639), (8, 127)):
        kernels.set_activation_bits(bits)
        q, dx, _ = kernels.quantize_activations(x)
        assert q.abs().max().item() <= qmax
        err = (q.view(7, -1, 32).float() * dx[..., None] - xb).abs()
        # half a step, plus the float32 rounding of q * dx - x itself (a few ulps of |x|: about 5% of random inputs
        # exceeded a bare 0.5001 step in the 16-bit mode, the old and the split build alike)
        assert (err <= dx[..., None] * 0.5 + xb.abs() * 2.5e-7).all()
    kernels.set_activation_bits(16)


@pytest.mark.parametrize("bits", [4, 8])
def test_qmm_rows_are_independent_of_the_batch(kernels, bits):
    """A row's result does not depend on the other rows (tiles of 8 and remainders): bitwise."""
    _, _, _, pw = _random_packed(48, 128, bits, seed=7)
    x = torch.randn(21, 128)
    whole = kernels.qmm(x, pw.qs, pw.sc, bits, 48)
    for i in (0, 7, 8, 20):
        assert torch.equal(kernels.qmm(x[i : i + 1].contiguous(), pw.qs, pw.sc, bits, 48)[0], whole[i])


def test_qmm_instruction_sets_agree_bitwise(kernels, act_bits):
    """The AVX2 and AVX-512 paths give the generic path's floats bit for bit (same integer block sums, same float
    updates in the same order), for 4- and 8-bit codes, every tile size and a partial last group of rows."""
    fast = [isa for isa, has in (("avx2", kernels.cpu_has_avx2()), ("avx512_vnni", kernels.cpu_has_avx512())) if has]
    if not fast:
        pytest.skip("this CPU has neither AVX2 + FMA + F16C nor AVX-512 VNNI")
    for bits in (4, 8):
        for n, k, m in ((40, 160, 11), (48, 128, 21), (16, 64, 1), (37, 96, 5)):
            _, _, _, pw = _random_packed(n, k, bits, seed=bits + n)
            x = torch.randn(m, k) * 3
            kernels.set_isa("generic")
            a = kernels.qmm(x, pw.qs, pw.sc, bits, n)
            for isa in fast:
                kernels.set_isa(isa)
                b = kernels.qmm(x, pw.qs, pw.sc, bits, n)
                kernels.set_isa("auto")
                assert torch.equal(a, b), (isa, bits, n, k, m)


def test_qmm_bad_arguments_say_what_is_wrong(kernels):
    _, _, _, pw = _random_packed(16, 64, 4, seed=0)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.qmm(torch.randn(2, 32), pw.qs, pw.sc, 4, 16)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.qmm(torch.randn(2, 64).double(), pw.qs, pw.sc, 4, 16)
    with pytest.raises(RuntimeError, match="last dimension"):
        kernels.qmm(torch.randn(2, 64), pw.qs, pw.sc, 8, 16)


@pytest.fixture(scope="module")
def gguf_tensors():
    gguf = pytest.importorskip("gguf")
    from kvkeeper.weights.sources import resolve_model_path

    try:
        path = resolve_model_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"embedded model not installed: {e}")
    from kvkeeper.gguf_file import GGUFFile

    reader = GGUFFile.open(path)  # GGUFReader's tensor table without its views over the vocabulary
    return gguf, {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_gate.weight",
                                  "token_embd.weight"])
def test_qmm_on_the_real_file_tensors(kernels, gguf_tensors, name):
    gguf, tensors = gguf_tensors
    t = tensors[name]
    n, k = int(t.shape[1]), int(t.shape[0])
    u, d, m, bits = qw.gguf_blocks(t.data, t.tensor_type.name, n, k)
    pw = quantized.pack_numpy(u, d, m, bits, t.tensor_type.name)
    want_w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(n, k)
    assert torch.equal(pw.dequantize(), want_w)  # the repacking keeps every weight exactly
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    if name == "token_embd.weight":  # 49,152 rows: the LM head; a slice of the output keeps the check fast
        x = x[:2].contiguous()
    y = kernels.qmm(x, pw.qs, pw.sc, bits, n)
    assert _rel(y, _exact_ref(kernels, x, want_w)) < 1e-5
    assert _rel(y, x @ want_w.T) < FP32_TOL[16]


# ---- decode attention --------------------------------------------------------------------------------

KV_TOL = {"float32": 1e-4, "bfloat16": 1e-4, "float16": 1e-4, "int8": 1e-4, "fp8_e4m3": 1e-4}


def _decode_case(lens, H, KVH, D, bs, kv, seed=0):
    q, k, v, c_ref, c_k, m_ref, m_k = kernel_check.random_step([(n, 1) for n in lens], H, KVH, D, bs, kv,
                                                               torch.float32, "cpu", seed, extra_cols=2)
    for c, m in ((c_ref, m_ref), (c_k, m_k)):
        c.write(k, v, m.slot_mapping)
    return q, c_ref, c_k, m_ref, m_k


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("lens", [[1], [15], [16], [17], [301], [1, 17, 301, 16, 15]])
def test_decode_attention_matches_reference(kernels, isa, kv, lens):
    q, c_ref, c_k, m_ref, m_k = _decode_case(lens, 9, 3, 64, 16, kv, seed=len(lens) + lens[0])
    want = ref.decode_attention(q, c_ref, m_ref, 0.125)
    got = cpu_attention.decode_attention(q, c_k, m_k, 0.125)
    assert got.shape == want.shape
    assert _rel(got, want) < KV_TOL[kv]


@pytest.mark.parametrize("H,KVH,D,bs", [(8, 2, 32, 16), (4, 4, 128, 8), (6, 1, 64, 5), (4, 2, 24, 16),
                                        (32, 8, 64, 32)])
def test_decode_attention_gqa_shapes_and_block_sizes(kernels, isa, H, KVH, D, bs):
    q, c_ref, c_k, m_ref, m_k = _decode_case([1, 33, 130], H, KVH, D, bs, "int8", seed=H + D)
    want = ref.decode_attention(q, c_ref, m_ref, D**-0.5)
    assert _rel(cpu_attention.decode_attention(q, c_k, m_k, D**-0.5), want) < 1e-4


@pytest.mark.parametrize("kv", ["float32", "int8", "fp8_e4m3"])
def test_decode_attention_7001_tokens(kernels, kv):
    q, c_ref, c_k, m_ref, m_k = _decode_case([7001, 300], 9, 3, 64, 16, kv, seed=3)
    want = ref.decode_attention(q, c_ref, m_ref, 0.125)
    assert _rel(cpu_attention.decode_attention(q, c_k, m_k, 0.125), want) < 1e-4


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("seqs", [[(1, 1), (15, 15)], [(16, 16), (17, 17)], [(301, 301)], [(37, 20), (50, 1)],
                                  [(7001, 45), (33, 2), (40, 1)]],
                         ids=["1+15", "16+17", "301", "mixed", "7001-tail"])
def test_extend_attention_matches_reference(kernels, isa, kv, seqs):
    """Prefill spans (and decode tokens of a mixed step) through the whole CPU step against the reference; every
    token is read back from the cache in both (with nothing cached, the reference attends to the unrounded new
    K/V instead: a bfloat16/float16 cache then differs by its rounding)."""
    q, k, v, c_ref, c_k, m_ref, m_k = kernel_check.random_step(seqs, 9, 3, 64, 16, kv, torch.float32, "cpu",
                                                               seed=len(seqs), extra_cols=1)
    want = ref.paged_attention(q, k, v, c_ref, m_ref, 0.125)
    got = cpu_attention.paged_attention(q, k, v, c_k, m_k, 0.125)
    fresh = any(c == ql and ql > 1 for c, ql in seqs)
    assert _rel(got, want) < (5e-3 if fresh and kv in ("bfloat16", "float16") else 1e-4)


@pytest.mark.parametrize("H,KVH,D,bs", [(8, 2, 128, 8), (4, 4, 32, 16), (6, 1, 64, 5), (4, 2, 24, 16),
                                        (10, 2, 64, 16)])
def test_extend_attention_gqa_shapes_and_block_sizes(kernels, isa, H, KVH, D, bs):
    q, k, v, c_ref, c_k, m_ref, m_k = kernel_check.random_step([(130, 40), (33, 33), (9, 1)], H, KVH, D, bs, "int8",
                                                               torch.float32, "cpu", seed=H * D)
    want = ref.paged_attention(q, k, v, c_ref, m_ref, D**-0.5)
    assert _rel(cpu_attention.paged_attention(q, k, v, c_k, m_k, D**-0.5), want) < 1e-4


@pytest.mark.parametrize("window", [1, 5, 16, 17, 100, 4096])
@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (4, 1, 256)], ids=["G3-D64", "gemma3-G4-D256"])
def test_windowed_attention_matches_reference(kernels, isa, window, H, KVH, D):
    """Sliding-window layers (Gemma 3, Mistral): a query at KV index i sees keys (i - window, i] only, in the
    prefill kernel (spans, cached and fresh) and in decode, against the reference's masked SDPA."""
    seqs = [(301, 40), (33, 33), (9, 1), (120, 1)]
    q, k, v, c_ref, c_k, m_ref, m_k = kernel_check.random_step(seqs, H, KVH, D, 16, "float32", torch.float32, "cpu",
                                                               seed=window + D, extra_cols=1)
    m_ref.window = m_k.window = window
    want = ref.paged_attention(q, k, v, c_ref, m_ref, D**-0.5)
    got = cpu_attention.paged_attention(q, k, v, c_k, m_k, D**-0.5)
    assert _rel(got, want) < 1e-4
    qd, c_ref, c_k, m_ref, m_k = _decode_case([1, 15, 17, 301], H, KVH, D, 16, "int8", seed=window)
    m_ref.window = m_k.window = window
    assert _rel(cpu_attention.decode_attention(qd, c_k, m_k, D**-0.5), ref.decode_attention(qd, c_ref, m_ref,
                                                                                           D**-0.5)) < 1e-4


@pytest.mark.parametrize("kv,H,KVH,D,bs", [(kv, 9, 3, 64, 16) for kv in ("float32", "bfloat16", "float16", "int8",
                                                                          "fp8_e4m3")]
                         + [("int8", 10, 2, 24, 16), ("fp8_e4m3", 6, 1, 64, 5), ("bfloat16", 4, 1, 256, 16)])
def test_attention_avx2_equals_generic_bitwise(kernels, kv, H, KVH, D, bs):
    """The AVX2 attention (8 query lanes at a time) gives the portable routine's floats bit for bit: prefill spans
    (cached and fresh) and the decode tokens of the same step, with and without a window, every KV format."""
    if not kernels.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    seqs = [(301, 40), (130, 130), (9, 1), (120, 1)]
    for window in (None, 17):
        got = {}
        for isa in ("generic", "avx2"):
            q, k, v, _, c_k, _, m_k = kernel_check.random_step(seqs, H, KVH, D, bs, kv, torch.float32, "cpu",
                                                               seed=H + D, extra_cols=1)
            m_k.window = window
            kernels.set_isa(isa)
            try:
                got[isa] = cpu_attention.paged_attention(q, k, v, c_k, m_k, D**-0.5)
            finally:
                kernels.set_isa("auto")
        assert torch.equal(got["generic"], got["avx2"]), (kv, window)


def test_decode_attention_is_batch_invariant(kernels):
    q, _, c_k, _, m_k = _decode_case([1000, 37, 600], 9, 3, 64, 16, "float32", seed=5)
    whole = cpu_attention.decode_attention(q, c_k, m_k, 0.125)
    m_one = kernel_check.AttentionMetadata(slot_mapping=m_k.slot_mapping[:1], decode_indices=torch.tensor([0]),
                                           decode_block_tables=m_k.decode_block_tables[:1],
                                           decode_context_lens=m_k.decode_context_lens[:1])
    assert torch.equal(cpu_attention.decode_attention(q[:1], c_k, m_one, 0.125)[0], whole[0])


@pytest.mark.parametrize("kv", ["bfloat16", "float32"])
@pytest.mark.parametrize("window", [0, 100, 512, 700])
@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (4, 1, 256), (8, 2, 128)], ids=["G3-D64", "G4-D256", "G4-D128"])
def test_invariant_decode_equals_prefill_bit_for_bit_across_segments(kernels, H, KVH, D, window, kv):
    """Issue 26: a query decoded over its cached keys gives the bits the prefill kernel gave the same query in a
    1,100-token span, at positions on and around the fixed split points (every 512 keys), with and without a
    sliding window, and whether the decode runs on one thread or on the pool (one row vs a batch of them)."""
    assert kernels.invariant_attention()
    n, bs = 1100, 16
    q, k, v, _, cache, _, meta = kernel_check.random_step([(n, n)], H, KVH, D, bs, kv, torch.float32, "cpu",
                                                          seed=H + D + window)
    meta.window = window or None
    pre = cpu_attention.paged_attention(q, k, v, cache, meta, D**-0.5)  # writes the span's K/V, then attends
    table = meta.prefills[0].block_table
    positions = [0, 15, 16, 500, 511, 512, 513, 700, 1023, 1024, 1025, 1099]
    rows = torch.tensor(positions)
    batch = kernel_check.AttentionMetadata(slot_mapping=torch.zeros(len(rows), dtype=torch.int64),
                                           decode_indices=torch.arange(len(rows)),
                                           decode_block_tables=table.expand(len(rows), -1).contiguous(),
                                           decode_context_lens=rows + 1, window=window or None)
    together = cpu_attention.decode_attention(q[rows], cache, batch, D**-0.5)
    for i, p in enumerate(positions):
        one = kernel_check.AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.int64),
                                             decode_indices=torch.tensor([0]), decode_block_tables=table[None],
                                             decode_context_lens=torch.tensor([p + 1]), window=window or None)
        alone = cpu_attention.decode_attention(q[p: p + 1], cache, one, D**-0.5)[0]
        assert torch.equal(alone, pre[p]), f"position {p}: max difference {float((alone - pre[p]).abs().max())}"
        assert torch.equal(together[i], pre[p]), f"position {p} in a batch"


def test_start_up_check_catches_a_wrong_kernel(kernels, monkeypatch):
    """The mixed step of the check goes through the prefill kernel, the decode-only one through decode."""
    err = kernel_check.self_check(9, 3, 64, "int8", torch.float32, "cpu", 16, backend="cpu")
    assert err < kernel_check.SELF_CHECK_TOL[torch.float32]
    orig = cpu_attention.decode_attention

    def broken(qd, cache, meta, scale):  # a wrong softmax scale
        return orig(qd, cache, meta, scale * 1.5)

    monkeypatch.setattr(cpu_attention, "decode_attention", broken)
    assert kernel_check.self_check(9, 3, 64, "int8", torch.float32, "cpu", 16, backend="cpu") > 1e-2
    assert kernel_check.qmm_self_check() < kernel_check.QMM_SELF_CHECK_TOL
