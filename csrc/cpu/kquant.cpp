// kvkeeper CPU kernels: y = x @ W^T computed in place on the GGUF bytes of a K-quant (Q4_K, Q5_K, Q6_K),
// Q5_0, Q8_0 or F16 weight, without dequantizing the weight to float32.
//
// Self-contained: register_kquant(m) defines the Python bindings (kq_matmul, kq_dequantize_rows, kq_set_isa,
// kq_isa, kq_cpu_has_avx512, kq_cpu_has_avx2); the main extension (bindings.cpp) calls it from its PYBIND11_MODULE.
// The file is compiled for the baseline x86-64 ISA; the AVX-512 functions carry a target attribute (KQ_AVX512),
// the AVX2 ones (KQ_AVX2: AVX2 + FMA + F16C, for CPUs without AVX-512 such as AMD Zen 3) theirs, and one of them is
// chosen at run time from the CPU's flags (AVX-512, else AVX2), every kernel also having a portable C++ path
// (kq_set_isa("generic" | "avx2" | "avx512") forces one, for tests).  F16 has no AVX2 path (float fallback).
//
// GGUF block layouts (one weight row of K elements is K/256 super-blocks, or K/32 blocks for Q8_0, stored
// back to back, or K/32 blocks for Q5_0 / Q8_0; a tensor is N such rows; f16 = IEEE half, little-endian):
//   Q4_K, 144 B per 256: f16 d, f16 dmin, scales[12], qs[128].  Eight sub-blocks j = 0..7 of 32 elements,
//        w = d * sc_j * q - dmin * m_j with q a 4-bit code: sub-block j's codes are the low (j even) or high
//        (j odd) nibbles of qs[32 * (j / 2) .. + 32].  sc_j, m_j are 6-bit: for j < 4 the low 6 bits of
//        scales[j] and scales[j + 4]; for j >= 4 the low (sc) or high (m) nibble of scales[j + 4] with the
//        top two bits of scales[j - 4] (sc) or scales[j] (m) above it.
//   Q5_K, 176 B per 256: f16 d, f16 dmin, scales[12] (as Q4_K), qh[32], qs[128] (as Q4_K); the 5th bit of
//        element l of sub-block j is bit j of qh[l]; w = d * sc_j * q - dmin * m_j, q in 0..31.
//   Q6_K, 210 B per 256: ql[128], qh[64], int8 scales[16], f16 d.  Element e = 128 h + i (h = 0, 1):
//        low 4 bits = ql[64 h + i % 64] low (i < 64) or high (i >= 64) nibble, high 2 bits =
//        (qh[32 h + i % 32] >> 2 (i / 32)) & 3; w = d * scales[e / 16] * (q - 32), q in 0..63.
//   Q8_0, 34 B per 32: f16 d, int8 q[32]; w = d * q.
//   Q5_0, 22 B per 32: f16 d, qh[4], qs[16]; element i's low 4 bits are the low (i < 16) or high (i >= 16)
//        nibble of qs[i % 16], its 5th bit is bit i of the little-endian 32-bit word qh; w = d * (q - 16),
//        q in 0..31 (llama.cpp uses it where K is not a multiple of 256, e.g. Gemma 3 270M's K = 640).
//   F16: 2 B per element.
//
// Algorithm (the design of llama.cpp's ggml-cpu quantized dot products, in our own code): the activations
// are quantized once per call, per row and super-block of 256, to int8 q_x with one float scale
// dx = max|x| / 127 and the sums of q_x over each 16 elements ("bsums"; llama.cpp calls the format Q8_K).
// For a K-quant weight super-block with per-16-element integer scales s_g and mins m_g:
//     sum_e w_e x_e  ~=  dx * ( d * sum_g s_g * sum_{e in g} q_e q_x,e  -  dmin * sum_g m_g * bsum_g ),
// so the integer dot products are exact and the min terms (Q4_K, Q5_K: m_g = m_j; Q6_K: m_g = 32 s_g for
// the -32 offset, dmin = d) cost 16 multiply-adds per super-block instead of 256.  Each weight row is first
// unpacked ("KU" below: codes as unsigned bytes 0..63, the scales spread to 16-bit lanes, the mins, d and
// dmin) into a per-thread scratch in L1.  For Q4_K/Q5_K the activation bytes are stored in the order the
// nibbles come out of a 64-byte load (sub-blocks 0,2 | 1,3 | 4,6 | 5,7), so unpacking is a mask and a shift.
//  * decode (a task with at most 4 activation rows): the task's 16 weight rows in lanes (kq_rows16_t): each row's
//    super-block unpacked into registers, VPMADDUBSW (u8 codes x s8 activations -> int16 pairs, no saturation
//    since 2 * 63 * 127 < 32767) then VPDPWSSD (AVX512-VNNI: the pairs times the 16-bit scales, summed in int32),
//    and one transpose-and-add tree per super-block gives the 16 rows' exact integer sums in lanes, whose float
//    step (d, dmin, the activation scale) is the prefill tiles' own, lane for lane.  Against the earlier row by
//    row kernel (two horizontal sums and a scalar float step per row and super-block) a Q4_K GEMV of 8192 x 2048
//    in cache went from 10.9 to 14.0 GB/s on one thread (Intel Xeon, 2026-12-06).
//  * prefill: the unpacked rows of a 16-row tile are interleaved per 4 positions ("KT"), so that one
//    VPDPBUSD multiplies 4 codes of each of the 16 rows by 4 activation bytes broadcast from memory, the 16
//    int32 lanes being the 16 output rows: a scale group (32 positions for Q4_K/Q5_K, 16 for Q6_K) sums in
//    int32, one VPMULLD applies its scales, the mins go through VPDPWSSD on the bsums, no horizontal sums.
//    The tile is built once per task and used against all its activation rows, 6 at a time (the repacked
//    layouts of ggml-cpu follow the same idea, done there once at load).  This runs at about one VPDPBUSD
//    (64 multiply-adds) per cycle, the core's limit.
// Q8_0 and Q5_0 use activations quantized per 32 (one scale per weight block) and unsigned codes (Q8_0: w + 128,
// taken back out as 128 * sum(q_x); Q5_0: q = w / d + 16 as stored, 16 * sum(q_x) out, sum(q_x) being the block's
// two bsums), so a block's integer dot is exact: prefill through 16-row tiles of the codes; decode 16 rows at a
// time in lanes as well, each row's VPDPBUSD vector summed per block by a transpose-and-add tree (no horizontal
// sum per row and block).  Either way the dot becomes acc = fma(float(dot), d_w * d_x, acc), in block order.  F16 is a float fallback (prefill by
// chunks through torch's float32 GEMM).
//
// Tolerance: the result equals x_q @ W^T up to float32 rounding, x_q being x rounded to the int8 grid
// (|x - x_q| <= dx / 2 per element); against float x, |y - x @ W^T| <= ||x - x_q|| * ||w_n|| (see
// tests/kernels/test_kquant.py, which checks both).  Relative rms error against float x, measured on the
// Gemma 3 270M Q4_K_M tensors with Gaussian x: 0.5-0.8%.
//
// Parallel: the kernels' thread pool (pool.cpp) over tasks of (16 weight rows) x (128 activation rows): decode is split over output
// rows, prefill over both.  The three ISA paths compute the same integers; the AVX2 path also takes the portable
// path's float steps in its order (bit-identical to it, tested), the AVX-512 path its own (only float rounding
// differs).
// Batch invariance (each ISA; the portable and AVX2 paths by one float step per row and super-block / block whatever
// the route): on the AVX-512 path every route (decode rows, unpacked rows against a few activation rows,
// prefill tiles) computes a row's exact integer sums per super-block (per block for Q5_0, Q8_0) and applies the same
// float operations to them in the same order, so an output does not depend on M or on the row's place in the
// batch: a token's logits are the same bit for bit whether its step was a decode or part of a prefill.

#include <torch/extension.h>
#include "common.h"
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kquant {

#define KQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c,fma")))
#define KQ_AVX2 __attribute__((target("avx2,fma,f16c")))

enum GgmlType : int64_t { T_F16 = 1, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
constexpr int QK_K = 256;
constexpr int QK8 = 32;
constexpr int NT = 16;   // weight rows per task
constexpr int MT = 128;  // activation rows per task
constexpr int MR = 4;    // activation rows per micro-kernel call
constexpr int64_t F16_MM_MIN_M = 8;     // F16 with more activation rows: torch's float32 GEMM by chunks
constexpr int64_t F16_MM_ROWS = 1024;
constexpr int TILE_MIN_M = 16;  // from this many activation rows in a task, K-quants and Q8_0 go through 16-row tiles
constexpr int TILE_MR = 6;      // activation rows per tile micro-kernel call
// Below this many multiply-adds (M counted up to 8) a product runs on the calling thread: a parallel region
// costs microseconds on an idle machine and milliseconds when the workers must wait for a busy core.
constexpr int64_t PAR_MIN_WORK = int64_t(1) << 19;

// ---------------------------------------------------------------------------------------------------
// ISA
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

// auto: AVX-512 where the CPU has it, else AVX2 (+ FMA + F16C), else the portable code; generic / avx2 force a
// lower level (tests compare them), avx512 checks the CPU and is auto.
enum class Level { Auto, Generic, Avx2 };
Level g_level = Level::Auto;
bool use_avx512() { return g_level == Level::Auto && cpu_has_avx512(); }
bool use_avx2() { return g_level != Level::Generic && !use_avx512() && kvk::cpu_has_avx2(); }
std::string isa() { return use_avx512() ? "avx512" : use_avx2() ? "avx2" : "generic"; }

void set_isa(const std::string& name) {
  if (name == "auto") {
    g_level = Level::Auto;
  } else if (name == "generic") {
    g_level = Level::Generic;
  } else if (name == "avx2") {
    TORCH_CHECK(kvk::cpu_has_avx2(), "kq_set_isa: this CPU lacks AVX2 + FMA + F16C");
    g_level = Level::Avx2;
  } else if (name == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "kq_set_isa: this CPU lacks AVX-512 F/BW/VL/DQ + VNNI + F16C + FMA");
    g_level = Level::Auto;
  } else {
    TORCH_CHECK(false, "kq_set_isa: unknown ISA '", name, "': choose auto, generic, avx2 or avx512");
  }
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

int64_t row_bytes(int64_t type, int64_t K) {
  switch (type) {
    case T_Q4_K: return K / QK_K * 144;
    case T_Q5_K: return K / QK_K * 176;
    case T_Q6_K: return K / QK_K * 210;
    case T_Q8_0: return K / QK8 * 34;
    case T_Q5_0: return K / QK8 * 22;
    case T_F16: return K * 2;
    default:
      TORCH_CHECK(false, "kquant: unsupported GGML type ", type, " (F16=1, Q5_0=6, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  }
  return 0;
}

void check_k(int64_t type, int64_t K) {
  TORCH_CHECK(K > 0, "kquant: K must be positive");
  if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K)
    TORCH_CHECK(K % QK_K == 0, "kquant: K=", K, " must be a multiple of 256 for K-quants");
  if (type == T_Q8_0 || type == T_Q5_0)
    TORCH_CHECK(K % QK8 == 0, "kquant: K=", K, " must be a multiple of 32 for Q8_0 and Q5_0");
}

// Types of 32-element blocks with one scale each (activations quantized per 32, no super-blocks).
inline bool per32(int64_t type) { return type == T_Q8_0 || type == T_Q5_0; }

// Sub-block order of the Q4_K/Q5_K activation bytes: position 32 p + l holds element 32 ORD[p] + l.  ORD is
// its own inverse.  A 64-byte load of qs[64 h ..] gives, masked, the codes of sub-blocks ORD[4h], ORD[4h+1]
// and, shifted, those of ORD[4h+2], ORD[4h+3].
constexpr int ORD[8] = {0, 2, 1, 3, 4, 6, 5, 7};
inline bool nibble_order(int64_t type) { return type == T_Q4_K || type == T_Q5_K; }

// ---------------------------------------------------------------------------------------------------
// Activation quantization (Q8_K per 256 for K-quants, per 32 for Q5_0 / Q8_0), plain C++ shared by both ISAs
// ---------------------------------------------------------------------------------------------------
struct Act {
  std::vector<int8_t> q;     // (M, K), in the weight type's element order (see ORD)
  std::vector<float> d;      // (M, K / B)
  std::vector<int16_t> bs;   // (M, K / 16): sums of q over each 16 elements, natural order
  int64_t K = 0, B = 0;
};

// One row, AVX-512: the same numbers as the portable loop below (the same float32 d and 1 / d, and
// VCVTPS2DQ rounds half to even as nearbyint does under the default rounding mode).
KQ_AVX512 void quantize_row_avx512(const float* xr, int64_t K, int64_t B, bool perm, int8_t* qr, float* dr,
                                   int16_t* bsr) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / B; ++b) {
    const float* xb = xr + b * B;
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < B; i += 16) mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + i)));
    const float d = _mm512_reduce_max_ps(mx) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const __m512 idv = _mm512_set1_ps(id);
    for (int g = 0; g < B / 16; ++g) {
      const int e = 16 * g;
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + e), idv));
      const int pos = perm ? 32 * ORD[e / 32] + e % 32 : e;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * B + pos), _mm512_cvtsepi32_epi8(v));
      bsr[b * (B / 16) + g] = static_cast<int16_t>(_mm512_reduce_add_epi32(v));
    }
    dr[b] = d;
  }
}

