// kvkeeper CPU kernels: matmul over 4-/8-bit weight blocks computed in place, and paged decode attention.
//
// Built by `make setup` (kvkeeper.model.cpu_kernels.build) with torch.utils.cpp_extension; loaded by
// kvkeeper.model.cpu_kernels.  Every kernel has a portable C++ path and an AVX-512 path (AVX512F/BW/VL +
// VNNI + F16C) chosen at run time from the CPU's flags (`isa()`); the file itself is compiled for the
// baseline x86-64 ISA, so the .so loads on any x86-64 CPU.
//
// 1. qmm: y (M, N) = x (M, K) @ W^T, W given as blocks of 32 weights with w = d * u + m, where u is an
//    unsigned 4-bit (Q4_0, Q4_1) or 8-bit (Q8_0) code and d, m are float16 per (row, block).  Q4_1 maps as
//    is (m = its min), Q4_0 as m = -8d, Q8_0 as u = q + 128, m = -128d (all exact).  The activations are
//    quantized per row and block of 32 to int8 with scale dx = max|x| / 127 and the sum
//    sx = dx * sum(q) (llama.cpp's Q8_1), so that
//        sum_k w_k x_k ~= sum_blocks d * dx * sum(u_k q_k) + m * sx,
//    the integer dot product being exact.  This is ggml's Q4_1 x Q8_1 dot product (llama.cpp,
//    ggml-cpu/quants.c ggml_vec_dot_q4_1_q8_1), laid out for AVX-512 VNNI: weights are interleaved 16
//    output rows at a time (see kvkeeper.model.quant_weights.pack_blocks) so that one VPDPBUSD multiplies
//    4 codes of each of 16 rows by 4 activation bytes broadcast to every lane, and 8 of them complete one
//    block for 16 rows; the int32 lanes are then the 16 rows' block sums, scaled and accumulated in fp32
//    (the interleaved "repacked" layouts of ggml-cpu/repack.cpp follow the same idea).
//
// 2. decode_attention: one query token per sequence over its paged K/V, read in place block by block
//    (no gather), with an online softmax (Milakov & Gimelshein, 2018) and the context split into chunks
//    of a fixed number of blocks whose partial results are combined at the end (flash-decoding, Dao et
//    al., 2023).  K/V storage: float32, bfloat16, float16, int8 or float8 e4m3 with float16 per-token
//    per-head scales (kvkeeper.kvcache.quant).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

#define KVK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

// ---------------------------------------------------------------------------------------------------
// ISA selection
// ---------------------------------------------------------------------------------------------------
bool cpu_has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

bool g_force_generic = false;

bool use_avx512() { return !g_force_generic && cpu_has_avx512(); }

std::string isa() { return use_avx512() ? "avx512_vnni" : "generic"; }

void set_isa(const std::string& name) {
  if (name == "auto") {
    g_force_generic = false;
  } else if (name == "generic") {
    g_force_generic = true;
  } else if (name == "avx512_vnni") {
    TORCH_CHECK(cpu_has_avx512(), "this CPU lacks AVX-512 VNNI (avx512f/bw/vl/dq, avx512_vnni, f16c, fma)");
    g_force_generic = false;
  } else {
    TORCH_CHECK(false, "unknown ISA '", name, "': choose auto, generic or avx512_vnni");
  }
}

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// ---------------------------------------------------------------------------------------------------
// 1. activation quantization, per row and block of 32: x ~= dx * q with q = round(x / dx) integer and
//    sx = dx * sum(q) (llama.cpp's Q8_1 keeps that scaled sum too).  16-bit (default): dx = max|x| / 32639 and
//    q = 256 * q_hi + q_lo with q_hi = floor(q / 256 + 1/2) in [-127, 127] and q_lo in [-128, 127], both int8, so
//    the u8 x s8 dot products (VPDPBUSD) run twice per block and sum(u q) = 256 sum(u q_hi) + sum(u q_lo) exactly.
//    8-bit: dx = max|x| / 127, q_hi = q, no q_lo (llama.cpp's precision: faster, less exact).
//    Layout: a row of xq holds K bytes of q_hi then, in 16-bit mode, K bytes of q_lo.
// ---------------------------------------------------------------------------------------------------
constexpr int QK = 32;
constexpr float Q16MAX = 32639.f;  // 127 * 257: q_hi stays within int8
bool g_act16 = true;

int activation_bits() { return g_act16 ? 16 : 8; }

void set_activation_bits(int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 16, "activation bits must be 8 or 16, got ", bits);
  g_act16 = bits == 16;
}

inline int64_t xq_stride(int64_t K) { return g_act16 ? 2 * K : K; }

void quantize_rows_generic(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / QK, xs = xq_stride(K);
  const float qmax = g_act16 ? Q16MAX : 127.f;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * QK;
      float amax = 0.f;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / qmax;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int i = 0; i < QK; ++i) {
        const int q = static_cast<int>(std::nearbyint(xb[i] * id));  // round half to even, as cvtps2dq
        sum += q;
        if (g_act16) {
          const int hi = (q + 128) >> 8;  // floor((q + 128) / 256): arithmetic shift
          xq[r * xs + b * QK + i] = static_cast<int8_t>(hi);
          xq[r * xs + K + b * QK + i] = static_cast<int8_t>(q - 256 * hi);
        } else {
          xq[r * xs + b * QK + i] = static_cast<int8_t>(q);
        }
      }
      dx[r * nb + b] = d;
      sx[r * nb + b] = d * static_cast<float>(sum);
    }
  }
}

KVK_AVX512 void quantize_rows_avx512(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / QK, xs = xq_stride(K);
  const float qmax = g_act16 ? Q16MAX : 127.f;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i c128 = _mm512_set1_epi32(128);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * QK;
      const __m512 a = _mm512_loadu_ps(xb);
      const __m512 c = _mm512_loadu_ps(xb + 16);
      const __m512 amaxv = _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, c));
      const float amax = _mm512_reduce_max_ps(amaxv);
      const float d = amax / qmax;
      const float id = d != 0.f ? 1.f / d : 0.f;
      const __m512 idv = _mm512_set1_ps(id);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, idv));  // MXCSR default: round half to even
      const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, idv));
      int8_t* dst = xq + r * xs + b * QK;
      if (g_act16) {
        const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, c128), 8);
        const __m512i hc = _mm512_srai_epi32(_mm512_add_epi32(qc, c128), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(ha));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(hc));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + K),
                         _mm512_cvtepi32_epi8(_mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 8))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + K + 16),
                         _mm512_cvtepi32_epi8(_mm512_sub_epi32(qc, _mm512_slli_epi32(hc, 8))));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qc));
      }
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
      dx[r * nb + b] = d;
      sx[r * nb + b] = d * static_cast<float>(sum);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// 1. qmm over the interleaved block layout
//    qs: (G, nb, BYTES) uint8 with BYTES = 256 (4-bit) or 512 (8-bit) per (16 rows, block of 32);
//    sc: (G, nb, 2, 16) float16: d then m of the 16 rows.
//    4-bit: byte 64*s + 4*i + c holds u(row i, 4s + c) in its low nibble and u(row i, 16 + 4s + c) in its
//    high nibble (s = 0..3); 8-bit: byte 64*j + 4*i + c holds u(row i, 4j + c) (j = 0..7).
// ---------------------------------------------------------------------------------------------------
template <int BITS>
inline int code_at(const uint8_t* blk, int i, int k) {  // u(row i, element k) of one (16 rows, 32) block
  if (BITS == 8) return blk[64 * (k / 4) + 4 * i + (k % 4)];
  const int s = (k % 16) / 4, c = k % 4;
  const uint8_t byte = blk[64 * s + 4 * i + c];
  return k < 16 ? (byte & 0x0F) : (byte >> 4);
}

template <int BITS>
void qmm_group_generic(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* xq, const float* dx,
                       const float* sx, int64_t M, int64_t K, float* y, int64_t N, int64_t n0) {
  constexpr int BYTES = BITS == 4 ? 256 : 512;
  const int rows = static_cast<int>(std::min<int64_t>(16, N - n0));
  const int64_t xs = xq_stride(K);
  for (int64_t r = 0; r < M; ++r) {
    float acc[16] = {0};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = qs + b * BYTES;
      const uint16_t* s = sc + b * 32;
      const int8_t* xb = xq + r * xs + b * QK;
      for (int i = 0; i < 16; ++i) {
        int isum = 0;
        for (int k = 0; k < QK; ++k) isum += code_at<BITS>(blk, i, k) * static_cast<int>(xb[k]);
        if (g_act16) {
          int lo = 0;
          for (int k = 0; k < QK; ++k) lo += code_at<BITS>(blk, i, k) * static_cast<int>(xb[K + k]);
          isum = isum * 256 + lo;
        }
        const float dw = half_to_float(s[i]), mw = half_to_float(s[16 + i]);
        acc[i] = std::fma(static_cast<float>(isum), dw * dx[r * nb + b], acc[i]);
        acc[i] = std::fma(mw, sx[r * nb + b], acc[i]);
      }
    }
    for (int i = 0; i < rows; ++i) y[r * N + n0 + i] = acc[i];
  }
}

