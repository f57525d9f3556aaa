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

#include <immintrin.h>

#include <algorithm>
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
// 1. activation quantization (Q8_1 style: per row and block of 32, int8 with scale and scaled sum)
// ---------------------------------------------------------------------------------------------------
constexpr int QK = 32;

void quantize_rows_generic(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / QK;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * QK;
      float amax = 0.f;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int i = 0; i < QK; ++i) {
        const int q = static_cast<int>(std::nearbyint(xb[i] * id));  // round half to even, as cvtps2dq
        xq[r * K + b * QK + i] = static_cast<int8_t>(q);
        sum += q;
      }
      dx[r * nb + b] = d;
      sx[r * nb + b] = d * static_cast<float>(sum);
    }
  }
}

KVK_AVX512 void quantize_rows_avx512(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / QK;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * QK;
      const __m512 a = _mm512_loadu_ps(xb);
      const __m512 c = _mm512_loadu_ps(xb + 16);
      const __m512 amaxv = _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, c));
      const float amax = _mm512_reduce_max_ps(amaxv);
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      const __m512 idv = _mm512_set1_ps(id);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, idv));  // MXCSR default: round half to even
      const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, idv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * K + b * QK), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * K + b * QK + 16), _mm512_cvtepi32_epi8(qc));
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
  for (int64_t r = 0; r < M; ++r) {
    float acc[16] = {0};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = qs + b * BYTES;
      const uint16_t* s = sc + b * 32;
      const int8_t* xb = xq + r * K + b * QK;
      for (int i = 0; i < 16; ++i) {
        int isum = 0;
        for (int k = 0; k < QK; ++k) isum += code_at<BITS>(blk, i, k) * static_cast<int>(xb[k]);
        const float dw = half_to_float(s[i]), mw = half_to_float(s[16 + i]);
        acc[i] = std::fma(static_cast<float>(isum), dw * dx[r * nb + b], acc[i]);
        acc[i] = std::fma(mw, sx[r * nb + b], acc[i]);
      }
    }
    for (int i = 0; i < rows; ++i) y[r * N + n0 + i] = acc[i];
  }
}

template <int BITS, int MT>
KVK_AVX512 inline void qmm_tile_avx512(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* xq,
                                       const float* dx, const float* sx, int64_t K, float* y, int64_t N,
                                       int64_t n0, __mmask16 mask) {
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
      const int32_t* xb = reinterpret_cast<const int32_t*>(xq + m * K + b * QK);
      __m512i is = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) is = _mm512_dpbusd_epi32(is, w[j], _mm512_set1_epi32(xb[j]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * N + n0, mask, acc[m]);
}

