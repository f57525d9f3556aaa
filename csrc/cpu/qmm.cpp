// 1. qmm: y (M, N) = x (M, K) @ W^T, W given as blocks of 32 weights with w = d * u + m, where u is an
//    unsigned 4-bit (Q4_0, Q4_1) or 8-bit (Q8_0) code and d, m are float16 per (row, block).  Q4_1 maps as
//    is (m = its min), Q4_0 as m = -8d, Q8_0 as u = q + 128, m = -128d (all exact).  The activations are
//    quantized per row and block of 32 to int8 with scale dx = max|x| / 127 and the sum
//    sx = dx * sum(q) (llama.cpp's Q8_1), so that
//        sum_k w_k x_k ~= sum_blocks d * dx * sum(u_k q_k) + m * sx,
//    the integer dot product being exact.  This is ggml's Q4_1 x Q8_1 dot product (llama.cpp,
//    ggml-cpu/quants.c ggml_vec_dot_q4_1_q8_1), laid out for AVX-512 VNNI: weights are interleaved 16
//    output rows at a time (see kvkeeper.weights.formats) so that one VPDPBUSD multiplies
//    4 codes of each of 16 rows by 4 activation bytes broadcast to every lane, and 8 of them complete one
//    block for 16 rows; the int32 lanes are then the 16 rows' block sums, scaled and accumulated in fp32
//    (the interleaved "repacked" layouts of ggml-cpu/repack.cpp follow the same idea).
#include "common.h"

namespace kvk {

namespace {
// ---------------------------------------------------------------------------------------------------
// 1. activation quantization, per row and block of 32: x ~= dx * q with q = round(x / dx) integer and
//    sx = dx * sum(q) (llama.cpp's Q8_1 keeps that scaled sum too).  16-bit (default): dx = max|x| / 32639 and
//    q = 256 * q_hi + q_lo with q_hi = floor(q / 256 + 1/2) in [-127, 127] and q_lo in [-128, 127], both int8, so
//    the u8 x s8 dot products (VPDPBUSD) run twice per block and sum(u q) = 256 sum(u q_hi) + sum(u q_lo) exactly.
//    8-bit: dx = max|x| / 127, q_hi = q, no q_lo (llama.cpp's precision: faster, less exact).
//    Layout: a row of xq holds K bytes of q_hi then, in 16-bit mode, K bytes of q_lo.
// ---------------------------------------------------------------------------------------------------
constexpr float Q16MAX = 32639.f;  // 127 * 257: q_hi stays within int8
bool g_act16 = true;
}  // namespace

int activation_bits() { return g_act16 ? 16 : 8; }

void set_activation_bits(int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 16, "activation bits must be 8 or 16, got ", bits);
  g_act16 = bits == 16;
}

namespace {
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
  // Each block's codes are decoded once for every row of x (not once per row): the sums per (row, output) are
  // the same integers and the float updates run in the same order over the blocks, so the result is unchanged.
  constexpr int BYTES = BITS == 4 ? 256 : 512;
  const int rows = static_cast<int>(std::min<int64_t>(16, N - n0));
  const int64_t xs = xq_stride(K);
  std::vector<float> acc(static_cast<size_t>(M) * 16, 0.0f);
  uint8_t codes[16][QK];
  float dw[16], mw[16];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = qs + b * BYTES;
    const uint16_t* s = sc + b * 32;
    for (int i = 0; i < 16; ++i) {
      for (int k = 0; k < QK; ++k) codes[i][k] = static_cast<uint8_t>(code_at<BITS>(blk, i, k));
      dw[i] = half_to_float(s[i]);
      mw[i] = half_to_float(s[16 + i]);
    }
    for (int64_t r = 0; r < M; ++r) {
      const int8_t* xb = xq + r * xs + b * QK;
      float* a = acc.data() + r * 16;
      for (int i = 0; i < 16; ++i) {
        int isum = 0;
        for (int k = 0; k < QK; ++k) isum += static_cast<int>(codes[i][k]) * static_cast<int>(xb[k]);
        if (g_act16) {
          int lo = 0;
          for (int k = 0; k < QK; ++k) lo += static_cast<int>(codes[i][k]) * static_cast<int>(xb[K + k]);
          isum = isum * 256 + lo;
        }
        a[i] = std::fma(static_cast<float>(isum), dw[i] * dx[r * nb + b], a[i]);
        a[i] = std::fma(mw[i], sx[r * nb + b], a[i]);
      }
    }
  }
  for (int64_t r = 0; r < M; ++r)
    for (int i = 0; i < rows; ++i) y[r * N + n0 + i] = acc[r * 16 + i];
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