template <int BITS, int MT, bool A16>
KVK_AVX512 inline void qmm_tile_avx512(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* xq,
                                       const float* dx, const float* sx, int64_t K, float* y, int64_t N,
                                       int64_t n0, __mmask16 mask) {
  const int64_t xs = A16 ? 2 * K : K;
  constexpr int BYTES = BITS == 4 ? 256 : 512;
  __m512 acc[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = qs + b * BYTES;
    __m512i w[8];
    if (BITS == 4) {
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * s);
        w[s] = _mm512_and_si512(v, low4);
        w[s + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(blk + 64 * j);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b * 32)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b * 32 + 16)));
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const int32_t* xb = reinterpret_cast<const int32_t*>(xq + m * xs + b * QK);
      __m512i is = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) is = _mm512_dpbusd_epi32(is, w[j], _mm512_set1_epi32(xb[j]));
      if (A16) {
        const int32_t* xl = reinterpret_cast<const int32_t*>(xq + m * xs + K + b * QK);
        __m512i il = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) il = _mm512_dpbusd_epi32(il, w[j], _mm512_set1_epi32(xl[j]));
        is = _mm512_add_epi32(_mm512_slli_epi32(is, 8), il);
      }
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * N + n0, mask, acc[m]);
}

template <int BITS, bool A16>
KVK_AVX512 void qmm_group_avx512(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* xq,
                                 const float* dx, const float* sx, int64_t M, int64_t K, float* y, int64_t N,
                                 int64_t n0) {
  const int rows = static_cast<int>(std::min<int64_t>(16, N - n0));
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
  const int64_t xs = A16 ? 2 * K : K;
  constexpr int MT = A16 ? 6 : 8;  // rows per tile: the 16-bit mode keeps two int32 sums per row live
  int64_t r = 0;
  for (; r + MT <= M; r += MT)
    qmm_tile_avx512<BITS, MT, A16>(qs, sc, nb, xq + r * xs, dx + r * nb, sx + r * nb, K, y + r * N, N, n0, mask);
  const int64_t rem = M - r;
  const int8_t* xr = xq + r * xs;
  const float* dr = dx + r * nb;
  const float* sr = sx + r * nb;
  float* yr = y + r * N;
  switch (rem) {
    case 0: break;
    case 1: qmm_tile_avx512<BITS, 1, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 2: qmm_tile_avx512<BITS, 2, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 3: qmm_tile_avx512<BITS, 3, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 4: qmm_tile_avx512<BITS, 4, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 5: qmm_tile_avx512<BITS, 5, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 6: qmm_tile_avx512<BITS, 6, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    default: qmm_tile_avx512<BITS, 7, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
  }
}

// Scratch for the quantized activations, reused across calls (one engine thread calls the kernels).
struct ActScratch {
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
};

ActScratch& act_scratch() {
  thread_local ActScratch s;
  return s;
}

// A packed weight as the kernels see it (see kvkeeper.model.quant_weights.PackedWeight).
struct QW {
  const uint8_t* qs;
  const uint16_t* sc;
  int64_t bits, n, k, groups;
};

QW make_qw(const torch::Tensor& qs, const torch::Tensor& sc, int64_t bits, int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 8, "qmm: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "qmm: qs must be a contiguous (G, blocks, bytes) uint8 tensor");
  TORCH_CHECK(sc.dim() == 4 && sc.scalar_type() == at::kHalf && sc.is_contiguous() && sc.size(2) == 2 &&
                  sc.size(3) == 16, "qmm: sc must be a contiguous (G, blocks, 2, 16) float16 tensor");
  const int64_t G = qs.size(0), nb = qs.size(1);
  TORCH_CHECK(qs.size(2) == (bits == 4 ? 256 : 512), "qmm: qs last dimension must be ", bits == 4 ? 256 : 512);
  TORCH_CHECK(sc.size(0) == G && sc.size(1) == nb, "qmm: sc shape does not match qs");
  TORCH_CHECK(N > 16 * (G - 1) && N <= 16 * G, "qmm: N=", N, " does not fit ", G, " groups of 16 rows");
  return {qs.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>()), bits, N, nb * QK, G};
}

// y (M, w.n) = x (M, w.k) @ W^T, both row-major float32.
void qmm_raw(const float* x, int64_t M, const QW& w, float* y) {
  if (M == 0) return;
  const int64_t K = w.k, nb = K / QK, N = w.n;
  auto& s = act_scratch();
  s.xq.resize(M * xq_stride(K));
  s.dx.resize(M * nb);
  s.sx.resize(M * nb);
  const bool fast = use_avx512();
  if (fast)
    quantize_rows_avx512(x, M, K, s.xq.data(), s.dx.data(), s.sx.data());
  else
    quantize_rows_generic(x, M, K, s.xq.data(), s.dx.data(), s.sx.data());
  const int64_t qstride = nb * (w.bits == 4 ? 256 : 512), sstride = nb * 32;
  const int8_t* xq = s.xq.data();
  const float* dx = s.dx.data();
  const float* sx = s.sx.data();
  const uint8_t* q = w.qs;
  const uint16_t* scp = w.sc;
  const int64_t bits = w.bits;
  const bool a16 = g_act16;
  // grain: enough work per task that small products stay on one thread
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, M * nb));
  at::parallel_for(0, w.groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (fast) {
        const uint8_t* qg = q + g * qstride;
        const uint16_t* sg = scp + g * sstride;
        if (bits == 4 && a16)
          qmm_group_avx512<4, true>(qg, sg, nb, xq, dx, sx, M, K, y, N, 16 * g);
        else if (bits == 4)
          qmm_group_avx512<4, false>(qg, sg, nb, xq, dx, sx, M, K, y, N, 16 * g);
        else if (a16)
          qmm_group_avx512<8, true>(qg, sg, nb, xq, dx, sx, M, K, y, N, 16 * g);
        else
          qmm_group_avx512<8, false>(qg, sg, nb, xq, dx, sx, M, K, y, N, 16 * g);
      } else {
        if (bits == 4)
          qmm_group_generic<4>(q + g * qstride, scp + g * sstride, nb, xq, dx, sx, M, K, y, N, 16 * g);
        else
          qmm_group_generic<8>(q + g * qstride, scp + g * sstride, nb, xq, dx, sx, M, K, y, N, 16 * g);
      }
    }
  });
}

// x: (M, K) float32; qs: (G, nb, 256|512) uint8; sc: (G, nb, 2, 16) float16; returns (M, N) float32.
torch::Tensor qmm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc, int64_t bits, int64_t N) {
  const QW w = make_qw(qs, sc, bits, N);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qmm: x must be a 2-D float32 tensor, got ",
              x.scalar_type(), " of ", x.dim(), " dims");
  TORCH_CHECK(x.size(1) == w.k, "qmm: x has ", x.size(1), " columns, the weight ", w.k);
  const auto xc = x.contiguous();
  auto y = torch::empty({xc.size(0), N}, x.options());
  qmm_raw(xc.data_ptr<float>(), xc.size(0), w, y.data_ptr<float>());
  return y;
}

// The activation quantization alone (tests): x (M, K) float32 -> (q (M, K) int32, dx (M, K/32), sx (M, K/32)),
// q the integer code of each element (q_hi * 256 + q_lo in 16-bit mode) so that x ~= dx * q.
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % QK == 0,
              "quantize_activations: x must be (M, K) float32 with K a multiple of 32");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), nb = K / QK, xs = xq_stride(K);
  std::vector<int8_t> raw(M * xs);
  auto d = torch::empty({M, nb}, x.options());
  auto s = torch::empty({M, nb}, x.options());
  if (use_avx512())
    quantize_rows_avx512(xc.data_ptr<float>(), M, K, raw.data(), d.data_ptr<float>(), s.data_ptr<float>());
  else
    quantize_rows_generic(xc.data_ptr<float>(), M, K, raw.data(), d.data_ptr<float>(), s.data_ptr<float>());
  auto q = torch::empty({M, K}, x.options().dtype(at::kInt));
  int32_t* qp = q.data_ptr<int32_t>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k)
      qp[r * K + k] = g_act16 ? 256 * raw[r * xs + k] + raw[r * xs + K + k] : raw[r * xs + k];
  return {q, d, s};
}