// One row, AVX2: the portable loop's numbers (the same float32 max, d and 1 / d; VCVTPS2DQ rounds half to even
// as nearbyint does under the default rounding mode, then the clamp to [-127, 127]), 32 elements at a time.
KQ_AVX2 void quantize_row_avx2(const float* xr, int64_t K, int64_t B, bool perm, int8_t* qr, float* dr,
                               int16_t* bsr) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / B; ++b) {
    const float* xb = xr + b * B;
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < B; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const __m256 idv = _mm256_set1_ps(id);
    for (int e = 0; e < B; e += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + e + 8 * j), idv));
        v[j] = _mm256_max_epi32(nlim, _mm256_min_epi32(lim, v[j]));
      }
      // bytes in element order: packs interleaves the 128-bit lanes, the dword permute undoes it
      const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      const int pos = perm ? 32 * ORD[e / 32] : e;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + b * B + pos), _mm256_permutevar8x32_epi32(p8, order));
      // the two 16-element sums
      const __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      bsr[b * (B / 16) + e / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(s4));
      bsr[b * (B / 16) + e / 16 + 1] = static_cast<int16_t>(_mm_extract_epi32(s4, 1));
    }
    dr[b] = d;
  }
}

void quantize_act(const float* x, int64_t M, int64_t K, int64_t type, Act& a) {
  const int64_t B = per32(type) ? QK8 : QK_K, nb = K / B;
  a.K = K;
  a.B = B;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.bs.resize(M * (K / 16));
  const bool perm = nibble_order(type);
  if (use_avx512()) {
    kvk::parallel_for(0, M, std::max<int64_t>(1, (int64_t(1) << 16) / K), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quantize_row_avx512(x + r * K, K, B, perm, a.q.data() + r * K, a.d.data() + r * nb,
                            a.bs.data() + r * (K / 16));
    });
    return;
  }
  if (use_avx2()) {
    kvk::parallel_for(0, M, std::max<int64_t>(1, (int64_t(1) << 16) / K), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quantize_row_avx2(x + r * K, K, B, perm, a.q.data() + r * K, a.d.data() + r * nb, a.bs.data() + r * (K / 16));
    });
    return;
  }
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * B;
      float amax = 0.f;
      for (int i = 0; i < B; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* qb = a.q.data() + r * K + b * B;
      int16_t* bsb = a.bs.data() + r * (K / 16) + b * (B / 16);
      for (int g = 0; g < B / 16; ++g) {
        int sum = 0;
        for (int l = 0; l < 16; ++l) {
          const int e = 16 * g + l;
          int v = static_cast<int>(std::nearbyint(xb[e] * id));  // round half to even
          v = std::min(127, std::max(-127, v));
          sum += v;
          const int pos = perm ? 32 * ORD[e / 32] + e % 32 : e;
          qb[pos] = static_cast<int8_t>(v);
        }
        bsb[g] = static_cast<int16_t>(sum);
      }
      a.d[r * nb + b] = d;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Unpacked K-quant super-block (both ISAs read and write the same layout)
//   q[64 c + i]: the code (0..63) of the element at activation position 64 c + i;
//   sc[32 c + i]: the 16-bit scale of positions 64 c + 2 i and 2 i + 1 (VPMADDUBSW's output lane i);
//   mn[g]: the min of natural 16-element group g (applied to bsum_g); d, dmin.
// ---------------------------------------------------------------------------------------------------
struct alignas(64) KU {
  uint8_t q[256];
  int16_t sc[128];
  int16_t mn[16];
  float d, dmin;
};

// The 12 packed bytes as four words of four 6-bit values: scales 0-3, scales 4-7, mins 0-3, mins 4-7.
inline void scale_min_words(const uint8_t* s, uint32_t* out) {
  uint32_t a0, a1, a2;
  std::memcpy(&a0, s, 4);
  std::memcpy(&a1, s + 4, 4);
  std::memcpy(&a2, s + 8, 4);
  out[0] = a0 & 0x3f3f3f3fu;
  out[1] = (a2 & 0x0f0f0f0fu) | ((a0 >> 2) & 0x30303030u);
  out[2] = a1 & 0x3f3f3f3fu;
  out[3] = ((a2 >> 4) & 0x0f0f0f0fu) | ((a1 >> 2) & 0x30303030u);
}

inline void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  uint32_t w[4];
  scale_min_words(s, w);
  std::memcpy(sc, w, 8);
  std::memcpy(m, w + 2, 8);
}

// Natural-order decode of one super-block: codes qn[256], per-16-group scale and min, d, dmin.
void decode_sb(const uint8_t* b, int64_t type, uint8_t* qn, int16_t* sg, int16_t* mg, float& d, float& dmin) {
  if (type == T_Q4_K || type == T_Q5_K) {
    d = f16_at(b);
    dmin = f16_at(b + 2);
    uint8_t sc[8], m[8];
    scale_min_k4(b + 4, sc, m);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = type == T_Q4_K ? b + 16 : b + 48;
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = qs[32 * (j / 2) + l];
        int v = (j % 2) ? byte >> 4 : byte & 0x0F;
        if (type == T_Q5_K) v |= ((qh[l] >> j) & 1) << 4;
        qn[32 * j + l] = static_cast<uint8_t>(v);
      }
      sg[2 * j] = sg[2 * j + 1] = sc[j];
      mg[2 * j] = mg[2 * j + 1] = m[j];
    }
  } else {  // Q6_K
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
    d = dmin = f16_at(b + 208);
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, i = e % 128;
      const uint8_t lo = ql[64 * h + i % 64];
      const int v = ((i < 64) ? (lo & 0x0F) : (lo >> 4)) | (((qh[32 * h + i % 32] >> (2 * (i / 32))) & 3) << 4);
      qn[e] = static_cast<uint8_t>(v);
    }
    for (int g = 0; g < 16; ++g) {
      sg[g] = s[g];
      mg[g] = static_cast<int16_t>(32 * s[g]);
    }
  }
}

void unpack_generic(const uint8_t* row, int64_t type, int64_t nsb, KU* out) {
  const int64_t sbb = row_bytes(type, QK_K);
  const bool perm = nibble_order(type);
  uint8_t qn[256];
  int16_t sg[16], mg[16];
  for (int64_t s = 0; s < nsb; ++s) {
    KU& u = out[s];
    decode_sb(row + s * sbb, type, qn, sg, mg, u.d, u.dmin);
    for (int p = 0; p < 256; ++p) {
      const int e = perm ? 32 * ORD[p / 32] + p % 32 : p;
      u.q[p] = qn[e];
      if (p % 2 == 0) u.sc[p / 2] = sg[e / 16];
    }
    for (int g = 0; g < 16; ++g) u.mn[g] = mg[g];
  }
}

// acc[m] += the dot products of the unpacked row w (nsb super-blocks) with activation rows m0 .. m0+mr-1.
void ku_dot_generic(const KU* w, int64_t nsb, const Act& a, int64_t m0, int mr, float* out) {
  const int64_t K = a.K;
  for (int m = 0; m < mr; ++m) {
    const int64_t r = m0 + m;
    float acc = 0.f;
    for (int64_t s = 0; s < nsb; ++s) {
      const KU& u = w[s];
      const int8_t* xq = a.q.data() + r * K + s * QK_K;
      const int16_t* bs = a.bs.data() + r * (K / 16) + s * 16;
      int32_t P = 0, Mi = 0;
      for (int p = 0; p < 256; p += 2)
        P += u.sc[p / 2] * (u.q[p] * static_cast<int32_t>(xq[p]) + u.q[p + 1] * static_cast<int32_t>(xq[p + 1]));
      for (int g = 0; g < 16; ++g) Mi += static_cast<int32_t>(u.mn[g]) * bs[g];
      acc += a.d[r * (K / QK_K) + s] * (u.d * static_cast<float>(P) - u.dmin * static_cast<float>(Mi));
    }
    out[m] = acc;
  }
}

// 16-bit lane i of chunk c's scale vector: the scale index of positions 64 c + 2 i (v[0]: Q4_K/Q5_K order,
// the sub-block 0..7; v[1]: Q6_K, the group 0..15).
struct ScaleIdx {
  alignas(64) int16_t v[2][4][32];
};
constexpr ScaleIdx make_scale_idx() {
  ScaleIdx t{};
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 32; ++i) {
      const int p = 64 * c + 2 * i;
      t.v[0][c][i] = static_cast<int16_t>(ORD[p / 32]);
      t.v[1][c][i] = static_cast<int16_t>(p / 16);
    }
  return t;
}
constexpr ScaleIdx SCALE_IDX = make_scale_idx();

// One unpacked super-block in registers (the KU layout, see above), and the constants that make it.
struct SbRegs {
  __m512i q[4], sc[4];
  __m256i mn;
  float d, dmin;
};

struct SbConst {
  __m512i low4, ix[4], hb[4], sixteen, three, sh_lo, sh_hi;
  __m256i mix;
  int64_t type, sbb, qoff;
};