// ---------------------------------------------------------------------------------------------------
// 1. qmm, AVX2 (CPUs without AVX-512 VNNI): the same integer block sums and the same float updates in the same
//    order as the AVX-512 and generic paths, so the three agree bit for bit.  A 256-bit vector holds 8 of a
//    group's 16 output rows (half h: bytes 32h..32h+31 of every 64-byte slice).  VPMADDUBSW multiplies the
//    unsigned codes by the signed activation bytes and adds adjacent pairs into int16; with 4-bit codes a pair
//    is at most 2 * 15 * 128 = 3840 in size and the 8 slices of a block 30720 < 2^15, so nothing saturates.
//    An 8-bit code is taken as two 4-bit halves, u = 16 uh + ul.  VPMADDWD by ones then adds the int16 pairs
//    of a row into its int32 block sum (exact).
// ---------------------------------------------------------------------------------------------------
// Four activation bytes broadcast to every 32-bit lane.
KVK_AVX2 inline __m256i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// One half (8 rows) of a group over every block, for MT rows of x.  Slice by slice: the slice's codes are split into
// their 4-bit halves once and multiplied with each row's activation bytes, broadcast straight from xq, into int16
// accumulators per row (one per activation byte, and per code half for 8-bit codes); at the end of a block each
// accumulator becomes the int32 block sum (VPMADDWD by ones, exact) and the float updates follow.  The accumulators
// and the row's float sums stay in registers (a row's int16 additions come in another order than slice by slice of
// one code half, and are exact either way: nothing wraps).
template <int BITS, int MT, bool A16>
KVK_AVX2 inline void qmm_half_avx2(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* xq,
                                   const float* dx, const float* sx, int64_t K, int h, __m256* acc) {
  const int64_t xs = A16 ? 2 * K : K;
  constexpr int BYTES = BITS == 4 ? 256 : 512, SLICES = BITS == 4 ? 4 : 8;
  constexpr int NA = A16 ? 2 : 1;  // activation bytes: high (then low) of each 16-bit code
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = qs + b * BYTES + 32 * h;
    // 4-bit codes: lo[m][a] sums over all 32 elements; 8-bit codes: lo the low code halves, hi the high ones
    __m256i lo[MT][NA], hi[MT][NA];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < NA; ++a) lo[m][a] = hi[m][a] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < SLICES; ++s) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s));
      const __m256i wl = _mm256_and_si256(v, low4), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 2
        for (int a = 0; a < NA; ++a) {
          const int8_t* x = xq + m * xs + a * K + b * QK;
          if (BITS == 4) {  // the low halves: elements 4s..4s+3; the high halves: elements 16+4s..16+4s+3
            lo[m][a] = _mm256_add_epi16(lo[m][a], _mm256_maddubs_epi16(wl, bcast(x + 4 * s)));
            lo[m][a] = _mm256_add_epi16(lo[m][a], _mm256_maddubs_epi16(wh, bcast(x + 16 + 4 * s)));
          } else {  // both halves of elements 4s..4s+3
            const __m256i xb = bcast(x + 4 * s);
            lo[m][a] = _mm256_add_epi16(lo[m][a], _mm256_maddubs_epi16(wl, xb));
            hi[m][a] = _mm256_add_epi16(hi[m][a], _mm256_maddubs_epi16(wh, xb));
          }
        }
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * 32 + 8 * h)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * 32 + 16 + 8 * h)));
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      __m256i sum[NA];
#pragma GCC unroll 2
      for (int a = 0; a < NA; ++a) {
        sum[a] = _mm256_madd_epi16(lo[m][a], ones);
        if (BITS == 8) sum[a] = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi[m][a], ones), 4), sum[a]);
      }
      const __m256i is = A16 ? _mm256_add_epi32(_mm256_slli_epi32(sum[0], 8), sum[NA - 1]) : sum[0];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(dw, _mm256_set1_ps(dx[m * nb + b])), acc[m]);
      acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[m * nb + b]), acc[m]);
    }
  }
}