// ---------------------------------------------------------------------------------------------------
// 2. paged decode attention
// ---------------------------------------------------------------------------------------------------
enum KVKind : int64_t { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_I8 = 3, KV_FP8 = 4 };

inline float fp8e4m3_to_float(uint8_t b) {
  // e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities (0x7F/0xFF are NaN)
  if ((b & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return (b & 0x80) ? -v : v;
}

inline float load_scalar(const void* base, int64_t idx, int64_t kind) {
  switch (kind) {
    case KV_F32: return static_cast<const float*>(base)[idx];
    case KV_BF16: return static_cast<float>(static_cast<const c10::BFloat16*>(base)[idx]);
    case KV_F16: return half_to_float(static_cast<const uint16_t*>(base)[idx]);
    case KV_I8: return static_cast<float>(static_cast<const int8_t*>(base)[idx]);
    default: return fp8e4m3_to_float(static_cast<const uint8_t*>(base)[idx]);
  }
}

struct AttnArgs {
  const float* q;      // (B, H, D), pre-scaled by the softmax scale
  const void* k;       // (NB, BS, KVH, D)
  const void* v;
  const uint16_t* ks;  // (NB, BS, KVH) float16 or null
  const uint16_t* vs;
  const int64_t* bt;   // (B, W)
  const int64_t* ctx;  // (B,)
  int64_t kind, H, KVH, D, BS, W, G;
};

struct WorkItem {
  int64_t b, blk0, blk1;  // batch row, block range [blk0, blk1) of its table (every KV head)
};

// One work item, portable code: writes the unnormalized output (G, D), the running max (G) and sum (G).
void attn_item_generic(const AttnArgs& a, const WorkItem& it, float* o, float* mx, float* sm) {
  const int64_t G = a.G, D = a.D, H = a.H;
  std::vector<float> kf(D), vf(D);
  for (int64_t i = 0; i < H; ++i) {
    mx[i] = -std::numeric_limits<float>::infinity();
    sm[i] = 0.f;
  }
  for (int64_t i = 0; i < H * D; ++i) o[i] = 0.f;
  const int64_t len = a.ctx[it.b];
  for (int64_t blk = it.blk0; blk < it.blk1; ++blk) {
    const int64_t bid = a.bt[it.b * a.W + blk];
    const int64_t n = std::min<int64_t>(a.BS, len - blk * a.BS);
    for (int64_t h = 0; h < a.KVH; ++h) {
      const float* qb = a.q + (it.b * H + h * G) * D;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t row = (bid * a.BS + t) * a.KVH + h;  // token slot, KV head
        const float kscale = a.ks ? half_to_float(a.ks[row]) : 1.f;
        const float vscale = a.vs ? half_to_float(a.vs[row]) : 1.f;
        for (int64_t d = 0; d < D; ++d) {
          kf[d] = load_scalar(a.k, row * D + d, a.kind) * kscale;
          vf[d] = load_scalar(a.v, row * D + d, a.kind) * vscale;
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t hq = h * G + g;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qb[g * D + d] * kf[d];
          const float mnew = std::max(mx[hq], dot);
          const float alpha = std::exp(mx[hq] - mnew);  // exp(-inf) = 0 on the first token
          const float p = std::exp(dot - mnew);
          sm[hq] = sm[hq] * alpha + p;
          for (int64_t d = 0; d < D; ++d) o[hq * D + d] = o[hq * D + d] * alpha + p * vf[d];
          mx[hq] = mnew;
        }
      }
    }
  }
}

// exp of 16 floats (Cephes-style: range reduction by ln 2, degree-6 polynomial, scalef); relative error ~2 ulp.
KVK_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, fx);
}

// 16 elements of a K/V row as float32 (before the per-token scale).
KVK_AVX512 inline __m512 load16(const void* base, int64_t idx, int64_t kind) {
  switch (kind) {
    case KV_F32: return _mm512_loadu_ps(static_cast<const float*>(base) + idx);
    case KV_BF16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + idx));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case KV_F16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + idx)));
    case KV_I8:
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + idx))));
    default: {  // fp8 e4m3fn: exponent/mantissa moved into float32 position, then scaled by 2^(127-7)
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + idx)));
      const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20);
      __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
      const __m512i sgn = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
      return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sgn));
    }
  }
}

// Sums of 16 vectors: lane i of the result = the sum of a[i]'s 16 lanes (a tree of 2-input permutes and adds,
// 45 instructions instead of 16 horizontal reductions).
KVK_AVX512 inline __m512 transpose_reduce16(const __m512* a) {
  const __m512i l1 = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i h1 = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
  const __m512i l2 = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i h2 = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512i l3 = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i h3 = _mm512_set_epi32(31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2);
  const __m512i l4 = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i h4 = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  __m512 c[8], d[4], e[2];
  for (int k = 0; k < 8; ++k)
    c[k] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * k], l1, a[2 * k + 1]),
                         _mm512_permutex2var_ps(a[2 * k], h1, a[2 * k + 1]));
  for (int k = 0; k < 4; ++k)
    d[k] = _mm512_add_ps(_mm512_permutex2var_ps(c[2 * k], l2, c[2 * k + 1]),
                         _mm512_permutex2var_ps(c[2 * k], h2, c[2 * k + 1]));
  for (int k = 0; k < 2; ++k)
    e[k] = _mm512_add_ps(_mm512_permutex2var_ps(d[2 * k], l3, d[2 * k + 1]),
                         _mm512_permutex2var_ps(d[2 * k], h3, d[2 * k + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(e[0], l4, e[1]), _mm512_permutex2var_ps(e[0], h4, e[1]));
}

constexpr int MAXG = 16;   // query heads per KV head

constexpr int MAXDV = 16;  // head_dim / 16
constexpr int TCH = 16;    // tokens per score chunk

// One block (n tokens from slot bid * BS) of one KV head h for the G query heads of its group, continuing the
// online softmax held in (o, m, l): o (G, D) unnormalized outputs, m and l (G) running maxima and sums.
// KIND is the storage format (a template argument: no per-element branch); quantized formats apply their per-token
// scales to the 16 scores and to the 16 probabilities of a chunk instead of to every element.
template <int DV, int KIND, bool QUANT>
KVK_AVX512 void attn_block_head_avx512(const AttnArgs& a, const float* qh, int64_t h, int64_t bid, int64_t n,
                                       float* o, float* m, float* l) {
  const int64_t G = a.G, KVH = a.KVH, BS = a.BS;
  constexpr int64_t D = 16 * DV;
  alignas(64) float p[MAXG][TCH];
  alignas(64) float ksc[TCH], vsc[TCH];
  __m512 qv[MAXG][DV];
  for (int64_t g = 0; g < G; ++g)
    for (int dv = 0; dv < DV; ++dv) qv[g][dv] = _mm512_loadu_ps(qh + g * D + 16 * dv);
  for (int64_t t0 = 0; t0 < n; t0 += TCH) {
    const int nt = static_cast<int>(std::min<int64_t>(TCH, n - t0));
    if (QUANT) {
      for (int t = 0; t < TCH; ++t) {
        const int64_t row = (bid * BS + t0 + std::min(t, nt - 1)) * KVH + h;
        ksc[t] = half_to_float(a.ks[row]);
        vsc[t] = half_to_float(a.vs[row]);
      }
    }
    // scores: per token and head a vector of partial products, summed across lanes 16 tokens at a time
    __m512 part[MAXG][TCH];
    for (int t = 0; t < nt; ++t) {
      const int64_t row = (bid * BS + t0 + t) * KVH + h;
      __m512 kf[DV];
      for (int dv = 0; dv < DV; ++dv) kf[dv] = load16(a.k, row * D + 16 * dv, KIND);
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kf[0]);
        for (int dv = 1; dv < DV; ++dv) acc = _mm512_fmadd_ps(qv[g][dv], kf[dv], acc);
        part[g][t] = acc;
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << nt) - 1u);
    __m512 ov[MAXG][DV];
    for (int64_t g = 0; g < G; ++g) {
      for (int t = nt; t < TCH; ++t) part[g][t] = _mm512_setzero_ps();
      __m512 sv = transpose_reduce16(part[g]);
      if (QUANT) sv = _mm512_mul_ps(sv, _mm512_load_ps(ksc));
      sv = _mm512_maskz_mov_ps(valid, sv);
      const float cmax = _mm512_mask_reduce_max_ps(valid, sv);
      const float mnew = std::max(m[g], cmax);
      const float alpha = std::exp(m[g] - mnew);  // 0 on the first token (m = -inf)
      const __m512 pv = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
      _mm512_store_ps(p[g], QUANT ? _mm512_mul_ps(pv, _mm512_load_ps(vsc)) : pv);
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(pv);
      m[g] = mnew;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int dv = 0; dv < DV; ++dv) ov[g][dv] = _mm512_mul_ps(_mm512_loadu_ps(o + g * D + 16 * dv), av);
    }
    for (int t = 0; t < nt; ++t) {
      const int64_t row = (bid * BS + t0 + t) * KVH + h;
      __m512 vf[DV];
      for (int dv = 0; dv < DV; ++dv) vf[dv] = load16(a.v, row * D + 16 * dv, KIND);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 pt = _mm512_set1_ps(p[g][t]);
        for (int dv = 0; dv < DV; ++dv) ov[g][dv] = _mm512_fmadd_ps(pt, vf[dv], ov[g][dv]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(o + g * D + 16 * dv, ov[g][dv]);
  }
}