template <int BITS>
KVK_AVX512 void qmm_group_avx512(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* xq,
                                 const float* dx, const float* sx, int64_t M, int64_t K, float* y, int64_t N,
                                 int64_t n0) {
  const int rows = static_cast<int>(std::min<int64_t>(16, N - n0));
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
  int64_t r = 0;
  for (; r + 8 <= M; r += 8)
    qmm_tile_avx512<BITS, 8>(qs, sc, nb, xq + r * K, dx + r * nb, sx + r * nb, K, y + r * N, N, n0, mask);
  const int64_t rem = M - r;
  const int8_t* xr = xq + r * K;
  const float* dr = dx + r * nb;
  const float* sr = sx + r * nb;
  float* yr = y + r * N;
  switch (rem) {
    case 0: break;
    case 1: qmm_tile_avx512<BITS, 1>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 2: qmm_tile_avx512<BITS, 2>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 3: qmm_tile_avx512<BITS, 3>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 4: qmm_tile_avx512<BITS, 4>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 5: qmm_tile_avx512<BITS, 5>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    case 6: qmm_tile_avx512<BITS, 6>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
    default: qmm_tile_avx512<BITS, 7>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, mask); break;
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

// x: (M, K) float32; qs: (G, nb, 256|512) uint8; sc: (G, nb, 2, 16) float16; returns (M, N) float32.
torch::Tensor qmm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc, int64_t bits, int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 8, "qmm: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qmm: x must be a 2-D float32 tensor, got ",
              x.scalar_type(), " of ", x.dim(), " dims");
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "qmm: qs must be a contiguous (G, blocks, bytes) uint8 tensor");
  TORCH_CHECK(sc.dim() == 4 && sc.scalar_type() == at::kHalf && sc.is_contiguous() && sc.size(2) == 2 &&
                  sc.size(3) == 16, "qmm: sc must be a contiguous (G, blocks, 2, 16) float16 tensor");
  const int64_t G = qs.size(0), nb = qs.size(1), K = nb * QK;
  TORCH_CHECK(qs.size(2) == (bits == 4 ? 256 : 512), "qmm: qs last dimension must be ", bits == 4 ? 256 : 512);
  TORCH_CHECK(sc.size(0) == G && sc.size(1) == nb, "qmm: sc shape does not match qs");
  TORCH_CHECK(x.size(1) == K, "qmm: x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(N > 16 * (G - 1) && N <= 16 * G, "qmm: N=", N, " does not fit ", G, " groups of 16 rows");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto& s = act_scratch();
  s.xq.resize(M * K);
  s.dx.resize(M * nb);
  s.sx.resize(M * nb);
  const bool fast = use_avx512();
  if (fast)
    quantize_rows_avx512(xc.data_ptr<float>(), M, K, s.xq.data(), s.dx.data(), s.sx.data());
  else
    quantize_rows_generic(xc.data_ptr<float>(), M, K, s.xq.data(), s.dx.data(), s.sx.data());
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const uint16_t* scp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>());
  const int64_t qstride = nb * (bits == 4 ? 256 : 512), sstride = nb * 32;
  const int8_t* xq = s.xq.data();
  const float* dx = s.dx.data();
  const float* sx = s.sx.data();
  float* yp = y.data_ptr<float>();
  // grain: enough rows of work per task that small products stay on one thread
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, M * nb));
  at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (fast) {
        if (bits == 4)
          qmm_group_avx512<4>(q + g * qstride, scp + g * sstride, nb, xq, dx, sx, M, K, yp, N, 16 * g);
        else
          qmm_group_avx512<8>(q + g * qstride, scp + g * sstride, nb, xq, dx, sx, M, K, yp, N, 16 * g);
      } else {
        if (bits == 4)
          qmm_group_generic<4>(q + g * qstride, scp + g * sstride, nb, xq, dx, sx, M, K, yp, N, 16 * g);
        else
          qmm_group_generic<8>(q + g * qstride, scp + g * sstride, nb, xq, dx, sx, M, K, yp, N, 16 * g);
      }
    }
  });
  return y;
}