KQ_AVX512 inline SbConst sb_const(int64_t type) {
  SbConst k;
  k.type = type;
  k.sbb = row_bytes(type, QK_K);
  k.low4 = _mm512_set1_epi8(0x0F);
  // 16-bit lane i of chunk c's scale vector: the scale index (0..7 sub-block for Q4_K/Q5_K, 0..15 group for
  // Q6_K) of positions 64 c + 2 i.
  const auto& idx = SCALE_IDX.v[nibble_order(type) ? 0 : 1];
  for (int c = 0; c < 4; ++c) k.ix[c] = _mm512_load_si512(idx[c]);
  // min of group g = m[g / 2], stored after the 8 scales
  k.mix = _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  // Q5_K: bit masks selecting the 5th bit of the sub-blocks of each chunk's two 32-byte halves
  for (int c = 0; c < 4; ++c) {
    const __m256i lo = _mm256_set1_epi8(static_cast<char>(1 << ORD[2 * c]));
    const __m256i hi = _mm256_set1_epi8(static_cast<char>(1 << ORD[2 * c + 1]));
    k.hb[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  k.sixteen = _mm512_set1_epi8(16);
  k.qoff = type == T_Q4_K ? 16 : 48;
  k.three = _mm512_set1_epi8(3);
  k.sh_lo = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
  k.sh_hi = _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6);
  return k;
}

template <int64_t TYPE>
__attribute__((always_inline)) KQ_AVX512 inline void sb_regs_t(const uint8_t* b, const SbConst& k, SbRegs& u) {
  if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K) {
    u.d = f16_at(b);
    u.dmin = f16_at(b + 2);
    uint32_t sm[4];
    scale_min_words(b + 4, sm);  // into a register, not through memory (a store-forwarding stall)
    const __m256i v16 = _mm256_cvtepu8_epi16(_mm_setr_epi32(static_cast<int>(sm[0]), static_cast<int>(sm[1]),
                                                            static_cast<int>(sm[2]), static_cast<int>(sm[3])));
    const __m512i v = _mm512_zextsi256_si512(v16);
    for (int c = 0; c < 4; ++c) u.sc[c] = _mm512_permutexvar_epi16(k.ix[c], v);
    u.mn = _mm256_permutexvar_epi16(k.mix, v16);
    constexpr int64_t qoff = TYPE == T_Q4_K ? 16 : 48;
    const __m512i a0 = _mm512_loadu_si512(b + qoff), a1 = _mm512_loadu_si512(b + qoff + 64);
    u.q[0] = _mm512_and_si512(a0, k.low4);
    u.q[1] = _mm512_and_si512(_mm512_srli_epi16(a0, 4), k.low4);
    u.q[2] = _mm512_and_si512(a1, k.low4);
    u.q[3] = _mm512_and_si512(_mm512_srli_epi16(a1, 4), k.low4);
    if constexpr (TYPE == T_Q5_K) {
      const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
      for (int c = 0; c < 4; ++c)
        u.q[c] = _mm512_mask_add_epi8(u.q[c], _mm512_test_epi8_mask(H, k.hb[c]), u.q[c], k.sixteen);
    }
    return;
  }
  // Q6_K, natural order
  u.d = u.dmin = f16_at(b + 208);
  const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  const __m512i v = _mm512_zextsi256_si512(s16);
  for (int c = 0; c < 4; ++c) u.sc[c] = _mm512_permutexvar_epi16(k.ix[c], v);
  u.mn = _mm256_slli_epi16(s16, 5);
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(b + 64 * h);
    const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
    const __m512i hl = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(H, k.sh_lo), k.three), 4);
    const __m512i hh = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(H, k.sh_hi), k.three), 4);
    u.q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, k.low4), hl);
    u.q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), k.low4), hh);
  }
}

KQ_AVX512 inline void sb_regs(const uint8_t* b, const SbConst& k, SbRegs& u) {
  switch (k.type) {
    case T_Q4_K: sb_regs_t<T_Q4_K>(b, k, u); break;
    case T_Q5_K: sb_regs_t<T_Q5_K>(b, k, u); break;
    default: sb_regs_t<T_Q6_K>(b, k, u); break;
  }
}

KQ_AVX512 void unpack_avx512(const uint8_t* row, int64_t type, int64_t nsb, KU* out) {
  const SbConst k = sb_const(type);
  SbRegs r;
  for (int64_t s = 0; s < nsb; ++s) {
    sb_regs(row + s * k.sbb, k, r);
    KU& u = out[s];
    u.d = r.d;
    u.dmin = r.dmin;
    for (int c = 0; c < 4; ++c) {
      _mm512_store_si512(u.q + 64 * c, r.q[c]);
      _mm512_store_si512(u.sc + 32 * c, r.sc[c]);
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(u.mn), r.mn);
  }
}

// One super-block's float step, as the prefill tiles take it in their lanes (so that a row's result does not
// depend on which path, decode or prefill, computed it): acc = fma(tot * d - mins * dmin, dx, acc), each
// operation rounded as _mm512_mul_ps / _mm512_fnmadd_ps / _mm512_fmadd_ps round it.
KQ_AVX512 inline __m128 sb_step(__m128 acc, int32_t tot, int32_t mins, float d, float dmin, float dx) {
  __m128 f = _mm_mul_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), tot), _mm_set_ss(d));
  f = _mm_fnmadd_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), mins), _mm_set_ss(dmin), f);
  return _mm_fmadd_ss(f, _mm_set_ss(dx), acc);
}

template <int R>
KQ_AVX512 void ku_dot_avx512_t(const KU* w, int64_t nsb, const Act& a, int64_t m0, float* out) {
  const int64_t K = a.K, nb = K / QK_K;
  __m128 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm_setzero_ps();
  const int8_t* xq = a.q.data() + m0 * K;
  const int16_t* bs = a.bs.data() + m0 * (K / 16);
  const float* dx = a.d.data() + m0 * nb;
  for (int64_t s = 0; s < nsb; ++s) {
    const KU& u = w[s];
    const __m512i q0 = _mm512_load_si512(u.q), q1 = _mm512_load_si512(u.q + 64);
    const __m512i q2 = _mm512_load_si512(u.q + 128), q3 = _mm512_load_si512(u.q + 192);
    const __m512i s0 = _mm512_load_si512(u.sc), s1 = _mm512_load_si512(u.sc + 32);
    const __m512i s2 = _mm512_load_si512(u.sc + 64), s3 = _mm512_load_si512(u.sc + 96);
    const __m256i mn = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.mn));
#pragma GCC unroll 4
    for (int m = 0; m < R; ++m) {
      const int8_t* x = xq + m * K + s * QK_K;
      __m512i P = _mm512_setzero_si512();
      P = _mm512_dpwssd_epi32(P, _mm512_maddubs_epi16(q0, _mm512_loadu_si512(x)), s0);
      P = _mm512_dpwssd_epi32(P, _mm512_maddubs_epi16(q1, _mm512_loadu_si512(x + 64)), s1);
      P = _mm512_dpwssd_epi32(P, _mm512_maddubs_epi16(q2, _mm512_loadu_si512(x + 128)), s2);
      P = _mm512_dpwssd_epi32(P, _mm512_maddubs_epi16(q3, _mm512_loadu_si512(x + 192)), s3);
      const __m256i mi = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + m * (K / 16) + s * 16)), mn);
      // the super-block's integer sums (exact), then its float step as the tiles take it
      acc[m] = sb_step(acc[m], _mm512_reduce_add_epi32(P), _mm512_reduce_add_epi32(_mm512_zextsi256_si512(mi)),
                       u.d, u.dmin, dx[m * nb + s]);
    }
  }
  for (int m = 0; m < R; ++m) out[m] = _mm_cvtss_f32(acc[m]);
}

KQ_AVX512 void ku_dot_avx512(const KU* w, int64_t nsb, const Act& a, int64_t m0, int mr, float* out) {
  switch (mr) {
    case 1: ku_dot_avx512_t<1>(w, nsb, a, m0, out); break;
    case 2: ku_dot_avx512_t<2>(w, nsb, a, m0, out); break;
    case 3: ku_dot_avx512_t<3>(w, nsb, a, m0, out); break;
    default: ku_dot_avx512_t<4>(w, nsb, a, m0, out); break;
  }
}

// Software prefetch distance of decode, in weight rows: the mapped file's pages are 4 KB, at whose boundaries the
// hardware prefetcher stops; 32 rows ahead (spread over the task's super-blocks) (36 KB of Q4_K at K = 2,048; the next tasks' rows, which the other
// threads take, included) measured best with 2 threads on the 1.7B shape: a decode step's products 58-82 -> 35-41 ms
// (16 rows: 35-72, 64: 35-37, none: 48-82 ms; one thread: no change, it is compute-bound there).
constexpr int64_t KQ_PF_ROWS = 32;

// ---------------------------------------------------------------------------------------------------
// Prefill tiles (AVX-512): 16 weight rows interleaved per 4 positions, so that one VPDPBUSD multiplies 4
// codes of each of the 16 rows (the 16 int32 lanes are the 16 rows) by 4 activation bytes broadcast from
// memory; the lanes sum one scale group (32 positions for Q4_K/Q5_K, 16 for Q6_K) before VPMULLD by the
// group's scale, and the rows come out in lanes: no horizontal sums.  Built per task from the unpacked rows
// (KU) and used against every activation row of the task (the repacked layouts of ggml-cpu follow the same
// idea, done there once at load).
// ---------------------------------------------------------------------------------------------------
struct alignas(64) KT {
  uint8_t q[64][64];    // [4-position group k4][4 * row + c]: the code of row `row` at position 4 k4 + c
  int32_t sc[16][16];   // [scale group][row]
  int32_t mn[8][16];    // [j][row]: the mins of natural 16-groups 2j (low int16) and 2j + 1 (high)
  float d[16], dmin[16];
};

inline int scale_group_size(int64_t type) { return nibble_order(type) ? 32 : 16; }

// rows: the tile's KU rows (rows[i] = nsb super-blocks), nrows <= 16 (the others are zero)
void build_tile(const KU* const* rows, int nrows, int64_t nsb, int gs, KT* t) {
  for (int64_t s = 0; s < nsb; ++s) {
    KT& T = t[s];
    for (int i = 0; i < 16; ++i) {
      if (i >= nrows) {
        for (int k4 = 0; k4 < 64; ++k4) std::memset(&T.q[k4][4 * i], 0, 4);
        for (int g = 0; g < 16; ++g) T.sc[g][i] = 0;
        for (int j = 0; j < 8; ++j) T.mn[j][i] = 0;
        T.d[i] = T.dmin[i] = 0.f;
        continue;
      }
      const KU& u = rows[i][s];
      for (int k4 = 0; k4 < 64; ++k4) std::memcpy(&T.q[k4][4 * i], u.q + 4 * k4, 4);
      for (int g = 0; g < 256 / gs; ++g) T.sc[g][i] = u.sc[g * gs / 2];
      for (int j = 0; j < 8; ++j)
        T.mn[j][i] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(u.mn[2 * j])) |
                                          (static_cast<uint32_t>(static_cast<uint16_t>(u.mn[2 * j + 1])) << 16));
      T.d[i] = u.d;
      T.dmin[i] = u.dmin;
    }
  }
}