// A work item: every KV head of row it.b over its blocks [blk0, blk1), block by block (all heads of a block
// before the next block).  Writes o (H, D) unnormalized, mx and sm (H).
template <int DV, int KIND>
KVK_AVX512 void attn_item_avx512(const AttnArgs& a, const WorkItem& it, float* o, float* mx, float* sm) {
  constexpr int64_t D = 16 * DV;
  constexpr bool QUANT = KIND == KV_I8 || KIND == KV_FP8;
  const int64_t H = a.H, G = a.G;
  for (int64_t i = 0; i < H * D; ++i) o[i] = 0.f;
  for (int64_t i = 0; i < H; ++i) {
    mx[i] = -std::numeric_limits<float>::infinity();
    sm[i] = 0.f;
  }
  const float* qb = a.q + it.b * H * D;
  const int64_t len = a.ctx[it.b];
  constexpr int64_t ebytes = KIND == KV_F32 ? 4 : (KIND == KV_BF16 || KIND == KV_F16) ? 2 : 1;
  const int64_t block_bytes = a.BS * a.KVH * D * ebytes;
  for (int64_t blk = it.blk0; blk < it.blk1; ++blk) {
    const int64_t bid = a.bt[it.b * a.W + blk];
    const int64_t n = std::min<int64_t>(a.BS, len - blk * a.BS);
    // The heads of a token are interleaved in a block ((block_size, kv_heads, head_dim) rows), so the per-head
    // passes below read it out of order; requesting the next block's K and V lines in address order meanwhile
    // keeps the memory streams sequential (measured, 30 layers of 7,000 tokens, blocks in shuffled order: fp32
    // 19 -> 16 ms, int8 13 -> 10 ms; copying each block to float32 buffers first gained under 7%: not kept).
    if (blk + 1 < it.blk1) {
      const int64_t nb = a.bt[it.b * a.W + blk + 1];
      const char* kn = static_cast<const char*>(a.k) + nb * block_bytes;
      const char* vn = static_cast<const char*>(a.v) + nb * block_bytes;
      for (int64_t off = 0; off < block_bytes; off += 64) {
        _mm_prefetch(kn + off, _MM_HINT_T0);
        _mm_prefetch(vn + off, _MM_HINT_T0);
      }
    }
    for (int64_t h = 0; h < a.KVH; ++h)
      attn_block_head_avx512<DV, KIND, QUANT>(a, qb + h * G * D, h, bid, n, o + h * G * D, mx + h * G, sm + h * G);
  }
}

template <int DV>
KVK_AVX512 void attn_item_avx512_kind(const AttnArgs& a, const WorkItem& it, float* o, float* mx, float* sm) {
  switch (a.kind) {
    case KV_F32: attn_item_avx512<DV, KV_F32>(a, it, o, mx, sm); break;
    case KV_BF16: attn_item_avx512<DV, KV_BF16>(a, it, o, mx, sm); break;
    case KV_F16: attn_item_avx512<DV, KV_F16>(a, it, o, mx, sm); break;
    case KV_I8: attn_item_avx512<DV, KV_I8>(a, it, o, mx, sm); break;
    default: attn_item_avx512<DV, KV_FP8>(a, it, o, mx, sm); break;
  }
}

KVK_AVX512 void attn_item_avx512_dispatch(const AttnArgs& a, const WorkItem& it, float* o, float* mx, float* sm) {
  switch (a.D / 16) {
    case 2: attn_item_avx512_kind<2>(a, it, o, mx, sm); break;
    case 4: attn_item_avx512_kind<4>(a, it, o, mx, sm); break;
    case 8: attn_item_avx512_kind<8>(a, it, o, mx, sm); break;
    default: attn_item_avx512_kind<16>(a, it, o, mx, sm); break;  // D = 256; other sizes take the generic path
  }
}

struct AttnScratch {
  std::vector<WorkItem> items;
  std::vector<int64_t> first;
  std::vector<float> po, pm, ps;
};

// Decode attention of B sequences (a.q pre-scaled) into out (B, H, D) float32.
void attention_raw(const AttnArgs& a, int64_t B, int64_t split_blocks, float* out) {
  thread_local AttnScratch s;
  const int64_t D = a.D, H = a.H, BS = a.BS;
  s.items.clear();
  s.first.assign(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    s.first[b] = static_cast<int64_t>(s.items.size());
    const int64_t nblocks = (a.ctx[b] + BS - 1) / BS;
    for (int64_t s0 = 0; s0 < nblocks; s0 += split_blocks)
      s.items.push_back({b, s0, std::min(nblocks, s0 + split_blocks)});
  }
  s.first[B] = static_cast<int64_t>(s.items.size());
  const int64_t NI = static_cast<int64_t>(s.items.size());
  s.po.resize(NI * H * D);
  s.pm.resize(NI * H);
  s.ps.resize(NI * H);
  const bool fast = use_avx512() && (D == 32 || D == 64 || D == 128 || D == 256) && a.G <= MAXG;
  const WorkItem* items = s.items.data();
  float *po = s.po.data(), *pm = s.pm.data(), *ps = s.ps.data();
  at::parallel_for(0, NI, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (fast)
        attn_item_avx512_dispatch(a, items[i], po + i * H * D, pm + i * H, ps + i * H);
      else
        attn_item_generic(a, items[i], po + i * H * D, pm + i * H, ps + i * H);
    }
  });
  std::fill(out, out + B * H * D, 0.f);
  // combine the splits of each query head of each row
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hq = 0; hq < H; ++hq) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t i = s.first[b]; i < s.first[b + 1]; ++i) M = std::max(M, pm[i * H + hq]);
      if (M == -std::numeric_limits<float>::infinity()) continue;  // empty context: zeros
      float L = 0.f;
      float* dst = out + (b * H + hq) * D;
      for (int64_t i = s.first[b]; i < s.first[b + 1]; ++i) {
        const float w = std::exp(pm[i * H + hq] - M);
        L += ps[i * H + hq] * w;
        const float* src = po + (i * H + hq) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += w * src[d];
      }
      const float inv = 1.f / L;
      for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
    }
  }
}