template <int BITS, int MT, bool A16>
KVK_AVX2 inline void qmm_tile_avx2(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* xq,
                                   const float* dx, const float* sx, int64_t K, float* y, int64_t N, int64_t n0,
                                   int rows) {
  alignas(32) float out[MT][16];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MT];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    qmm_half_avx2<BITS, MT, A16>(qs, sc, nb, xq, dx, sx, K, h, acc);
    for (int m = 0; m < MT; ++m) _mm256_store_ps(out[m] + 8 * h, acc[m]);
  }
  for (int m = 0; m < MT; ++m) std::memcpy(y + m * N + n0, out[m], sizeof(float) * rows);
}

template <int BITS, bool A16>
KVK_AVX2 void qmm_group_avx2(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* xq, const float* dx,
                             const float* sx, int64_t M, int64_t K, float* y, int64_t N, int64_t n0) {
  const int rows = static_cast<int>(std::min<int64_t>(16, N - n0));
  const int64_t xs = A16 ? 2 * K : K;
  // rows of x per tile: what the int16 accumulators (per row: 1 for 4-bit codes, 2 for 8-bit, twice that for 16-bit
  // activations) and the float sums leave of the 16 vector registers (4-bit codes, 16-bit activations, a 1000-token
  // prefill of the embedded model on the AMD EPYC: 3 rows a tile beat 4 and 6)
  constexpr int MT = BITS == 8 && A16 ? 2 : 3;
  int64_t r = 0;
  for (; r + MT <= M; r += MT)
    qmm_tile_avx2<BITS, MT, A16>(qs, sc, nb, xq + r * xs, dx + r * nb, sx + r * nb, K, y + r * N, N, n0, rows);
  const int8_t* xr = xq + r * xs;
  const float* dr = dx + r * nb;
  const float* sr = sx + r * nb;
  float* yr = y + r * N;
  switch (M - r) {
    case 0: break;
    case 1: qmm_tile_avx2<BITS, 1, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, rows); break;
    default: qmm_tile_avx2<BITS, 2, A16>(qs, sc, nb, xr, dr, sr, K, yr, N, n0, rows); break;  // 2 left of MT = 3
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
}  // namespace

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
  const bool fast = use_avx512(), avx2 = use_avx2();
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
  parallel_for(0, w.groups, grain, [&](int64_t g0, int64_t g1) {
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
      } else if (avx2) {
        const uint8_t* qg = q + g * qstride;
        const uint16_t* sg = scp + g * sstride;
        if (bits == 4 && a16)
          qmm_group_avx2<4, true>(qg, sg, nb, xq, dx, sx, M, K, y, N, 16 * g);
        else if (bits == 4)
          qmm_group_avx2<4, false>(qg, sg, nb, xq, dx, sx, M, K, y, N, 16 * g);
        else if (a16)
          qmm_group_avx2<8, true>(qg, sg, nb, xq, dx, sx, M, K, y, N, 16 * g);
        else
          qmm_group_avx2<8, false>(qg, sg, nb, xq, dx, sx, M, K, y, N, 16 * g);
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

}  // namespace kvk