template <int R, int GS>
KQ_AVX512 void tile_dot_avx512_t(const KT* t, int64_t nsb, const Act& a, int64_t m0, float* y, int64_t N,
                                 int64_t n0, __mmask16 mask) {
  const int64_t K = a.K, nb = K / QK_K;
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const KT& T = t[s];
    __m512i tot[R], mins[R];
    for (int m = 0; m < R; ++m) tot[m] = mins[m] = _mm512_setzero_si512();
    const int8_t* xs = a.q.data() + m0 * K + s * QK_K;
    for (int g = 0; g < 256 / GS; ++g) {
      __m512i S[R];
      for (int m = 0; m < R; ++m) S[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < GS / 4; ++k) {
        const int k4 = g * (GS / 4) + k;
        const __m512i W = _mm512_load_si512(T.q[k4]);
#pragma GCC unroll 6
        for (int m = 0; m < R; ++m) {
          int32_t xv;
          std::memcpy(&xv, xs + m * K + 4 * k4, 4);
          S[m] = _mm512_dpbusd_epi32(S[m], W, _mm512_set1_epi32(xv));
        }
      }
      const __m512i SC = _mm512_load_si512(T.sc[g]);
      for (int m = 0; m < R; ++m) tot[m] = _mm512_add_epi32(tot[m], _mm512_mullo_epi32(S[m], SC));
    }
    const int16_t* bs = a.bs.data() + m0 * (K / 16) + s * 16;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i MN = _mm512_load_si512(T.mn[j]);
      for (int m = 0; m < R; ++m) {
        int32_t bv;
        std::memcpy(&bv, bs + m * (K / 16) + 2 * j, 4);
        mins[m] = _mm512_dpwssd_epi32(mins[m], MN, _mm512_set1_epi32(bv));
      }
    }
    const __m512 D = _mm512_load_ps(T.d), DM = _mm512_load_ps(T.dmin);
    for (int m = 0; m < R; ++m) {
      __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(tot[m]), D);
      f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[m]), DM, f);
      acc[m] = _mm512_fmadd_ps(f, _mm512_set1_ps(a.d[(m0 + m) * nb + s]), acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, acc[m]);
}

template <int GS>
KQ_AVX512 void tile_dot_avx512_gs(const KT* t, int64_t nsb, const Act& a, int64_t m0, int mr, float* y, int64_t N,
                                  int64_t n0, __mmask16 mask) {
  switch (mr) {
    case 1: tile_dot_avx512_t<1, GS>(t, nsb, a, m0, y, N, n0, mask); break;
    case 2: tile_dot_avx512_t<2, GS>(t, nsb, a, m0, y, N, n0, mask); break;
    case 3: tile_dot_avx512_t<3, GS>(t, nsb, a, m0, y, N, n0, mask); break;
    case 4: tile_dot_avx512_t<4, GS>(t, nsb, a, m0, y, N, n0, mask); break;
    case 5: tile_dot_avx512_t<5, GS>(t, nsb, a, m0, y, N, n0, mask); break;
    default: tile_dot_avx512_t<6, GS>(t, nsb, a, m0, y, N, n0, mask); break;
  }
}

KQ_AVX512 void tile_dot_avx512(const KT* t, int64_t nsb, int gs, const Act& a, int64_t m0, int mr, float* y,
                               int64_t N, int64_t n0, int nrows) {
  const __mmask16 mask = static_cast<__mmask16>((1u << nrows) - 1u);
  if (gs == 32)
    tile_dot_avx512_gs<32>(t, nsb, a, m0, mr, y, N, n0, mask);
  else
    tile_dot_avx512_gs<16>(t, nsb, a, m0, mr, y, N, n0, mask);
}

// ---------------------------------------------------------------------------------------------------
// Q8_0: directly on the GGUF blocks
// ---------------------------------------------------------------------------------------------------
void q8_dot_generic(const uint8_t* row, int64_t K, const Act& a, int64_t m0, int mr, float* out) {
  const int64_t nb = K / QK8;
  for (int m = 0; m < mr; ++m) {
    const int64_t r = m0 + m;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + 34 * b;
      const int8_t* wq = reinterpret_cast<const int8_t*>(blk + 2);
      const int8_t* xq = a.q.data() + r * K + b * QK8;
      int32_t s = 0;
      for (int i = 0; i < QK8; ++i) s += static_cast<int32_t>(wq[i]) * xq[i];
      acc += f16_at(blk) * a.d[r * nb + b] * static_cast<float>(s);
    }
    out[m] = acc;
  }
}

// Q8_0 / Q5_0 prefill tiles (AVX-512): per block of 32, the 16 rows' unsigned codes interleaved per 4 positions
// as in KT, and their d: Q8_0's codes + 128 (the + 128 comes back out as 128 * the block's sum of activation
// codes), Q5_0's codes q = w / d + 16 as stored (16 * the sum comes back out).
struct alignas(64) QT {
  uint8_t q[8][64];
  float d[16];
};

// The 32 codes (0..31) of a Q5_0 block, natural order.
void q5_codes(const uint8_t* blk, uint8_t* q) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const uint8_t* qs = blk + 6;
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<uint8_t>((qs[i] & 0x0F) | (((qh >> i) & 1u) << 4));
    q[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
  }
}

// Prefill tile of Q8_0 or Q5_0 rows: per block, each row's 32 unsigned codes (Q8_0: w + 128; Q5_0: the codes as
// stored), interleaved per 4 positions; padding rows carry the zero weight's code (128 / 0) with d = 0.
void build_p32_tile(const uint8_t* w, int64_t rb, int nrows, int64_t nb, int64_t type, QT* t) {
  const bool q8 = type == T_Q8_0;
  const int64_t bb = q8 ? 34 : 22;
  for (int64_t b = 0; b < nb; ++b) {
    QT& T = t[b];
    for (int i = 0; i < 16; ++i) {
      uint8_t q[32];
      const uint8_t* blk = w + i * rb + bb * b;
      if (i >= nrows)
        std::memset(q, q8 ? 0x80 : 0, 32);
      else if (q8)
        for (int j = 0; j < 32; ++j) q[j] = static_cast<uint8_t>(blk[2 + j] ^ 0x80u);
      else
        q5_codes(blk, q);
      for (int k4 = 0; k4 < 8; ++k4) std::memcpy(&T.q[k4][4 * i], q + 4 * k4, 4);
      T.d[i] = i >= nrows ? 0.f : f16_at(blk);
    }
  }
}

// off: the offset of the tile's unsigned codes (128 for Q8_0, 16 for Q5_0), taken back out as off * bsum
template <int R>
KQ_AVX512 void q8_tile_dot_avx512_t(const QT* t, int64_t nb, const Act& a, int64_t m0, float* y, int64_t N,
                                    int64_t n0, __mmask16 mask, int32_t off) {
  const int64_t K = a.K;
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const QT& T = t[b];
    __m512i S[R];
    for (int m = 0; m < R; ++m) S[m] = _mm512_setzero_si512();
    const int8_t* xs = a.q.data() + m0 * K + b * QK8;
#pragma GCC unroll 8
    for (int k4 = 0; k4 < 8; ++k4) {
      const __m512i W = _mm512_load_si512(T.q[k4]);
#pragma GCC unroll 6
      for (int m = 0; m < R; ++m) {
        int32_t xv;
        std::memcpy(&xv, xs + m * K + 4 * k4, 4);
        S[m] = _mm512_dpbusd_epi32(S[m], W, _mm512_set1_epi32(xv));
      }
    }
    const __m512 D = _mm512_load_ps(T.d);
    for (int m = 0; m < R; ++m) {
      const int16_t* bs = a.bs.data() + (m0 + m) * (K / 16) + 2 * b;
      const __m512i c = _mm512_set1_epi32(off * (static_cast<int32_t>(bs[0]) + bs[1]));
      const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(S[m], c));
      acc[m] = _mm512_fmadd_ps(f, _mm512_mul_ps(D, _mm512_set1_ps(a.d[(m0 + m) * nb + b])), acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, acc[m]);
}

KQ_AVX512 void q8_tile_dot_avx512(const QT* t, int64_t nb, const Act& a, int64_t m0, int mr, float* y, int64_t N,
                                  int64_t n0, int nrows, int32_t off) {
  const __mmask16 mask = static_cast<__mmask16>((1u << nrows) - 1u);
  switch (mr) {
    case 1: q8_tile_dot_avx512_t<1>(t, nb, a, m0, y, N, n0, mask, off); break;
    case 2: q8_tile_dot_avx512_t<2>(t, nb, a, m0, y, N, n0, mask, off); break;
    case 3: q8_tile_dot_avx512_t<3>(t, nb, a, m0, y, N, n0, mask, off); break;
    case 4: q8_tile_dot_avx512_t<4>(t, nb, a, m0, y, N, n0, mask, off); break;
    case 5: q8_tile_dot_avx512_t<5>(t, nb, a, m0, y, N, n0, mask, off); break;
    default: q8_tile_dot_avx512_t<6>(t, nb, a, m0, y, N, n0, mask, off); break;
  }
}

// ---------------------------------------------------------------------------------------------------
// Q5_0: directly on the GGUF blocks (activations per 32, as Q8_0)
// ---------------------------------------------------------------------------------------------------
// Per block: the exact integer dot sum q q_x - 16 (bsum_0 + bsum_1), then acc = fma(dot, d_w * d_x, acc).
void q5_dot_generic(const uint8_t* row, int64_t K, const Act& a, int64_t m0, int mr, float* out) {
  const int64_t nb = K / QK8;
  for (int m = 0; m < mr; ++m) {
    const int64_t r = m0 + m;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + 22 * b;
      uint8_t q[32];
      q5_codes(blk, q);
      const int8_t* xq = a.q.data() + r * K + b * QK8;
      const int16_t* bs = a.bs.data() + r * (K / 16) + 2 * b;
      int32_t s = 0;
      for (int i = 0; i < QK8; ++i) s += static_cast<int32_t>(q[i]) * xq[i];
      s -= 16 * (static_cast<int32_t>(bs[0]) + bs[1]);
      acc = std::fma(static_cast<float>(s), f16_at(blk) * a.d[r * nb + b], acc);
    }
    out[m] = acc;
  }
}

// The codes of Q5_0 blocks b0 (bytes 0..31 of the result) and the next one (bytes 32..63; zero when `two` is
// false), natural order: the nibbles of qs, 16 added where qh has the element's bit.
KQ_AVX512 inline __m512i q5_codes_avx512(const uint8_t* b0, bool two) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i s0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 6));
  const __m128i s1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 28)) : _mm_setzero_si128();
  const __m256i c0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(s0, 4), low4), _mm_and_si128(s0, low4));
  const __m256i c1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(s1, 4), low4), _mm_and_si128(s1, low4));
  const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
  uint32_t h0, h1 = 0;
  std::memcpy(&h0, b0 + 2, 4);
  if (two) std::memcpy(&h1, b0 + 24, 4);
  const __mmask64 hb = static_cast<__mmask64>(h0) | (static_cast<__mmask64>(h1) << 32);
  return _mm512_mask_add_epi8(q, hb, q, _mm512_set1_epi8(16));
}

// Decode rows of Q8_0 / Q5_0 (AVX-512): 16 weight rows against one activation row, the rows in the 16 lanes as in
// the tiles, without building one.  Per pair of blocks each row's unsigned codes (Q8_0: w + 128, Q5_0: q) meet
// the activation bytes in one VPDPBUSD (int32 lanes 0-7: block b, 8-15: block b + 1); a transpose-and-add tree
// turns the 16 rows' vectors into two vectors of exact block sums, lane r = row r, then off * bsum comes out and
// the float step is the tile's, lane for lane: acc = fma(float(dot), d_w * d_x, acc), block b then b + 1.
KQ_AVX512 inline __m512i rows16_codes(const uint8_t* blk, int64_t type, bool two) {
  if (type == T_Q5_0) return q5_codes_avx512(blk, two);
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m256i w1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 36)) : _mm256_setzero_si256();
  return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// v[r] (16 int32 lanes each) -> lo (lane r: sum of v[r]'s lanes 0-7) and hi (lanes 8-15); integer adds, exact.