// q (B, H, D) float32; k, v (NB, BS, KVH, D) in the storage dtype (float8 passed as its uint8 bytes with
// kind = 4); k_scale, v_scale (NB, BS, KVH) float16 for int8/fp8, else empty; block_tables (B, W) int64;
// context_lens (B,) int64; split_blocks: blocks per work item.  Returns (B, H, D) float32.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                               const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                               int64_t kind, int64_t split_blocks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "decode_attention: q must be (B, H, D) float32");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes(),
              "decode_attention: k and v must be contiguous (blocks, block_size, kv_heads, head_dim) tensors");
  TORCH_CHECK(kind >= 0 && kind <= 4, "decode_attention: unknown KV kind ", kind);
  const at::ScalarType want[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kChar, at::kByte};
  TORCH_CHECK(k.scalar_type() == want[kind] && v.scalar_type() == want[kind],
              "decode_attention: KV dtype ", k.scalar_type(), " does not match kind ", kind);
  const bool quant = kind == KV_I8 || kind == KV_FP8;
  if (quant)
    TORCH_CHECK(k_scale.defined() && k_scale.numel() == k.numel() / k.size(3) && k_scale.scalar_type() == at::kHalf &&
                    k_scale.is_contiguous() && v_scale.is_contiguous() && v_scale.sizes() == k_scale.sizes() &&
                    v_scale.scalar_type() == at::kHalf,
                "decode_attention: int8/fp8 KV needs contiguous float16 scales (blocks, block_size, kv_heads)");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && context_lens.dim() == 1 &&
                  context_lens.scalar_type() == at::kLong && block_tables.size(0) == q.size(0) &&
                  context_lens.size(0) == q.size(0),
              "decode_attention: block_tables (B, W) and context_lens (B,) must be int64 with B = q.size(0)");
  TORCH_CHECK(split_blocks >= 1, "decode_attention: split_blocks must be >= 1");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k.size(1), KVH = k.size(2);
  TORCH_CHECK(k.size(3) == D && H % KVH == 0, "decode_attention: head_dim or head counts do not match");
  const int64_t G = H / KVH;
  const auto qs = (q.contiguous() * scale).contiguous();
  const auto bt = block_tables.contiguous();
  const auto ctx = context_lens.contiguous();
  const int64_t W = bt.size(1);
  const int64_t* ctxp = ctx.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(ctxp[b] >= 0 && ctxp[b] <= W * BS, "decode_attention: context length ", ctxp[b], " of row ", b,
                " exceeds its block table (", W, " blocks of ", BS, ")");
  AttnArgs a{qs.data_ptr<float>(), k.data_ptr(), v.data_ptr(),
             quant ? reinterpret_cast<const uint16_t*>(k_scale.data_ptr<at::Half>()) : nullptr,
             quant ? reinterpret_cast<const uint16_t*>(v_scale.data_ptr<at::Half>()) : nullptr,
             bt.data_ptr<int64_t>(), ctxp, kind, H, KVH, D, BS, W, G};
  auto out = torch::empty({B, H, D}, q.options());
  attention_raw(a, B, split_blocks, out.data_ptr<float>());
  return out;
}

// ---------------------------------------------------------------------------------------------------
// 2b. paged prefill ("extend") attention: several new tokens of a sequence over its cached plus new K/V, causal,
//     read from the blocks in place.  FlashAttention-2 style tiling (Dao, 2023) laid out for AVX-512: a tile is
//     16 consecutive query tokens of one sequence and all G query heads of one KV head; scores are kept
//     transposed (one 16-lane vector over the tile's queries per key), so the softmax's maxima and sums are
//     vertical operations, and every key and value element is broadcast once for the G heads.
// ---------------------------------------------------------------------------------------------------
struct ExtendItem {
  int64_t span, h, i0;  // sequence span, KV head, first query of the tile (index within the span)
};

struct ExtendArgs {
  const float* q;       // (T, H, D) float32, not scaled
  float* out;           // (T, H, D) float32
  const void* k;        // (NB, BS, KVH, D)
  const void* v;
  const uint16_t* ks;   // (NB, BS, KVH) float16 or null
  const uint16_t* vs;
  const int64_t* starts;    // (S,) first packed token of each span
  const int64_t* qlens;     // (S,)
  const int64_t* ctxs;      // (S,) KV length after the step
  const int64_t* bt;        // (S, W) block tables
  int64_t W, kind, H, KVH, D, BS, G;
  float scale;
};

// Convert n tokens (from slot `slot0` on, within one block) of KV head h to float32 rows (n, D), scaled.
KVK_AVX512 inline void kv_rows_to_f32(const void* base, const uint16_t* scales, int64_t kind, int64_t slot0,
                                      int64_t n, int64_t KVH, int64_t h, int64_t D, float* dst) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = (slot0 + t) * KVH + h;
    const __m512 sc = _mm512_set1_ps(scales ? half_to_float(scales[row]) : 1.f);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(dst + t * D + d, _mm512_mul_ps(load16(base, row * D + d, kind), sc));
  }
}

template <int G_, int DV>
KVK_AVX512 void extend_item_avx512(const ExtendArgs& a, const ExtendItem& it) {
  constexpr int D = 16 * DV;
  const int64_t G = G_, H = a.H, KVH = a.KVH, BS = a.BS;
  const int64_t qlen = a.qlens[it.span], ctx = a.ctxs[it.span], start = a.starts[it.span];
  const int64_t nq = std::min<int64_t>(16, qlen - it.i0);      // queries in this tile
  const int64_t qpos0 = ctx - qlen + it.i0;                    // position of the tile's first query
  const int64_t kend = qpos0 + nq;                             // keys [0, kend) are visible to some query
  const __mmask16 qmask = static_cast<__mmask16>((1u << nq) - 1u);
  alignas(64) float Qt[G_][D][16];   // transposed, scaled queries
  alignas(64) float Ot[G_][D][16];   // transposed unnormalized outputs
  alignas(64) float Kf[16][D];
  alignas(64) float Vf[16][D];
  alignas(64) float P[G_][16][16];   // per head, per key: probabilities over the tile's queries
  for (int g = 0; g < G_; ++g) {
    for (int64_t j = 0; j < 16; ++j) {
      const float* src = a.q + ((start + it.i0 + std::min<int64_t>(j, nq - 1)) * H + it.h * G + g) * D;
      for (int d = 0; d < D; ++d) Qt[g][d][j] = src[d] * a.scale;
    }
    for (int d = 0; d < D; ++d) _mm512_store_ps(Ot[g][d], _mm512_setzero_ps());
  }
  __m512 m[G_], l[G_];
  for (int g = 0; g < G_; ++g) {
    m[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[g] = _mm512_setzero_ps();
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i qposv = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(qpos0)), lane);
  const int64_t* bt = a.bt + it.span * a.W;
  for (int64_t k0 = 0; k0 < kend; k0 += 16) {
    // 16 keys (or fewer) from one or two blocks
    const int64_t n = std::min<int64_t>(16, kend - k0);
    for (int64_t t = 0; t < n;) {
      const int64_t pos = k0 + t, blk = pos / BS, off = pos % BS;
      const int64_t take = std::min<int64_t>(n - t, BS - off);
      const int64_t slot = bt[blk] * BS + off;
      kv_rows_to_f32(a.k, a.ks, a.kind, slot, take, KVH, it.h, D, &Kf[t][0]);
      kv_rows_to_f32(a.v, a.vs, a.kind, slot, take, KVH, it.h, D, &Vf[t][0]);
      t += take;
    }
    // scores, transposed: S[g][t] = sum_d Qt[g][d] * K[t][d]
    __m512 S[G_][16];
    for (int64_t t = 0; t < n; t += 4) {
      const int nk = static_cast<int>(std::min<int64_t>(4, n - t));
      __m512 acc[G_][4];
      for (int g = 0; g < G_; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        __m512 qv[G_];
        for (int g = 0; g < G_; ++g) qv[g] = _mm512_load_ps(Qt[g][d]);
        for (int c = 0; c < 4; ++c) {
          if (c >= nk) break;
          const __m512 kb = _mm512_set1_ps(Kf[t + c][d]);
          for (int g = 0; g < G_; ++g) acc[g][c] = _mm512_fmadd_ps(qv[g], kb, acc[g][c]);
        }
      }
      for (int c = 0; c < nk; ++c)
        for (int g = 0; g < G_; ++g) S[g][t + c] = acc[g][c];
    }
    // causal mask (a key at position p is visible to queries at positions >= p) and padding lanes
    const bool diag = k0 + n - 1 > qpos0;
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; ++t) {
      __mmask16 vis = qmask;
      if (diag) vis &= _mm512_cmpge_epi32_mask(qposv, _mm512_set1_epi32(static_cast<int>(k0 + t)));
      for (int g = 0; g < G_; ++g) S[g][t] = _mm512_mask_mov_ps(ninf, vis, S[g][t]);
    }
    // online softmax, per query lane
    for (int g = 0; g < G_; ++g) {
      __m512 bm = S[g][0];
      for (int64_t t = 1; t < n; ++t) bm = _mm512_max_ps(bm, S[g][t]);
      const __m512 mnew = _mm512_max_ps(m[g], bm);
      // lanes that saw no key yet keep -inf: use 0 there so that exp() gives 0 (not NaN)
      const __mmask16 live = _mm512_cmp_ps_mask(mnew, ninf, _CMP_NEQ_OQ);
      const __m512 msafe = _mm512_mask_mov_ps(_mm512_setzero_ps(), live, mnew);
      const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m[g], ninf, _CMP_NEQ_OQ),
                                               exp512(_mm512_sub_ps(m[g], msafe)));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        const __mmask16 vis = _mm512_cmp_ps_mask(S[g][t], ninf, _CMP_NEQ_OQ);
        const __m512 p = _mm512_maskz_mov_ps(vis, exp512(_mm512_sub_ps(S[g][t], msafe)));
        _mm512_store_ps(P[g][t], p);
        sum = _mm512_add_ps(sum, p);
      }
      l[g] = _mm512_add_ps(_mm512_mul_ps(l[g], alpha), sum);
      m[g] = mnew;
      for (int d = 0; d < D; ++d) _mm512_store_ps(Ot[g][d], _mm512_mul_ps(_mm512_load_ps(Ot[g][d]), alpha));
    }
    // O[g][d] += sum_t P[g][t] * V[t][d], eight dims at a time
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m512 o[G_][8];
      for (int g = 0; g < G_; ++g)
        for (int dd = 0; dd < 8; ++dd) o[g][dd] = _mm512_load_ps(Ot[g][d0 + dd]);
      for (int64_t t = 0; t < n; ++t) {
        __m512 pv[G_];
        for (int g = 0; g < G_; ++g) pv[g] = _mm512_load_ps(P[g][t]);
        for (int dd = 0; dd < 8; ++dd) {
          const __m512 vb = _mm512_set1_ps(Vf[t][d0 + dd]);
          for (int g = 0; g < G_; ++g) o[g][dd] = _mm512_fmadd_ps(pv[g], vb, o[g][dd]);
        }
      }
      for (int g = 0; g < G_; ++g)
        for (int dd = 0; dd < 8; ++dd) _mm512_store_ps(Ot[g][d0 + dd], o[g][dd]);
    }
  }
  // normalize and write the tile's rows back
  for (int g = 0; g < G_; ++g) {
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[g]));
    for (int64_t j = 0; j < nq; ++j) {
      float* dst = a.out + ((start + it.i0 + j) * H + it.h * G + g) * D;
      for (int d = 0; d < D; ++d) dst[d] = Ot[g][d][j] * inv[j];
    }
  }
}