// The activation quantization alone (tests): x (M, K) float32 -> (q int8 (M, K), dx (M, K/32), sx (M, K/32)).
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % QK == 0,
              "quantize_activations: x must be (M, K) float32 with K a multiple of 32");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), nb = K / QK;
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto d = torch::empty({M, nb}, x.options());
  auto s = torch::empty({M, nb}, x.options());
  if (use_avx512())
    quantize_rows_avx512(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  else
    quantize_rows_generic(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
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
  int64_t b, h, blk0, blk1;  // batch row, KV head, block range [blk0, blk1) of its table
};

// One work item, portable code: writes the unnormalized output (G, D), the running max (G) and sum (G).
void attn_item_generic(const AttnArgs& a, const WorkItem& it, float* o, float* mx, float* sm) {
  const int64_t G = a.G, D = a.D;
  std::vector<float> kf(D), vf(D), s(G);
  for (int64_t g = 0; g < G; ++g) {
    mx[g] = -std::numeric_limits<float>::infinity();
    sm[g] = 0.f;
    for (int64_t d = 0; d < D; ++d) o[g * D + d] = 0.f;
  }
  const float* qb = a.q + (it.b * a.H + it.h * G) * D;
  const int64_t len = a.ctx[it.b];
  for (int64_t blk = it.blk0; blk < it.blk1; ++blk) {
    const int64_t bid = a.bt[it.b * a.W + blk];
    const int64_t n = std::min<int64_t>(a.BS, len - blk * a.BS);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = (bid * a.BS + t) * a.KVH + it.h;  // token slot, KV head
      const float kscale = a.ks ? half_to_float(a.ks[row]) : 1.f;
      const float vscale = a.vs ? half_to_float(a.vs[row]) : 1.f;
      for (int64_t d = 0; d < D; ++d) {
        kf[d] = load_scalar(a.k, row * D + d, a.kind) * kscale;
        vf[d] = load_scalar(a.v, row * D + d, a.kind) * vscale;
      }
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qb[g * D + d] * kf[d];
        const float mnew = std::max(mx[g], dot);
        const float alpha = std::exp(mx[g] - mnew);  // exp(-inf) = 0 on the first token
        const float p = std::exp(dot - mnew);
        sm[g] = sm[g] * alpha + p;
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = o[g * D + d] * alpha + p * vf[d];
        mx[g] = mnew;
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

constexpr int MAXG = 16;   // query heads per KV head
constexpr int MAXDV = 16;  // head_dim / 16
constexpr int TCH = 16;    // tokens per score chunk

template <int DV>
KVK_AVX512 void attn_item_avx512(const AttnArgs& a, const WorkItem& it, float* o, float* mx, float* sm) {
  const int64_t G = a.G, D = 16 * DV;
  __m512 qv[MAXG][DV];
  __m512 ov[MAXG][DV];
  float m[MAXG], l[MAXG];
  const float* qb = a.q + (it.b * a.H + it.h * G) * D;
  for (int64_t g = 0; g < G; ++g) {
    for (int dv = 0; dv < DV; ++dv) {
      qv[g][dv] = _mm512_loadu_ps(qb + g * D + 16 * dv);
      ov[g][dv] = _mm512_setzero_ps();
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const int64_t len = a.ctx[it.b];
  alignas(64) float s[MAXG][TCH];
  alignas(64) float p[MAXG][TCH];
  const int64_t kvh = a.KVH, BS = a.BS;
  for (int64_t blk = it.blk0; blk < it.blk1; ++blk) {
    const int64_t bid = a.bt[it.b * a.W + blk];
    const int64_t nblk = std::min<int64_t>(BS, len - blk * BS);
    for (int64_t t0 = 0; t0 < nblk; t0 += TCH) {
      const int n = static_cast<int>(std::min<int64_t>(TCH, nblk - t0));
      // scores of n tokens for the G query heads
      for (int t = 0; t < n; ++t) {
        const int64_t row = (bid * BS + t0 + t) * kvh + it.h;
        __m512 kf[DV];
        const __m512 ksc = _mm512_set1_ps(a.ks ? half_to_float(a.ks[row]) : 1.f);
        for (int dv = 0; dv < DV; ++dv) kf[dv] = _mm512_mul_ps(load16(a.k, row * D + 16 * dv, a.kind), ksc);
        for (int64_t g = 0; g < G; ++g) {
          __m512 acc = _mm512_mul_ps(qv[g][0], kf[0]);
          for (int dv = 1; dv < DV; ++dv) acc = _mm512_fmadd_ps(qv[g][dv], kf[dv], acc);
          s[g][t] = _mm512_reduce_add_ps(acc);
        }
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 sv = _mm512_maskz_loadu_ps(valid, s[g]);
        const float cmax = _mm512_mask_reduce_max_ps(valid, sv);
        const float mnew = std::max(m[g], cmax);
        const float alpha = std::exp(m[g] - mnew);
        const __m512 pv = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
        _mm512_store_ps(p[g], pv);
        l[g] = l[g] * alpha + _mm512_reduce_add_ps(pv);
        m[g] = mnew;
        if (alpha != 1.f) {
          const __m512 av = _mm512_set1_ps(alpha);
          for (int dv = 0; dv < DV; ++dv) ov[g][dv] = _mm512_mul_ps(ov[g][dv], av);
        }
      }
      for (int t = 0; t < n; ++t) {
        const int64_t row = (bid * BS + t0 + t) * kvh + it.h;
        __m512 vf[DV];
        const __m512 vsc = _mm512_set1_ps(a.vs ? half_to_float(a.vs[row]) : 1.f);
        for (int dv = 0; dv < DV; ++dv) vf[dv] = _mm512_mul_ps(load16(a.v, row * D + 16 * dv, a.kind), vsc);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 pt = _mm512_set1_ps(p[g][t]);
          for (int dv = 0; dv < DV; ++dv) ov[g][dv] = _mm512_fmadd_ps(pt, vf[dv], ov[g][dv]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int dv = 0; dv < DV; ++dv) _mm512_storeu_ps(o + g * D + 16 * dv, ov[g][dv]);
    mx[g] = m[g];
    sm[g] = l[g];
  }
}

KVK_AVX512 void attn_item_avx512_dispatch(const AttnArgs& a, const WorkItem& it, float* o, float* mx, float* sm) {
  switch (a.D / 16) {
    case 2: attn_item_avx512<2>(a, it, o, mx, sm); break;
    case 4: attn_item_avx512<4>(a, it, o, mx, sm); break;
    case 8: attn_item_avx512<8>(a, it, o, mx, sm); break;
    default: attn_item_avx512<16>(a, it, o, mx, sm); break;  // D = 256; other sizes take the generic path
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
  std::vector<WorkItem> items;
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    first[b] = static_cast<int64_t>(items.size());
    const int64_t len = ctxp[b];
    TORCH_CHECK(len >= 0 && len <= W * BS, "decode_attention: context length ", len, " of row ", b,
                " exceeds its block table (", W, " blocks of ", BS, ")");
    const int64_t nblocks = (len + BS - 1) / BS;
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t s0 = 0; s0 < nblocks; s0 += split_blocks)
        items.push_back({b, h, s0, std::min(nblocks, s0 + split_blocks)});
  }
  first[B] = static_cast<int64_t>(items.size());
  const int64_t NI = static_cast<int64_t>(items.size());
  std::vector<float> po(NI * G * D), pm(NI * G), ps(NI * G);
  AttnArgs a{qs.data_ptr<float>(), k.data_ptr(), v.data_ptr(),
             quant ? reinterpret_cast<const uint16_t*>(k_scale.data_ptr<at::Half>()) : nullptr,
             quant ? reinterpret_cast<const uint16_t*>(v_scale.data_ptr<at::Half>()) : nullptr,
             bt.data_ptr<int64_t>(), ctxp, kind, H, KVH, D, BS, W, G};
  const bool fast = use_avx512() && D % 16 == 0 && (D == 32 || D == 64 || D == 128 || D == 256) && G <= MAXG;
  at::parallel_for(0, NI, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (fast)
        attn_item_avx512_dispatch(a, items[i], &po[i * G * D], &pm[i * G], &ps[i * G]);
      else
        attn_item_generic(a, items[i], &po[i * G * D], &pm[i * G], &ps[i * G]);
    }
  });
  auto out = torch::zeros({B, H, D}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    // combine the splits of each (KV head, query head) of row b
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t i = first[b]; i < first[b + 1]; ++i)
          if (items[i].h == h) M = std::max(M, pm[i * G + g]);
        if (M == -std::numeric_limits<float>::infinity()) continue;  // empty context: zeros
        float L = 0.f;
        float* dst = op + (b * H + h * G + g) * D;
        for (int64_t i = first[b]; i < first[b + 1]; ++i) {
          if (items[i].h != h) continue;
          const float w = std::exp(pm[i * G + g] - M);
          L += ps[i * G + g] * w;
          const float* src = &po[(i * G + g) * D];
          for (int64_t d = 0; d < D; ++d) dst[d] += w * src[d];
        }
        const float inv = 1.f / L;
        for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
      }
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvkeeper CPU kernels (see csrc/kvk_cpu.cpp)";
  m.def("isa", &isa, "the instruction set the kernels use now: avx512_vnni or generic");
  m.def("set_isa", &set_isa, "force the kernels' instruction set: auto, generic or avx512_vnni (tests)");
  m.def("cpu_has_avx512", &cpu_has_avx512, "whether this CPU has AVX-512 F/BW/VL/DQ + VNNI + F16C + FMA");
  m.def("qmm", &qmm, "y (M, N) float32 = x (M, K) float32 @ W^T over interleaved 4-/8-bit blocks",
        py::arg("x"), py::arg("qs"), py::arg("sc"), py::arg("bits"), py::arg("n"));
  m.def("quantize_activations", &quantize_activations, "x (M, K) float32 -> (int8 (M, K), dx, sx (M, K/32))");
  m.def("decode_attention", &decode_attention, "paged decode attention read in place (see the file header)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("kind"), py::arg("split_blocks"));
}