KQ_AVX512 inline void sum16_halves(const __m512i* v, __m512i& lo, __m512i& hi) {
  __m512i t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [r0: 0+2, r1: 0+2, r0: 1+3, r1: 1+3]
    t[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane q: the lane sums of rows 4k .. 4k + 3
    u[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * k], t[2 * k + 1]), _mm512_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
  for (int h = 0; h < 2; ++h)  // [rows 8h..8h+3 lo, same hi, rows 8h+4..8h+7 lo, same hi]
    w[h] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * h], u[2 * h + 1], 0x88), _mm512_shuffle_i32x4(u[2 * h], u[2 * h + 1], 0xDD));
  lo = _mm512_shuffle_i32x4(w[0], w[1], 0x88);
  hi = _mm512_shuffle_i32x4(w[0], w[1], 0xDD);
}

// y[m0 .. m0 + R, n0 .. n0 + nrows) for weight rows w (row stride rb, nrows <= 16) and R activation rows: the
// rows' codes are built once per block pair (in L1) and used against each activation row.
template <int R>
KQ_AVX512 void rows16_dot_avx512_t(const uint8_t* w, int64_t rb, int nrows, int64_t type, const Act& a, int64_t m0,
                                   float* y, int64_t N, int64_t n0) {
  const int64_t K = a.K, nb = K / QK8, bb = type == T_Q8_0 ? 34 : 22;
  const int32_t off = type == T_Q8_0 ? 128 : 16;
  const __mmask16 rows = static_cast<__mmask16>((1u << nrows) - 1u);
  const __m512i ridx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(rb)));
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  // the next 16 rows (contiguous, 16 rb bytes) into cache while these are computed: a decode product streams its
  // weight from memory once (the LM head of a 262k vocabulary: 178 MB per token)
  const uint8_t* next = w + 16 * rb;
  const int64_t lines = (16 * rb + 63) / 64, per = (lines + (nb + 1) / 2 - 1) / ((nb + 1) / 2);
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    for (int64_t l = (b / 2) * per; l < std::min(lines, (b / 2 + 1) * per); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + 64 * l), _MM_HINT_T0);
    __m512i C[16];
    for (int r = 0; r < 16; ++r) C[r] = r < nrows ? rows16_codes(w + r * rb + bb * b, type, two) : _mm512_setzero_si512();
    // the rows' d (f16, the first two bytes of each block) through one gather of 32-bit words per block
    const __m512 D0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, ridx, w + bb * b, 1), low16)));
    const __m512 D1 = two ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, ridx, w + bb * (b + 1), 1), low16))) : D0;
    for (int m = 0; m < R; ++m) {
      const int64_t r0 = m0 + m;
      const __m512i X = _mm512_maskz_loadu_epi32(two ? 0xFFFF : 0x00FF, a.q.data() + r0 * K + b * QK8);
      const int16_t* bs = a.bs.data() + r0 * (K / 16) + 2 * b;
      const float* dx = a.d.data() + r0 * nb + b;
      __m512i P[16];
      for (int r = 0; r < 16; ++r) P[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), C[r], X);
      __m512i lo, hi;
      sum16_halves(P, lo, hi);
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(off * (static_cast<int32_t>(bs[0]) + bs[1])));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(D0, _mm512_set1_ps(dx[0])), acc[m]);
      if (two) {
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(off * (static_cast<int32_t>(bs[2]) + bs[3])));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(D1, _mm512_set1_ps(dx[1])), acc[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, rows, acc[m]);
}

KQ_AVX512 void rows16_dot_avx512(const uint8_t* w, int64_t rb, int nrows, int64_t type, const Act& a, int64_t m0,
                                 int mr, float* y, int64_t N, int64_t n0) {
  switch (mr) {
    case 1: rows16_dot_avx512_t<1>(w, rb, nrows, type, a, m0, y, N, n0); break;
    case 2: rows16_dot_avx512_t<2>(w, rb, nrows, type, a, m0, y, N, n0); break;
    case 3: rows16_dot_avx512_t<3>(w, rb, nrows, type, a, m0, y, N, n0); break;
    default: rows16_dot_avx512_t<4>(w, rb, nrows, type, a, m0, y, N, n0); break;
  }
}

// Decode over K-quants (AVX-512), 16 weight rows in lanes, as the Q8_0 rows above: per super-block each row is
// unpacked into registers (sb_regs_t) and meets the activation rows; its 16 int32 lanes of VPDPWSSD sums are folded
// to 8 and put beside the 8 lanes of its min products, and one transpose-and-add tree (sum16_halves) turns the 16
// rows' vectors into the rows' exact integer sums (lane r = row r): `tot` and `mins`, the same integers as the
// row path's horizontal sums.  The float step is then the prefill tiles' (tile_dot_avx512_t), lane for lane, so the
// outputs are those of the tiles bit for bit.  Against the row path this drops two horizontal sums and the scalar
// float step per row and super-block, the mins' permute (Q4_K/Q5_K: m_j against the pair sums of the bsums) and
// the scalar unpacking of the 6-bit scales.  d and dmin of the 16 rows come through one gather per super-block.
//
// The scales and mins of a Q4_K/Q5_K super-block as 16-bit lanes: 0-7 the sub-blocks' scales, 8-15 their mins
// (scale_min_words in SIMD: the 12 bytes at b + 4 loaded with 4 more, which are codes and ignored).
KQ_AVX512 inline __m256i k4_scales16(const uint8_t* b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // dwords a0, a1, a2, (codes)
  const __m128i t = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i lo = _mm_and_si128(t, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i u = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2);
  const __m128i hi = _mm_and_si128(u, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  // dwords: scales 0-3, scales 4-7, mins 0-3, mins 4-7
  return _mm256_cvtepu8_epi16(_mm_or_si128(lo, hi));
}

template <int R, int64_t TYPE>
KQ_AVX512 void kq_rows16_t(const uint8_t* w, int64_t rb, int nrows, const SbConst& k, const Act& a, int64_t m0,
                           float* y, int64_t N, int64_t n0, const uint8_t* pf, int64_t pf_bytes) {
  constexpr bool K4 = TYPE == T_Q4_K || TYPE == T_Q5_K;
  const int64_t K = a.K, nsb = K / QK_K, sbb = k.sbb;
  const __mmask16 live = static_cast<__mmask16>((1u << nrows) - 1u);
  const __m512i ridx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(rb)));
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  // Q4_K/Q5_K: d and dmin are the block's first dword; Q6_K: d is the high half of the dword at 206
  constexpr int64_t doff = K4 ? 0 : 206;
  const int8_t* xq = a.q.data() + m0 * K;
  const int16_t* bs = a.bs.data() + m0 * (K / 16);
  const float* dx = a.d.data() + m0 * nsb;
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  alignas(64) __m512i V[R][16];
  for (int m = 0; m < R; ++m)
    for (int r = nrows; r < 16; ++r) V[m][r] = _mm512_setzero_si512();
  // the rows the next tasks take, a share per super-block
  const int64_t lines = pf_bytes / 64, per = (lines + nsb - 1) / nsb;
  for (int64_t s = 0; s < nsb; ++s) {
    for (int64_t l = s * per; l < std::min(lines, (s + 1) * per); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(pf + 64 * l), _MM_HINT_T0);
    // per activation row: its 16 bsums (Q6_K: against the 16 groups' mins) or, for Q4_K/Q5_K, the 8 pair sums in
    // lanes 8-15 beside zeros (madd with the scales|mins vector: lanes 4-7 are the mins' products)
    __m256i B[R];
    for (int m = 0; m < R; ++m) {
      const __m256i b16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + m * (K / 16) + s * 16));
      if constexpr (K4) {
        const __m256i pairs = _mm256_madd_epi16(b16, _mm256_set1_epi16(1));  // 8 int32, |.| <= 4064
        const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
        B[m] = _mm256_inserti128_si256(_mm256_setzero_si256(), p16, 1);
      } else {
        B[m] = b16;
      }
    }
    for (int r = 0; r < nrows; ++r) {
      const uint8_t* b = w + r * rb + s * sbb;
      __m512i q[4], sc[4];
      __m256i mn;
      if constexpr (K4) {
        const __m256i v16 = k4_scales16(b);
        const __m512i v = _mm512_zextsi256_si512(v16);
        for (int c = 0; c < 4; ++c) sc[c] = _mm512_permutexvar_epi16(k.ix[c], v);
        mn = v16;
        constexpr int64_t qoff = TYPE == T_Q4_K ? 16 : 48;
        const __m512i a0 = _mm512_loadu_si512(b + qoff), a1 = _mm512_loadu_si512(b + qoff + 64);
        q[0] = _mm512_and_si512(a0, k.low4);
        q[1] = _mm512_and_si512(_mm512_srli_epi16(a0, 4), k.low4);
        q[2] = _mm512_and_si512(a1, k.low4);
        q[3] = _mm512_and_si512(_mm512_srli_epi16(a1, 4), k.low4);
        if constexpr (TYPE == T_Q5_K) {
          const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
          for (int c = 0; c < 4; ++c)
            q[c] = _mm512_mask_add_epi8(q[c], _mm512_test_epi8_mask(H, k.hb[c]), q[c], k.sixteen);
        }
      } else {
        SbRegs u;
        sb_regs_t<T_Q6_K>(b, k, u);
        for (int c = 0; c < 4; ++c) q[c] = u.q[c], sc[c] = u.sc[c];
        mn = u.mn;
      }
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) {
        const int8_t* x = xq + m * K + s * QK_K;
        __m512i P0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(q[0], _mm512_loadu_si512(x)), sc[0]);
        __m512i P1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(q[1], _mm512_loadu_si512(x + 64)), sc[1]);
        P0 = _mm512_dpwssd_epi32(P0, _mm512_maddubs_epi16(q[2], _mm512_loadu_si512(x + 128)), sc[2]);
        P1 = _mm512_dpwssd_epi32(P1, _mm512_maddubs_epi16(q[3], _mm512_loadu_si512(x + 192)), sc[3]);
        const __m512i P = _mm512_add_epi32(P0, P1);
        const __m256i P8 = _mm256_add_epi32(_mm512_castsi512_si256(P), _mm512_extracti64x4_epi64(P, 1));
        const __m256i mi = _mm256_madd_epi16(mn, B[m]);
        V[m][r] = _mm512_inserti64x4(_mm512_castsi256_si512(P8), mi, 1);
      }
    }
    const __m512i dw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, ridx, w + s * sbb + doff, 1);
    __m512 D, DM;
    if constexpr (K4) {
      D = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(dw, low16)));
      DM = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw, 16)));
    } else {
      D = DM = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw, 16)));
    }
    for (int m = 0; m < R; ++m) {
      __m512i tot, mins;
      sum16_halves(V[m], tot, mins);
      __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(tot), D);
      f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), DM, f);
      acc[m] = _mm512_fmadd_ps(f, _mm512_set1_ps(dx[m * nsb + s]), acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, live, acc[m]);
}

template <int64_t TYPE>
KQ_AVX512 void kq_rows16_mr(const uint8_t* w, int64_t rb, int nrows, const SbConst& k, const Act& a, int64_t m0,
                            int mr, float* y, int64_t N, int64_t n0, const uint8_t* pf, int64_t pf_bytes) {
  switch (mr) {
    case 1: kq_rows16_t<1, TYPE>(w, rb, nrows, k, a, m0, y, N, n0, pf, pf_bytes); break;
    case 2: kq_rows16_t<2, TYPE>(w, rb, nrows, k, a, m0, y, N, n0, pf, pf_bytes); break;
    case 3: kq_rows16_t<3, TYPE>(w, rb, nrows, k, a, m0, y, N, n0, pf, pf_bytes); break;
    default: kq_rows16_t<4, TYPE>(w, rb, nrows, k, a, m0, y, N, n0, pf, pf_bytes); break;
  }
}