// Portable version: one query at a time, online softmax over its visible keys.
void extend_item_generic(const ExtendArgs& a, const ExtendItem& it) {
  const int64_t G = a.G, D = a.D, H = a.H, BS = a.BS;
  const int64_t qlen = a.qlens[it.span], ctx = a.ctxs[it.span], start = a.starts[it.span];
  const int64_t nq = std::min<int64_t>(16, qlen - it.i0);
  const int64_t* bt = a.bt + it.span * a.W;
  std::vector<float> kf(D), vf(D), o(D);
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t qpos = ctx - qlen + it.i0 + j;
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = a.q + ((start + it.i0 + j) * H + it.h * G + g) * D;
      float mx = -std::numeric_limits<float>::infinity(), sm = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t p = 0; p <= qpos; ++p) {
        const int64_t row = (bt[p / BS] * BS + p % BS) * a.KVH + it.h;
        const float kscale = a.ks ? half_to_float(a.ks[row]) : 1.f;
        const float vscale = a.vs ? half_to_float(a.vs[row]) : 1.f;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * a.scale * (load_scalar(a.k, row * D + d, a.kind) * kscale);
        const float mnew = std::max(mx, dot);
        const float alpha = std::exp(mx - mnew), pw = std::exp(dot - mnew);
        sm = sm * alpha + pw;
        for (int64_t d = 0; d < D; ++d) o[d] = o[d] * alpha + pw * (load_scalar(a.v, row * D + d, a.kind) * vscale);
        mx = mnew;
      }
      float* dst = a.out + ((start + it.i0 + j) * H + it.h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = o[d] / sm;
    }
  }
}

KVK_AVX512 void extend_item_avx512_dispatch(const ExtendArgs& a, const ExtendItem& it) {
#define KVK_EXT_CASE(GG, DDV) if (a.G == GG && a.D == 16 * DDV) return extend_item_avx512<GG, DDV>(a, it);
  KVK_EXT_CASE(1, 4) KVK_EXT_CASE(2, 4) KVK_EXT_CASE(3, 4) KVK_EXT_CASE(4, 4)
  KVK_EXT_CASE(1, 8) KVK_EXT_CASE(2, 8) KVK_EXT_CASE(4, 8) KVK_EXT_CASE(8, 8)
  KVK_EXT_CASE(1, 2) KVK_EXT_CASE(2, 2) KVK_EXT_CASE(4, 2) KVK_EXT_CASE(5, 4) KVK_EXT_CASE(6, 4)
#undef KVK_EXT_CASE
  extend_item_generic(a, it);
}

inline bool extend_fast(int64_t G, int64_t D) {
  const int combos[][2] = {{1, 64}, {2, 64}, {3, 64}, {4, 64}, {1, 128}, {2, 128}, {4, 128}, {8, 128},
                           {1, 32}, {2, 32}, {4, 32}, {5, 64}, {6, 64}};
  for (auto& c : combos)
    if (G == c[0] && D == c[1]) return true;
  return false;
}

// q (T, H, D) float32 (packed tokens of every span); spans: starts, q_lens, context_lens (S,) int64 and
// block_tables (S, W) int64; KV as in decode_attention.  Returns (T, H, D) float32 with the spans' rows filled
// (rows outside every span are left as zeros).
torch::Tensor extend_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& k_scale, const torch::Tensor& v_scale, const torch::Tensor& starts,
                               const torch::Tensor& q_lens, const torch::Tensor& context_lens,
                               const torch::Tensor& block_tables, double scale, int64_t kind) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "extend_attention: q must be (T, H, D) float32");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes(),
              "extend_attention: k and v must be contiguous (blocks, block_size, kv_heads, head_dim) tensors");
  TORCH_CHECK(kind >= 0 && kind <= 4, "extend_attention: unknown KV kind ", kind);
  const at::ScalarType want[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kChar, at::kByte};
  TORCH_CHECK(k.scalar_type() == want[kind] && v.scalar_type() == want[kind], "extend_attention: KV dtype mismatch");
  const bool quant = kind == KV_I8 || kind == KV_FP8;
  if (quant)
    TORCH_CHECK(k_scale.defined() && k_scale.numel() == k.numel() / k.size(3) && k_scale.scalar_type() == at::kHalf &&
                    k_scale.is_contiguous() && v_scale.is_contiguous() && v_scale.sizes() == k_scale.sizes(),
                "extend_attention: int8/fp8 KV needs contiguous float16 scales");
  const int64_t S = starts.numel();
  TORCH_CHECK(starts.scalar_type() == at::kLong && q_lens.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
                  q_lens.numel() == S && context_lens.numel() == S && block_tables.dim() == 2 &&
                  block_tables.size(0) == S,
              "extend_attention: starts, q_lens, context_lens (S,) and block_tables (S, W) must be int64");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), BS = k.size(1), KVH = k.size(2);
  TORCH_CHECK(k.size(3) == D && H % KVH == 0, "extend_attention: head_dim or head counts do not match");
  const auto qc = q.contiguous();
  const auto st = starts.contiguous(), ql = q_lens.contiguous(), cl = context_lens.contiguous();
  const auto bt = block_tables.contiguous();
  const int64_t W = bt.size(1);
  const int64_t *stp = st.data_ptr<int64_t>(), *qlp = ql.data_ptr<int64_t>(), *clp = cl.data_ptr<int64_t>();
  std::vector<ExtendItem> items;
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(qlp[i] >= 1 && clp[i] >= qlp[i] && clp[i] <= W * BS && stp[i] >= 0 && stp[i] + qlp[i] <= T,
                "extend_attention: span ", i, " (start ", stp[i], ", ", qlp[i], " queries, context ", clp[i],
                ") does not fit q or its block table");
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t i0 = 0; i0 < qlp[i]; i0 += 16) items.push_back({i, h, i0});
  }
  auto out = torch::zeros({T, H, D}, q.options());
  ExtendArgs a{qc.data_ptr<float>(), out.data_ptr<float>(), k.data_ptr(), v.data_ptr(),
               quant ? reinterpret_cast<const uint16_t*>(k_scale.data_ptr<at::Half>()) : nullptr,
               quant ? reinterpret_cast<const uint16_t*>(v_scale.data_ptr<at::Half>()) : nullptr,
               stp, qlp, clp, bt.data_ptr<int64_t>(), W, kind, H, KVH, D, BS, H / KVH, static_cast<float>(scale)};
  const bool fast = use_avx512() && extend_fast(H / KVH, D);
  // dynamic scheduling: tiles late in a causal prompt see more keys
  std::atomic<int64_t> next{0};
  const int64_t NI = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < NI; i = next++) {
      if (fast)
        extend_item_avx512_dispatch(a, items[i]);
      else
        extend_item_generic(a, items[i]);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// 3. a whole decode step of a Llama-family model with packed weights, in one call
//    (x <- layer(x) for every layer; see kvkeeper.model.fused_decode for the contract)
// ---------------------------------------------------------------------------------------------------
// The element-wise parts of a layer.  The fused decode step and the layer-by-layer path of a model with packed
// weights (kvkeeper.model.llama, via rmsnorm / silu_mul / rope_qk below) call the same routines, so a decode
// token gets bit-identical results whichever path its step takes.  Rows are independent (no cross-row
// arithmetic): a row's result does not depend on the batch.

// RMSNorm (Zhang & Sennrich, 2019): y = x * (1 / sqrt(mean(x^2) + eps)) * w per row; the sum of squares in float64.
void rmsnorm_row(const float* xr, const float* w, int64_t N, float eps, float* y) {
  double ss = 0.0;
  for (int64_t i = 0; i < N; ++i) ss += static_cast<double>(xr[i]) * xr[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss / N) + eps);
  for (int64_t i = 0; i < N; ++i) y[i] = xr[i] * inv * w[i];
}