// Rows n0..n1 (at most 16) of a K-quant W against activation rows m0..m0+mr (mr <= MR) into y (M, N); the rows
// KQ_PF_ROWS further on (the next tasks') are prefetched, within the matrix.
KQ_AVX512 void kq_rows16_avx512(const uint8_t* w, int64_t rb, int64_t type, int64_t n0, int64_t n1, int64_t N_all,
                                const Act& a, int64_t m0, int mr, float* y, int64_t N) {
  const SbConst k = sb_const(type);
  const int nrows = static_cast<int>(n1 - n0);
  const int64_t p0 = std::min(N_all, n0 + KQ_PF_ROWS), p1 = std::min(N_all, n1 + KQ_PF_ROWS);
  const uint8_t* pf = w + p0 * rb;
  const int64_t pf_bytes = (p1 - p0) * rb;
  const uint8_t* wr = w + n0 * rb;
  switch (type) {
    case T_Q4_K: kq_rows16_mr<T_Q4_K>(wr, rb, nrows, k, a, m0, mr, y, N, n0, pf, pf_bytes); break;
    case T_Q5_K: kq_rows16_mr<T_Q5_K>(wr, rb, nrows, k, a, m0, mr, y, N, n0, pf, pf_bytes); break;
    default: kq_rows16_mr<T_Q6_K>(wr, rb, nrows, k, a, m0, mr, y, N, n0, pf, pf_bytes); break;
  }
}

// ---------------------------------------------------------------------------------------------------
// AVX2 (+ FMA + F16C; CPUs without AVX-512 VNNI): the portable path's integers and its float steps, in its order,
// so the two agree bit for bit (tested).  VPMADDUBSW multiplies unsigned codes by the signed activation bytes into
// int16 pairs (K-quants: at most 2 * 63 * 127 = 16002; Q5_0: 2 * 31 * 127; Q8_0 as |w| times x with w's sign,
// at most 2 * 128 * 127 = 32512: nothing saturates), VPMADDWD by the scales (K-quants) or by ones (Q5_0, Q8_0)
// sums them in int32, exact.
//  * K-quants: per weight row and super-block the integer sums P = sum s_g q x and Mi = sum m_g bsum_g (two
//    horizontal sums), then the portable code's scalar step acc += dx * (d * P - dmin * Mi).  Decode (a task with
//    at most 4 activation rows) unpacks each super-block into registers and uses it at once; a task with more
//    rows unpacks its 16 weight rows to the KU layout once (as the portable path does) and runs 4 activation rows
//    at a time against them.
//  * Q8_0 / Q5_0: 8 weight rows in the 8 lanes: per block each row's int32 vector, one transpose-and-add tree
//    (VPHADDD) gives the 8 rows' exact block sums in lanes, and the float step is the portable one lane for lane
//    (Q8_0: acc + (d_w * d_x) * float(s); Q5_0: fma(float(s), d_w * d_x, acc)), block after block.
// Every route computes a row's integers per super-block / block and the same float steps in the same order, so an
// output does not depend on M or on the row's place in the batch either.
// ---------------------------------------------------------------------------------------------------
// (P, Mi) = the lane sums of p and mi
KQ_AVX2 inline void hsum2_avx2(__m256i p, __m256i mi, int32_t& P, int32_t& Mi) {
  const __m256i h = _mm256_hadd_epi32(p, mi);  // [p01 p23 m01 m23 | p45 p67 m45 m67]
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  s = _mm_hadd_epi32(s, s);
  P = _mm_cvtsi128_si32(s);
  Mi = _mm_extract_epi32(s, 1);
}

// lane r = the sum of v[r]'s 8 lanes (integer adds, exact)
KQ_AVX2 inline __m256i sum8_avx2(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// One super-block in registers, the KU layout: q[c] the codes of activation positions 32 c .. 32 c + 31, sc[c] the
// 16-bit scales of VPMADDUBSW's output lanes (pairs of positions), mn the mins of the 16 natural groups.
struct SbRegs2 {
  __m256i q[8], sc[8], mn;
  float d, dmin;
};

template <int64_t TYPE>
__attribute__((always_inline)) KQ_AVX2 inline void sb_regs_avx2(const uint8_t* b, SbRegs2& u) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K) {
    u.d = f16_at(b);
    u.dmin = f16_at(b + 2);
    uint32_t sm[4];
    scale_min_words(b + 4, sm);
    uint8_t s8[8];
    std::memcpy(s8, sm, 8);
    // position chunk c holds sub-block ORD[c] (see ORD): qs bytes 32 (j / 2) .., low nibble for j even
    for (int c = 0; c < 8; ++c) u.sc[c] = _mm256_set1_epi16(s8[ORD[c]]);
    const __m128i m8 = _mm_cvtepu8_epi16(_mm_setr_epi32(static_cast<int>(sm[2]), static_cast<int>(sm[3]), 0, 0));
    u.mn = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
    constexpr int64_t qoff = TYPE == T_Q4_K ? 16 : 48;
    for (int h = 0; h < 2; ++h) {
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + qoff + 64 * h));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + qoff + 64 * h + 32));
      u.q[4 * h] = _mm256_and_si256(a0, low4);
      u.q[4 * h + 1] = _mm256_and_si256(a1, low4);
      u.q[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(a0, 4), low4);
      u.q[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(a1, 4), low4);
    }
    if constexpr (TYPE == T_Q5_K) {  // bit j of qh[l]: the 5th bit of element l of sub-block j
      const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i sixteen = _mm256_set1_epi8(16);
      for (int c = 0; c < 8; ++c) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << ORD[c]));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(H, bit), bit);
        u.q[c] = _mm256_or_si256(u.q[c], _mm256_and_si256(set, sixteen));
      }
    }
    return;
  }
  // Q6_K, natural order: chunk 4 h + k is elements 128 h + 32 k + l, low nibbles of ql[64 h + 32 (k % 2) + l]
  // (high nibbles for k >= 2), high bits (qh[32 h + l] >> 2 k) & 3
  u.d = u.dmin = f16_at(b + 208);
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m256i s2 = _mm256_broadcastsi128_si256(s8);
  for (int c = 0; c < 8; ++c) {  // lanes 0-7: scale of group 2c, 8-15: 2c + 1 (the byte twice, then >> 8)
    const __m256i ctl = _mm256_set_m128i(_mm_set1_epi8(static_cast<char>(2 * c + 1)), _mm_set1_epi8(static_cast<char>(2 * c)));
    u.sc[c] = _mm256_srai_epi16(_mm256_shuffle_epi8(s2, ctl), 8);
  }
  u.mn = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 5);
  for (int h = 0; h < 2; ++h) {
    const __m256i L0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i L1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    u.q[4 * h] = _mm256_or_si256(_mm256_and_si256(L0, low4), _mm256_slli_epi16(_mm256_and_si256(H, _mm256_set1_epi8(0x03)), 4));
    u.q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(L1, low4), _mm256_slli_epi16(_mm256_and_si256(H, _mm256_set1_epi8(0x0C)), 2));
    u.q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), low4), _mm256_and_si256(H, _mm256_set1_epi8(0x30)));
    u.q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), low4),
                                     _mm256_srli_epi16(_mm256_and_si256(H, _mm256_set1_epi8(static_cast<char>(0xC0))), 2));
  }
}

// The super-block's exact integer sums against one activation row: P = sum s q x, Mi = sum m_g bsum_g.
__attribute__((always_inline)) KQ_AVX2 inline void sb_dot_avx2(const __m256i* q, const __m256i* sc, __m256i mn,
                                                               const int8_t* x, const int16_t* bs, int32_t& P,
                                                               int32_t& Mi) {
  __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
  for (int c = 0; c < 8; c += 2) {
    p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * c))), sc[c]));
    p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(_mm256_maddubs_epi16(q[c + 1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * c + 32))), sc[c + 1]));
  }
  const __m256i mi = _mm256_madd_epi16(mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)));
  hsum2_avx2(_mm256_add_epi32(p0, p1), mi, P, Mi);
}

// Decode: rows [0, nrows) of w (stride rb) against activation rows m0 .. m0 + R - 1, each super-block unpacked
// into registers; y[(m0 + m) * N + n0 + r].
template <int R, int64_t TYPE>
KQ_AVX2 void kq_rows_avx2_t(const uint8_t* w, int64_t rb, int nrows, const Act& a, int64_t m0, float* y, int64_t N,
                            int64_t n0) {
  const int64_t K = a.K, nsb = K / QK_K, sbb = row_bytes(TYPE, QK_K);
  for (int r = 0; r < nrows; ++r) {
    float acc[R];
    for (int m = 0; m < R; ++m) acc[m] = 0.f;
    for (int64_t s = 0; s < nsb; ++s) {
      SbRegs2 u;
      sb_regs_avx2<TYPE>(w + r * rb + s * sbb, u);
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) {
        const int64_t row = m0 + m;
        int32_t P, Mi;
        sb_dot_avx2(u.q, u.sc, u.mn, a.q.data() + row * K + s * QK_K, a.bs.data() + row * (K / 16) + s * 16, P, Mi);
        // the portable step (ku_dot_generic), the same float operations in the same order
        acc[m] += a.d[row * nsb + s] * (u.d * static_cast<float>(P) - u.dmin * static_cast<float>(Mi));
      }
    }
    for (int m = 0; m < R; ++m) y[(m0 + m) * N + n0 + r] = acc[m];
  }
}

template <int64_t TYPE>
KQ_AVX2 void kq_rows_avx2_mr(const uint8_t* w, int64_t rb, int nrows, const Act& a, int64_t m0, int mr, float* y,
                             int64_t N, int64_t n0) {
  switch (mr) {
    case 1: kq_rows_avx2_t<1, TYPE>(w, rb, nrows, a, m0, y, N, n0); break;
    case 2: kq_rows_avx2_t<2, TYPE>(w, rb, nrows, a, m0, y, N, n0); break;
    case 3: kq_rows_avx2_t<3, TYPE>(w, rb, nrows, a, m0, y, N, n0); break;
    default: kq_rows_avx2_t<4, TYPE>(w, rb, nrows, a, m0, y, N, n0); break;
  }
}

KQ_AVX2 void kq_rows_avx2(const uint8_t* w, int64_t rb, int64_t type, int nrows, const Act& a, int64_t m0, int mr,
                          float* y, int64_t N, int64_t n0) {
  switch (type) {
    case T_Q4_K: kq_rows_avx2_mr<T_Q4_K>(w, rb, nrows, a, m0, mr, y, N, n0); break;
    case T_Q5_K: kq_rows_avx2_mr<T_Q5_K>(w, rb, nrows, a, m0, mr, y, N, n0); break;
    default: kq_rows_avx2_mr<T_Q6_K>(w, rb, nrows, a, m0, mr, y, N, n0); break;
  }
}

template <int64_t TYPE>
KQ_AVX2 void unpack_avx2_t(const uint8_t* row, int64_t nsb, KU* out) {
  const int64_t sbb = row_bytes(TYPE, QK_K);
  for (int64_t s = 0; s < nsb; ++s) {
    SbRegs2 r;
    sb_regs_avx2<TYPE>(row + s * sbb, r);
    KU& u = out[s];
    u.d = r.d;
    u.dmin = r.dmin;
    for (int c = 0; c < 8; ++c) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(u.q + 32 * c), r.q[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(u.sc + 16 * c), r.sc[c]);
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(u.mn), r.mn);
  }
}