void rmsnorm_rows(const float* x, const float* w, int64_t M, int64_t N, float eps, float* y) {
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(N, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rmsnorm_row(x + r * N, w, N, eps, y + r * N);
  });
}

// RoPE, half-split layout (as kvkeeper.model.rope.apply_rope): x (heads, D) of one token, cos/sin (D).
__attribute__((optimize("fp-contract=off"))) void rope_heads(float* x, int64_t heads, int64_t D, const float* cs,
                                                            const float* sn) {
  const int64_t h2 = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * D;
    for (int64_t i = 0; i < h2; ++i) {
      const float a = xh[i], b = xh[i + h2];
      xh[i] = a * cs[i] - b * sn[i];
      xh[i + h2] = b * cs[i + h2] + a * sn[i + h2];
    }
  }
}

// SiLU(gate) * up of one row (gate = g[0:I], up = g[I:2I]): g * sigmoid(g) * u, sigmoid from exp(-g).
void silu_mul_row_generic(const float* g, int64_t I, float* o) {
  const float* u = g + I;
  for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}


KVK_AVX512 void silu_mul_row_avx512(const float* g, int64_t I, float* o) {
  const float* u = g + I;
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
  if (i < I) {
    const __mmask16 mk = static_cast<__mmask16>((1u << (I - i)) - 1u);
    const __m512 gv = _mm512_maskz_loadu_ps(mk, g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_mask_storeu_ps(o + i, mk, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)),
                                                   _mm512_maskz_loadu_ps(mk, u + i)));
  }
}

void silu_mul_rows(const float* g, int64_t M, int64_t I, float* o) {
  const bool fast = use_avx512();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (fast)
        silu_mul_row_avx512(g + r * 2 * I, I, o + r * I);
      else
        silu_mul_row_generic(g + r * 2 * I, I, o + r * I);
    }
  });
}

// Python-facing versions (the layer-by-layer path of packed models).
torch::Tensor rmsnorm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous() &&
                  x.size(-1) == w.size(0), "rmsnorm: x (..., N) and w (N,) must be float32");
  const auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t N = w.size(0);
  rmsnorm_rows(xc.data_ptr<float>(), w.data_ptr<float>(), xc.numel() / N, N, static_cast<float>(eps), y.data_ptr<float>());
  return y;
}

torch::Tensor silu_mul(const torch::Tensor& gu) {
  TORCH_CHECK(gu.scalar_type() == at::kFloat && gu.dim() == 2 && gu.size(1) % 2 == 0,
              "silu_mul: gate_up must be (M, 2I) float32");
  const auto gc = gu.contiguous();
  const int64_t M = gc.size(0), I = gc.size(1) / 2;
  auto o = torch::empty({M, I}, gc.options());
  silu_mul_rows(gc.data_ptr<float>(), M, I, o.data_ptr<float>());
  return o;
}

// In place on the first `heads` heads of each row of qkv (T, >= heads * D): q heads then k heads.
void rope_qk(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
             int64_t D) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) >= heads * D,
              "rope_qk: qkv must be contiguous float32 (T, >= heads * head_dim)");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rope_qk: cos and sin must be contiguous float32 (T, head_dim)");
  float* p = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t stride = qkv.size(1);
  for (int64_t t = 0; t < T; ++t) rope_heads(p + t * stride, heads, D, c + t * D, s + t * D);
}

// Store one token's K or V (KVH, D) at a slot, as kvkeeper.kvcache.quant.PagedKV.write does (same rounding:
// scale = float16(max(max|x| / qmax, 2^-14)), q = x / scale rounded half to even (int8) or cast (fp8 e4m3)).
void store_token(const float* x, int64_t KVH, int64_t D, void* data, uint16_t* scales, int64_t slot, int64_t kind) {
  const int64_t base = slot * KVH * D;
  for (int64_t h = 0; h < KVH; ++h) {
    const float* xh = x + h * D;
    const int64_t o = base + h * D;
    switch (kind) {
      case KV_F32: std::memcpy(static_cast<float*>(data) + o, xh, D * sizeof(float)); break;
      case KV_BF16:
        for (int64_t i = 0; i < D; ++i) static_cast<c10::BFloat16*>(data)[o + i] = c10::BFloat16(xh[i]);
        break;
      case KV_F16:
        for (int64_t i = 0; i < D; ++i) static_cast<c10::Half*>(data)[o + i] = c10::Half(xh[i]);
        break;
      default: {
        const float qmax = kind == KV_I8 ? 127.f : 448.f;
        float amax = 0.f;
        for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(xh[i]));
        const c10::Half sc(std::max(amax / qmax, 6.103515625e-05f));
        const float scf = static_cast<float>(sc);
        scales[slot * KVH + h] = sc.x;
        for (int64_t i = 0; i < D; ++i) {
          const float y = std::min(std::max(xh[i] / scf, -qmax), qmax);
          if (kind == KV_I8)
            static_cast<int8_t*>(data)[o + i] = static_cast<int8_t>(std::nearbyint(y));
          else
            static_cast<c10::Float8_e4m3fn*>(data)[o + i] = c10::Float8_e4m3fn(y);
        }
      }
    }
  }
}

struct DecodeLayer {
  torch::Tensor ln1, ln2, qkv_bias;                       // (hidden,), (hidden,), (qkv_out,) or undefined
  torch::Tensor qkv_qs, qkv_sc, o_qs, o_sc, gu_qs, gu_sc, dn_qs, dn_sc;
  int64_t qkv_bits, o_bits, gu_bits, dn_bits;
  torch::Tensor k, v, ks, vs;                             // this layer's paged cache (ks, vs undefined unless quantized)
};

class DecodeModel {
 public:
  DecodeModel(int64_t hidden, int64_t inter, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
              int64_t kind)
      : hidden_(hidden), inter_(inter), H_(heads), KVH_(kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
        kind_(kind) {
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0 && kind >= 0 && kind <= 4, "DecodeModel: bad shapes");
  }