KQ_AVX2 void unpack_avx2(const uint8_t* row, int64_t type, int64_t nsb, KU* out) {
  switch (type) {
    case T_Q4_K: unpack_avx2_t<T_Q4_K>(row, nsb, out); break;
    case T_Q5_K: unpack_avx2_t<T_Q5_K>(row, nsb, out); break;
    default: unpack_avx2_t<T_Q6_K>(row, nsb, out); break;
  }
}

// ku_dot_generic's results, bit for bit: activation rows m0 .. m0 + R - 1 against one unpacked row.
template <int R>
KQ_AVX2 void ku_dot_avx2_t(const KU* w, int64_t nsb, const Act& a, int64_t m0, float* out) {
  const int64_t K = a.K;
  float acc[R];
  for (int m = 0; m < R; ++m) acc[m] = 0.f;
  for (int64_t s = 0; s < nsb; ++s) {
    const KU& u = w[s];
    __m256i q[8], sc[8];
    for (int c = 0; c < 8; ++c) {
      q[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.q + 32 * c));
      sc[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.sc + 16 * c));
    }
    const __m256i mn = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.mn));
#pragma GCC unroll 4
    for (int m = 0; m < R; ++m) {
      const int64_t row = m0 + m;
      int32_t P, Mi;
      sb_dot_avx2(q, sc, mn, a.q.data() + row * K + s * QK_K, a.bs.data() + row * (K / 16) + s * 16, P, Mi);
      acc[m] += a.d[row * nsb + s] * (u.d * static_cast<float>(P) - u.dmin * static_cast<float>(Mi));
    }
  }
  for (int m = 0; m < R; ++m) out[m] = acc[m];
}

KQ_AVX2 void ku_dot_avx2(const KU* w, int64_t nsb, const Act& a, int64_t m0, int mr, float* out) {
  switch (mr) {
    case 1: ku_dot_avx2_t<1>(w, nsb, a, m0, out); break;
    case 2: ku_dot_avx2_t<2>(w, nsb, a, m0, out); break;
    case 3: ku_dot_avx2_t<3>(w, nsb, a, m0, out); break;
    default: ku_dot_avx2_t<4>(w, nsb, a, m0, out); break;
  }
}

// The 32 codes (0..31) of a Q5_0 block, natural order: the nibbles of qs, 16 where qh has the element's bit.
KQ_AVX2 inline __m256i q5_codes_avx2(const uint8_t* blk) {
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), _mm_and_si128(qs, low4));
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  // byte i <- the byte of qh holding bit i, then all ones where bit i is set
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

// Q8_0 / Q5_0: weight rows [0, nrows) (nrows <= 8, stride rb) in lanes against activation rows m0 .. m0 + R - 1.
template <int R, int64_t TYPE>
KQ_AVX2 void rows8_dot_avx2_t(const uint8_t* w, int64_t rb, int nrows, const Act& a, int64_t m0, float* y, int64_t N,
                              int64_t n0) {
  constexpr bool Q8 = TYPE == T_Q8_0;
  constexpr int64_t bb = Q8 ? 34 : 22;
  const int64_t K = a.K, nb = K / QK8;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
  // the next 8 rows (contiguous) into cache while these are computed, a share per block (see rows16_dot_avx512_t)
  const uint8_t* next = w + 8 * rb;
  const int64_t lines = (8 * rb + 63) / 64, per = (lines + nb - 1) / nb;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t l = b * per; l < std::min(lines, (b + 1) * per); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + 64 * l), _MM_HINT_T0);
    alignas(16) uint16_t dh[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    __m256i C[8];  // Q8_0: the int8 weights; Q5_0: the codes
    for (int r = 0; r < 8; ++r) {
      if (r >= nrows) {
        C[r] = _mm256_setzero_si256();
        continue;
      }
      const uint8_t* blk = w + r * rb + bb * b;
      std::memcpy(&dh[r], blk, 2);
      C[r] = Q8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)) : q5_codes_avx2(blk);
    }
    const __m256 D = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
    for (int m = 0; m < R; ++m) {
      const int64_t row = m0 + m;
      const __m256i X = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + row * K + b * QK8));
      __m256i v[8];
      for (int r = 0; r < 8; ++r)
        v[r] = Q8 ? _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(C[r]), _mm256_sign_epi8(X, C[r])), ones)
                  : _mm256_madd_epi16(_mm256_maddubs_epi16(C[r], X), ones);
      __m256i S = sum8_avx2(v);
      const __m256 dd = _mm256_mul_ps(D, _mm256_set1_ps(a.d[row * nb + b]));
      if constexpr (Q8) {  // q8_dot_generic: acc += (d_w * d_x) * float(s)
        acc[m] = _mm256_add_ps(acc[m], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(S)));
      } else {  // q5_dot_generic: s - 16 * (bsum_0 + bsum_1), then fma(float(s), d_w * d_x, acc)
        const int16_t* bs = a.bs.data() + row * (K / 16) + 2 * b;
        S = _mm256_sub_epi32(S, _mm256_set1_epi32(16 * (static_cast<int32_t>(bs[0]) + bs[1])));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), dd, acc[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[m]);
    std::memcpy(y + (m0 + m) * N + n0, out, sizeof(float) * nrows);
  }
}

template <int64_t TYPE>
KQ_AVX2 void rows8_dot_avx2_mr(const uint8_t* w, int64_t rb, int nrows, const Act& a, int64_t m0, int mr, float* y,
                               int64_t N, int64_t n0) {
  switch (mr) {
    case 1: rows8_dot_avx2_t<1, TYPE>(w, rb, nrows, a, m0, y, N, n0); break;
    case 2: rows8_dot_avx2_t<2, TYPE>(w, rb, nrows, a, m0, y, N, n0); break;
    case 3: rows8_dot_avx2_t<3, TYPE>(w, rb, nrows, a, m0, y, N, n0); break;
    default: rows8_dot_avx2_t<4, TYPE>(w, rb, nrows, a, m0, y, N, n0); break;
  }
}

KQ_AVX2 void rows8_dot_avx2(const uint8_t* w, int64_t rb, int nrows, int64_t type, const Act& a, int64_t m0, int mr,
                            float* y, int64_t N, int64_t n0) {
  if (type == T_Q8_0)
    rows8_dot_avx2_mr<T_Q8_0>(w, rb, nrows, a, m0, mr, y, N, n0);
  else
    rows8_dot_avx2_mr<T_Q5_0>(w, rb, nrows, a, m0, mr, y, N, n0);
}

// ---------------------------------------------------------------------------------------------------
// F16 (float fallback: no activation quantization)
// ---------------------------------------------------------------------------------------------------
void f16_dot_generic(const uint8_t* row, int64_t K, const float* x, int mr, float* out) {
  for (int m = 0; m < mr; ++m) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += f16_at(row + 2 * k) * x[m * K + k];
    out[m] = acc;
  }
}

KQ_AVX512 void f16_dot_avx512(const uint8_t* row, int64_t K, const float* x, int mr, float* out) {
  for (int m0 = 0; m0 < mr; m0 += MR) {
    const int R = std::min(MR, mr - m0);
    __m512 acc[MR] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mk = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1u);
      const __m512 w = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, row + 2 * k));
      for (int m = 0; m < R; ++m)
        acc[m] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mk, x + (m0 + m) * K + k), acc[m]);
    }
    for (int m = 0; m < R; ++m) out[m0 + m] = _mm512_reduce_add_ps(acc[m]);
  }
}

// ---------------------------------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------------------------------
// One product's tasks: y (M, ldy) columns [0, N) = x (M, K) @ W^T, W = N rows of GGUF bytes (row stride rb),
// the activations quantized for W's type.  A task is 16 weight rows against up to MT activation rows.
struct Product {
  const uint8_t* w;
  int64_t type, N, K, rb, M;
  const Act* a;
  float* y;
  int64_t ldy, ntn, ntm, tasks;
};

Product make_product(const uint8_t* w, int64_t type, int64_t N, int64_t K, const Act* a, int64_t M, float* y,
                     int64_t ldy) {
  const int64_t ntn = (N + NT - 1) / NT, ntm = (M + MT - 1) / MT;
  return {w, type, N, K, row_bytes(type, K), M, a, y, ldy, ntn, ntm, ntn * ntm};
}

struct Scratch {  // a thread's, reused across tasks and calls
  std::vector<KU> ku;
  std::vector<KT> tiles;
  std::vector<QT> qtiles;
};

template <class T>
T* room(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

void run_task(const Product& p, int64_t t) {
  static thread_local Scratch s;
  const bool fast = use_avx512(), avx2 = !fast && use_avx2();
  const Act& a = *p.a;
  const uint8_t* w = p.w;
  const int64_t K = p.K, N = p.ldy, rb = p.rb, type = p.type, nsb = K / QK_K;
  const bool kq = !per32(type), q8 = type == T_Q8_0;
  // prefill: tasks of one weight tile over every activation tile run on one thread in a row (the tile stays in
  // cache); decode: ntm == 1
  const bool big = p.M > MT;
  const int64_t tn = big ? t / p.ntm : t, tm = big ? t % p.ntm : 0;
  const int64_t n0 = tn * NT, n1 = std::min(p.N, n0 + NT), m0 = tm * MT, m1 = std::min(p.M, m0 + MT);
  float* y = p.y;
  float out[MR];
  if (!kq && fast && m1 - m0 >= TILE_MIN_M) {
    QT* qt = room(s.qtiles, K / QK8);
    build_p32_tile(w + n0 * rb, rb, static_cast<int>(n1 - n0), K / QK8, type, qt);
    for (int64_t m = m0; m < m1; m += TILE_MR) {
      const int mr = static_cast<int>(std::min<int64_t>(TILE_MR, m1 - m));
      q8_tile_dot_avx512(qt, K / QK8, a, m, mr, y, N, n0, static_cast<int>(n1 - n0), q8 ? 128 : 16);
    }
    return;
  }
  if (!kq && fast) {  // decode: 16 rows in lanes per activation row, the tiles' float steps
    for (int64_t m = m0; m < m1; m += MR)
      rows16_dot_avx512(w + n0 * rb, rb, static_cast<int>(n1 - n0), type, a, m,
                        static_cast<int>(std::min<int64_t>(MR, m1 - m)), y, N, n0);
    return;
  }
  if (!kq && avx2) {  // 8 rows in lanes, 4 activation rows at a time (decode and prefill alike)
    for (int64_t g = n0; g < n1; g += 8)
      for (int64_t m = m0; m < m1; m += MR)
        rows8_dot_avx2(w + g * rb, rb, static_cast<int>(std::min<int64_t>(8, n1 - g)), type, a, m,
                       static_cast<int>(std::min<int64_t>(MR, m1 - m)), y, N, g);
    return;
  }
  if (!kq) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = m0; m < m1; m += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
        (q8 ? q8_dot_generic : q5_dot_generic)(w + n * rb, K, a, m, mr, out);
        for (int i = 0; i < mr; ++i) y[(m + i) * N + n] = out[i];
      }
    return;
  }
  if (m1 - m0 <= MR) {  // decode: each super-block unpacked into registers and used at once
    const int mr = static_cast<int>(m1 - m0);
    if (fast) {
      kq_rows16_avx512(w, rb, type, n0, n1, p.N, a, m0, mr, y, N);
      return;
    }
    if (avx2) {
      kq_rows_avx2(w + n0 * rb, rb, type, static_cast<int>(n1 - n0), a, m0, mr, y, N, n0);
      return;
    }
    KU* u = room(s.ku, nsb);
    for (int64_t n = n0; n < n1; ++n) {
      unpack_generic(w + n * rb, type, nsb, u);
      ku_dot_generic(u, nsb, a, m0, mr, out);
      for (int i = 0; i < mr; ++i) y[(m0 + i) * N + n] = out[i];
    }
    return;
  }
  KU* scratch = room(s.ku, NT * nsb);
  for (int64_t n = n0; n < n1; ++n) {
    if (fast)
      unpack_avx512(w + n * rb, type, nsb, scratch + (n - n0) * nsb);
    else if (avx2)
      unpack_avx2(w + n * rb, type, nsb, scratch + (n - n0) * nsb);
    else
      unpack_generic(w + n * rb, type, nsb, scratch + (n - n0) * nsb);
  }
  if (fast && m1 - m0 >= TILE_MIN_M) {
    const KU* rows[NT];
    for (int64_t n = n0; n < n1; ++n) rows[n - n0] = scratch + (n - n0) * nsb;
    const int gs = scale_group_size(type);
    KT* tiles = room(s.tiles, nsb);
    build_tile(rows, static_cast<int>(n1 - n0), nsb, gs, tiles);
    for (int64_t m = m0; m < m1; m += TILE_MR) {
      const int mr = static_cast<int>(std::min<int64_t>(TILE_MR, m1 - m));
      tile_dot_avx512(tiles, nsb, gs, a, m, mr, y, N, n0, static_cast<int>(n1 - n0));
    }
    return;
  }
  for (int64_t m = m0; m < m1; m += MR) {  // MR activation rows stay in L1 against the tile's rows
    const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
    for (int64_t n = n0; n < n1; ++n) {
      const KU* u = scratch + (n - n0) * nsb;
      if (fast)
        ku_dot_avx512(u, nsb, a, m, mr, out);
      else if (avx2)
        ku_dot_avx2(u, nsb, a, m, mr, out);
      else
        ku_dot_generic(u, nsb, a, m, mr, out);
      for (int i = 0; i < mr; ++i) y[(m + i) * N + n] = out[i];
    }
  }
}