  void add_layer(const torch::Tensor& ln1, const torch::Tensor& ln2, const torch::Tensor& qkv_bias,
                 const torch::Tensor& qkv_qs, const torch::Tensor& qkv_sc, int64_t qkv_bits,
                 const torch::Tensor& o_qs, const torch::Tensor& o_sc, int64_t o_bits,
                 const torch::Tensor& gu_qs, const torch::Tensor& gu_sc, int64_t gu_bits,
                 const torch::Tensor& dn_qs, const torch::Tensor& dn_sc, int64_t dn_bits,
                 const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& ks, const torch::Tensor& vs) {
    const int64_t qkv_n = (H_ + 2 * KVH_) * D_;
    // shape checks happen here, once, so that step() can use raw pointers
    make_qw(qkv_qs, qkv_sc, qkv_bits, qkv_n);
    make_qw(o_qs, o_sc, o_bits, hidden_);
    make_qw(gu_qs, gu_sc, gu_bits, 2 * inter_);
    make_qw(dn_qs, dn_sc, dn_bits, hidden_);
    TORCH_CHECK(qkv_qs.size(1) * QK == hidden_ && o_qs.size(1) * QK == H_ * D_ && gu_qs.size(1) * QK == hidden_ &&
                    dn_qs.size(1) * QK == inter_, "DecodeModel: weight input sizes do not match the model");
    TORCH_CHECK(ln1.scalar_type() == at::kFloat && ln1.numel() == hidden_ && ln1.is_contiguous() &&
                    ln2.scalar_type() == at::kFloat && ln2.numel() == hidden_ && ln2.is_contiguous(),
                "DecodeModel: norms must be contiguous float32 (hidden,)");
    TORCH_CHECK(!qkv_bias.defined() || qkv_bias.numel() == 0 ||
                    (qkv_bias.numel() == qkv_n && qkv_bias.scalar_type() == at::kFloat && qkv_bias.is_contiguous()),
                "DecodeModel: qkv bias must be float32 (q+k+v outputs,)");
    const at::ScalarType want[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kChar, at::kByte};
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.dim() == 4 && k.sizes() == v.sizes() &&
                    k.size(2) == KVH_ && k.size(3) == D_ && k.scalar_type() == want[kind_] &&
                    v.scalar_type() == want[kind_], "DecodeModel: KV cache shape or dtype does not match");
    if (kind_ == KV_I8 || kind_ == KV_FP8)
      TORCH_CHECK(ks.defined() && ks.scalar_type() == at::kHalf && ks.is_contiguous() && vs.is_contiguous() &&
                      ks.numel() == k.numel() / D_ && vs.sizes() == ks.sizes(),
                  "DecodeModel: quantized KV needs float16 scales (blocks, block_size, kv_heads)");
    layers_.push_back({ln1, ln2, qkv_bias.defined() && qkv_bias.numel() ? qkv_bias : torch::Tensor(), qkv_qs, qkv_sc,
                       o_qs, o_sc, gu_qs, gu_sc, dn_qs, dn_sc, qkv_bits, o_bits, gu_bits, dn_bits, k, v, ks, vs});
  }

  // x (B, hidden) float32, updated in place: every layer applied to one new token per sequence.
  // cos, sin (B, D) float32 for the tokens' positions; slots (B,) int64; block_tables (B, W) int64;
  // context_lens (B,) int64 (including the new token).
  void step(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
            const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, int64_t split_blocks) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "DecodeModel.step: x must be contiguous float32 (B, hidden)");
    const int64_t B = x.size(0);
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat && cos.numel() == B * D_ && sin.numel() == B * D_,
                "DecodeModel.step: cos and sin must be contiguous float32 (B, head_dim)");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B && block_tables.scalar_type() == at::kLong &&
                    block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.is_contiguous() &&
                    context_lens.scalar_type() == at::kLong && context_lens.numel() == B &&
                    context_lens.is_contiguous() && slots.is_contiguous(),
                "DecodeModel.step: slots (B,), block_tables (B, W), context_lens (B,) int64 contiguous");
    if (layers_.empty() || B == 0) return;
    const int64_t BS = layers_[0].k.size(1), W = block_tables.size(1), NB = layers_[0].k.size(0);
    const int64_t* ctx = context_lens.data_ptr<int64_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ctx[b] >= 1 && ctx[b] <= W * BS, "DecodeModel.step: context length ", ctx[b], " of row ", b,
                  " outside its block table");
      TORCH_CHECK(sl[b] >= 0 && sl[b] < NB * BS, "DecodeModel.step: slot ", sl[b], " outside the cache");
    }
    const int64_t qn = H_ * D_, kvn = KVH_ * D_, qkv_n = qn + 2 * kvn;
    h_.resize(B * hidden_);
    qkv_.resize(B * qkv_n);
    att_.resize(B * qn);
    gu_.resize(B * 2 * inter_);
    act_.resize(B * inter_);
    y_.resize(B * hidden_);
    float* xp = x.data_ptr<float>();
    const float* cs = cos.data_ptr<float>();
    const float* sn = sin.data_ptr<float>();
    const float fscale = static_cast<float>(scale);
    for (const DecodeLayer& L : layers_) {
      rmsnorm_rows(xp, L.ln1.data_ptr<float>(), B, hidden_, eps_, h_.data());
      qmm_raw(h_.data(), B, make_qw(L.qkv_qs, L.qkv_sc, L.qkv_bits, qkv_n), qkv_.data());
      const bool quant = kind_ == KV_I8 || kind_ == KV_FP8;
      for (int64_t b = 0; b < B; ++b) {
        float* row = qkv_.data() + b * qkv_n;
        if (L.qkv_bias.defined()) {
          const float* bias = L.qkv_bias.data_ptr<float>();
          for (int64_t i = 0; i < qkv_n; ++i) row[i] += bias[i];
        }
        rope_heads(row, H_ + KVH_, D_, cs + b * D_, sn + b * D_);  // q and k heads are adjacent
        for (int64_t i = 0; i < qn; ++i) row[i] *= fscale;         // the softmax scale, folded into q
        store_token(row + qn, KVH_, D_, L.k.data_ptr(), quant ? reinterpret_cast<uint16_t*>(L.ks.data_ptr<at::Half>()) : nullptr,
                    sl[b], kind_);
        store_token(row + qn + kvn, KVH_, D_, L.v.data_ptr(), quant ? reinterpret_cast<uint16_t*>(L.vs.data_ptr<at::Half>()) : nullptr,
                    sl[b], kind_);
      }
      // attention reads q as (B, H, D): gather the q parts of the qkv rows
      qbuf_.resize(B * qn);
      for (int64_t b = 0; b < B; ++b) std::memcpy(qbuf_.data() + b * qn, qkv_.data() + b * qkv_n, qn * sizeof(float));
      AttnArgs a{qbuf_.data(), L.k.data_ptr(), L.v.data_ptr(),
                 quant ? reinterpret_cast<const uint16_t*>(L.ks.data_ptr<at::Half>()) : nullptr,
                 quant ? reinterpret_cast<const uint16_t*>(L.vs.data_ptr<at::Half>()) : nullptr,
                 block_tables.data_ptr<int64_t>(), ctx, kind_, H_, KVH_, D_, BS, W, H_ / KVH_};
      attention_raw(a, B, split_blocks, att_.data());
      qmm_raw(att_.data(), B, make_qw(L.o_qs, L.o_sc, L.o_bits, hidden_), y_.data());
      for (int64_t i = 0; i < B * hidden_; ++i) xp[i] += y_[i];
      rmsnorm_rows(xp, L.ln2.data_ptr<float>(), B, hidden_, eps_, h_.data());
      qmm_raw(h_.data(), B, make_qw(L.gu_qs, L.gu_sc, L.gu_bits, 2 * inter_), gu_.data());
      silu_mul_rows(gu_.data(), B, inter_, act_.data());  // SiLU(gate) * up
      qmm_raw(act_.data(), B, make_qw(L.dn_qs, L.dn_sc, L.dn_bits, hidden_), y_.data());
      for (int64_t i = 0; i < B * hidden_; ++i) xp[i] += y_[i];
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  int64_t hidden_, inter_, H_, KVH_, D_;
  float eps_;
  int64_t kind_;
  std::vector<DecodeLayer> layers_;
  std::vector<float> h_, qkv_, att_, qbuf_, gu_, act_, y_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvkeeper CPU kernels (see csrc/kvk_cpu.cpp)";
  m.def("isa", &isa, "the instruction set the kernels use now: avx512_vnni or generic");
  m.def("set_isa", &set_isa, "force the kernels' instruction set: auto, generic or avx512_vnni (tests)");
  m.def("cpu_has_avx512", &cpu_has_avx512, "whether this CPU has AVX-512 F/BW/VL/DQ + VNNI + F16C + FMA");
  m.def("qmm", &qmm, "y (M, N) float32 = x (M, K) float32 @ W^T over interleaved 4-/8-bit blocks",
        py::arg("x"), py::arg("qs"), py::arg("sc"), py::arg("bits"), py::arg("n"));
  m.def("quantize_activations", &quantize_activations, "x (M, K) float32 -> (codes int32 (M, K), dx, sx (M, K/32))");
  m.def("activation_bits", &activation_bits, "bits of the activation codes in qmm: 16 (default) or 8");
  m.def("set_activation_bits", &set_activation_bits, "16 (default) or 8: llama.cpp's Q8_1 precision (measurements)");
  m.def("extend_attention", &extend_attention, "paged causal attention of prefill spans, read in place",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_scale"), py::arg("v_scale"), py::arg("starts"),
        py::arg("q_lens"), py::arg("context_lens"), py::arg("block_tables"), py::arg("scale"), py::arg("kind"));
  m.def("rmsnorm", &rmsnorm, "RMSNorm of x (..., N) float32 by w (N,) (the fused step's routine)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of gate_up (M, 2I) float32 -> (M, I)");
  m.def("rope_qk", &rope_qk, "RoPE in place on the first heads of qkv (T, ...) float32, cos/sin (T, D)");
  m.def("decode_attention", &decode_attention, "paged decode attention read in place (see the file header)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("kind"), py::arg("split_blocks"));
  py::class_<DecodeModel>(m, "DecodeModel", "a whole decode step over packed weights (kvkeeper.model.fused_decode)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t>(), py::arg("hidden"),
           py::arg("inter"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("kind"))
      .def("add_layer", &DecodeModel::add_layer)
      .def("step", &DecodeModel::step, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("split_blocks"))
      .def("num_layers", &DecodeModel::num_layers);
}