// The tasks of several products in one parallel region (or on the calling thread when there is little work).
void run_products(const Product* ps, int64_t np) {
  int64_t tasks = 0, work = 0;
  for (int64_t i = 0; i < np; ++i) {
    tasks += ps[i].tasks;
    work += ps[i].N * ps[i].K * std::min<int64_t>(ps[i].M, 8);
  }
  const auto task = [&](int64_t t) {
    int64_t i = 0;
    while (t >= ps[i].tasks) t -= ps[i++].tasks;
    run_task(ps[i], t);
  };
  if (tasks > 1 && work >= PAR_MIN_WORK) {
    kvk::parallel_tasks(tasks, task);
  } else {
    for (int64_t t = 0; t < tasks; ++t) task(t);
  }
}

void f16_matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
  const bool fast = use_avx512();
  const int64_t rb = row_bytes(T_F16, K);
  const auto rows = [&](int64_t r0, int64_t r1) {
    float out[MT];
    for (int64_t n = r0; n < r1; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int mr = static_cast<int>(std::min<int64_t>(MT, M - m0));
        if (fast)
          f16_dot_avx512(w + n * rb, K, x + m0 * K, mr, out);
        else
          f16_dot_generic(w + n * rb, K, x + m0 * K, mr, out);
        for (int m = 0; m < mr; ++m) y[(m0 + m) * ldy + n] = out[m];
      }
  };
  if (N * K * std::min<int64_t>(M, 8) >= PAR_MIN_WORK)
    kvk::parallel_for(0, N, NT, rows);
  else
    rows(0, N);
}

// The calling thread's quantized activations for a weight type: one per layout (blocks of 32 or super-blocks
// of 256, natural or Q4_K/Q5_K sub-block order), reused across calls.
Act& act_for(int64_t type) {
  static thread_local Act acts[4];
  return acts[(per32(type) ? 2 : 0) + (nibble_order(type) ? 1 : 0)];
}

// y (M, N) row-major = x (M, K) @ W^T, W = N rows of GGUF bytes.
void matmul_raw(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t type, int64_t N, float* y) {
  if (M == 0 || N == 0) return;
  if (type == T_F16) {
    f16_matmul(x, M, K, w, N, y, N);
    return;
  }
  Act& a = act_for(type);
  quantize_act(x, M, K, type, a);
  const Product p = make_product(w, type, N, K, &a, M, y, N);
  run_products(&p, 1);
}

// Several weights against one x in one parallel region (a layer's q, k and v; gate and up): x is quantized once
// per activation layout.  outs[i] (M, ldy[i]) columns [0, N[i]) = x @ W_i^T.
void matmul_many(const float* x, int64_t M, int64_t K, const uint8_t* const* w, const int64_t* type,
                 const int64_t* N, float* const* outs, const int64_t* ldy, int64_t count) {
  if (M == 0) return;
  std::vector<Product> ps;
  bool done[4] = {false, false, false, false};
  for (int64_t i = 0; i < count; ++i) {
    if (type[i] == T_F16) {  // F16 has no quantized activations: on its own
      f16_matmul(x, M, K, w[i], N[i], outs[i], ldy[i]);
      continue;
    }
    const int key = (per32(type[i]) ? 2 : 0) + (nibble_order(type[i]) ? 1 : 0);
    Act& a = act_for(type[i]);
    if (!done[key]) quantize_act(x, M, K, type[i], a);
    done[key] = true;
    ps.push_back(make_product(w[i], type[i], N[i], K, &a, M, outs[i], ldy[i]));
  }
  run_products(ps.data(), static_cast<int64_t>(ps.size()));
}

const uint8_t* weight_ptr(const torch::Tensor& w, int64_t type, int64_t N, int64_t K) {
  check_k(type, K);
  TORCH_CHECK(w.scalar_type() == at::kByte, "kquant: w must be a uint8 tensor of GGUF bytes, got ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "kquant: w must be a contiguous CPU tensor");
  const int64_t rb = row_bytes(type, K);
  TORCH_CHECK(w.numel() == N * rb, "kquant: w has ", w.numel(), " bytes, expected N*row_bytes = ", N, "*", rb);
  return w.data_ptr<uint8_t>();
}

// x (M, K) float32, w (N, row_bytes) uint8 GGUF bytes -> (M, N) float32
torch::Tensor kq_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t N, int64_t K) {
  const uint8_t* wp = weight_ptr(w, type, N, K);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "kq_matmul: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "kq_matmul: x has ", x.size(1), " columns, K=", K);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (type == T_F16 && M > F16_MM_MIN_M) {
    // prefill over F16: torch's float32 GEMM on chunks of rows converted to float32 (no int8 path)
    const auto wh = torch::from_blob(const_cast<uint8_t*>(wp), {N, K}, torch::dtype(at::kHalf));
    for (int64_t n0 = 0; n0 < N; n0 += F16_MM_ROWS) {
      const int64_t len = std::min<int64_t>(F16_MM_ROWS, N - n0);
      y.narrow(1, n0, len).copy_(at::mm(xc, wh.narrow(0, n0, len).to(at::kFloat).t()));
    }
    return y;
  }
  matmul_raw(xc.data_ptr<float>(), M, K, wp, type, N, y.data_ptr<float>());
  return y;
}

void dequantize_row(const uint8_t* row, int64_t type, int64_t K, float* out) {
  if (type == T_F16) {
    for (int64_t k = 0; k < K; ++k) out[k] = f16_at(row + 2 * k);
  } else if (type == T_Q8_0) {
    for (int64_t b = 0; b < K / QK8; ++b) {
      const float d = f16_at(row + 34 * b);
      const int8_t* q = reinterpret_cast<const int8_t*>(row + 34 * b + 2);
      for (int i = 0; i < QK8; ++i) out[b * QK8 + i] = d * q[i];
    }
  } else if (type == T_Q5_0) {
    for (int64_t b = 0; b < K / QK8; ++b) {
      uint8_t q[32];
      q5_codes(row + 22 * b, q);
      const float d = f16_at(row + 22 * b);
      for (int i = 0; i < QK8; ++i) out[b * QK8 + i] = d * static_cast<float>(static_cast<int>(q[i]) - 16);
    }
  } else {
    const int64_t sbb = row_bytes(type, QK_K);
    uint8_t qn[256];
    int16_t sg[16], mg[16];
    float d, dmin;
    for (int64_t s = 0; s < K / QK_K; ++s) {
      decode_sb(row + s * sbb, type, qn, sg, mg, d, dmin);
      for (int e = 0; e < 256; ++e) {
        const int g = e / 16;
        out[s * QK_K + e] = type == T_Q6_K ? d * static_cast<float>(sg[g]) * static_cast<float>(qn[e] - 32)
                                           : d * static_cast<float>(sg[g]) * qn[e] - dmin * static_cast<float>(mg[g]);
      }
    }
  }
}

// w (N, row_bytes) GGUF bytes -> float32 (R, K) of the rows `rows` (int64 (R,); None: every row)
torch::Tensor kq_dequantize_rows(const torch::Tensor& w, int64_t type, int64_t N, int64_t K,
                                 const c10::optional<torch::Tensor>& rows) {
  const uint8_t* wp = weight_ptr(w, type, N, K);
  const int64_t rb = row_bytes(type, K);
  torch::Tensor idx;
  if (rows.has_value()) {
    idx = rows->to(at::kLong).contiguous().view({-1});
  } else {
    idx = torch::arange(N, torch::dtype(at::kLong));
  }
  const int64_t R = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "kq_dequantize_rows: row ", ip[i], " out of [0, ", N, ")");
  auto out = torch::empty({R, K}, torch::dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  kvk::parallel_for(0, R, std::max<int64_t>(1, (int64_t(1) << 16) / K), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequantize_row(wp + ip[i] * rb, type, K, op + i * K);
  });
  return out;
}

}  // namespace kquant

void register_kquant(pybind11::module_& m) {
  m.def("kq_matmul", &kquant::kq_matmul,
        "y (M, N) float32 = x (M, K) float32 @ W^T, W the GGUF bytes (N, row_bytes) uint8 of a Q4_K (12), Q5_K (13), "
        "Q6_K (14), Q5_0 (6), Q8_0 (8) or F16 (1) tensor, computed in place (see csrc/cpu/kquant.cpp)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("ggml_type"), pybind11::arg("N"), pybind11::arg("K"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("kq_dequantize_rows", &kquant::kq_dequantize_rows,
        "float32 (R, K) of rows `rows` (int64; None: all N) of GGUF bytes w (N, row_bytes) uint8",
        pybind11::arg("w"), pybind11::arg("ggml_type"), pybind11::arg("N"), pybind11::arg("K"),
        pybind11::arg("rows") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("kq_row_bytes", &kquant::row_bytes, "bytes of one GGUF row of K elements of a GGML type",
        pybind11::arg("ggml_type"), pybind11::arg("K"));
  m.def("kq_set_isa", &kquant::set_isa,
        "force the kquant kernels' ISA: auto (avx512, else avx2, else generic), generic, avx2 or avx512 (tests)");
  m.def("kq_isa", &kquant::isa, "the ISA the kquant kernels use now: avx512, avx2 or generic");
  m.def("kq_cpu_has_avx512", &kquant::cpu_has_avx512, "whether this CPU has AVX-512 F/BW/VL/DQ + VNNI + F16C + FMA");
  m.def("kq_cpu_has_avx2", &kvk::cpu_has_avx2, "whether this CPU has AVX2 + FMA + F16C");
}
