// 2. paged attention, reading the K/V blocks in place: decode_attention (below) and extend_attention (2b).
//
//    decode_attention: one query token per sequence over its paged K/V, read in place block by block
//    (no gather), with an online softmax (Milakov & Gimelshein, 2018) and the context split into chunks
//    of a fixed number of blocks whose partial results are combined at the end (flash-decoding, Dao et
//    al., 2023).  K/V storage: float32, bfloat16, float16, int8 or float8 e4m3 with float16 per-token
//    per-head scales (kvkeeper.kvcache.quant).
//
//    Invariant mode (the default, set_invariant_attention): a decode query is computed with exactly the
//    floating-point operations, in exactly the order, that extend_attention (2b) applies to a query lane of a
//    prefill tile: keys in chunks of 16 starting at absolute positions that are multiples of 16, each score a
//    sequential fused multiply-add over the head dimension, the chunk's softmax update and its value sums in key
//    order, the context split only at fixed absolute positions (every kSegKeys = 512 keys: each segment's online
//    softmax runs alone, the segments are combined in order by combine_segments, in both kernels).  Decode runs
//    one task per (row, KV head, segment), so a long context still uses every thread.  A token's attention
//    output then depends only on the keys before it, not on whether it was prefilled (in which tile, chunk or
//    batch) or decoded, nor on the thread count: the batch-invariant approach of vLLM's batch-invariant mode and of
//    He et al., "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025), on CPU, with
//    flash-decoding's split (Dao et al., 2023) at fixed points.  The previous kernel (splits every split_blocks
//    blocks, scores summed by a lane tree) stays available with set_invariant_attention(false); a decoded token's
//    K/V then differs in the last bits from the same token prefilled.
//
//    On a CPU with AVX2 but not AVX-512 both kernels run the portable routine 8 query lanes at a time
//    (attend_lanes_avx2): the same floats, bit for bit, several times faster.
#include "common.h"

namespace kvk {

namespace {
bool g_invariant = true;
}  // namespace

bool invariant_attention() { return g_invariant; }
void set_invariant_attention(bool on) { g_invariant = on; }

namespace {
struct WorkItem {
  int64_t b, blk0, blk1;  // batch row, block range [blk0, blk1) of its table (every KV head)
};

// The first key a row of `len` keys attends to: 0, or len - window in a sliding-window layer.
inline int64_t first_key(const AttnArgs& a, int64_t len) {
  return a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
}

// One work item, portable code: writes the unnormalized output (G, D), the running max (G) and sum (G).
void attn_item_generic(const AttnArgs& a, const WorkItem& it, float* o, float* mx, float* sm) {
  const int64_t G = a.G, D = a.D, H = a.H;
  std::vector<float> kf(D), vf(D);
  for (int64_t i = 0; i < H; ++i) {
    mx[i] = -std::numeric_limits<float>::infinity();
    sm[i] = 0.f;
  }
  for (int64_t i = 0; i < H * D; ++i) o[i] = 0.f;
  const int64_t len = a.ctx[it.b], lo = first_key(a, len);
  for (int64_t blk = it.blk0; blk < it.blk1; ++blk) {
    const int64_t bid = a.bt[it.b * a.W + blk];
    const int64_t n = std::min<int64_t>(a.BS, len - blk * a.BS), t_begin = std::max<int64_t>(0, lo - blk * a.BS);
    for (int64_t h = 0; h < a.KVH; ++h) {
      const float* qb = a.q + (it.b * H + h * G) * D;
      for (int64_t t = t_begin; t < n; ++t) {
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
constexpr int MAXDV_DEC = 16;  // head_dim / 16 at most
// Invariant attention splits a query's keys at these absolute positions (multiples of 16): each segment's online
// softmax runs alone and the segments are combined in order (flash-decoding's split, at fixed points, so that decode
// can run a long context's segments in parallel and still match prefill bit for bit).
constexpr int64_t kSegKeys = 512;

// One query (D floats, not scaled) over keys [lo, hi) of KV head h, portable code: an online softmax key by key
// (Milakov & Gimelshein, 2018) in key order.  Both kernels' portable paths call it, so that a token's result does
// not depend on whether it was decoded or prefilled.
void attend_query_generic(const float* qr, float scale, const void* k, const void* v, const uint16_t* ks,
                          const uint16_t* vs, int64_t kind, const int64_t* bt, int64_t BS, int64_t KVH, int64_t h,
                          int64_t D, int64_t lo, int64_t hi, float* dst) {
  std::vector<float> o(D, 0.f);
  float mx = -std::numeric_limits<float>::infinity(), sm = 0.f;
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t row = (bt[p / BS] * BS + p % BS) * KVH + h;
    const float kscale = ks ? half_to_float(ks[row]) : 1.f;
    const float vscale = vs ? half_to_float(vs[row]) : 1.f;
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += qr[d] * scale * (load_scalar(k, row * D + d, kind) * kscale);
    const float mnew = std::max(mx, dot);
    const float alpha = exp_portable(mx - mnew), pw = exp_portable(dot - mnew);
    sm = sm * alpha + pw;
    for (int64_t d = 0; d < D; ++d) o[d] = o[d] * alpha + pw * (load_scalar(v, row * D + d, kind) * vscale);
    mx = mnew;
  }
  for (int64_t d = 0; d < D; ++d) dst[d] = hi > lo ? o[d] / sm : 0.f;
}

// AVX2 (a CPU without AVX-512): attend_query_generic for 8 query lanes at a time, bit for bit.  A lane is one query
// row (one query head of one token) over its keys [lo, hi) of KV head h; every lane of a call reads the same
// sequence (block table bt).  Each lane's arithmetic is the portable routine's, in its order: the score a sequential
// sum over d of (q[d] * scale) * (k[d] * kscale), separate multiplies and adds (no fused multiply-add: the file is
// built with -ffp-contract=off and the code uses none), the running maximum as std::max, exp_portable lane by lane
// (exp256, common.h), the sum and outputs updated key by key in key order.  Only the layout
// differs: 16 keys are converted to float32 once for all the lanes, four keys' scores are computed side by side.
struct Lane {
  const float* q;  // D floats, not scaled
  float* dst;      // D floats
  int64_t lo, hi;  // keys [lo, hi)
};

struct LaneKV {
  const void *k, *v;
  const uint16_t *ks, *vs;
  int64_t kind, BS, KVH, D;
};

// Row `row` of K or V as float32, times its scale (attend_query_generic's load_scalar(..) * scale, per element).
KVK_AVX2 inline void lane_row_f32(const void* base, const uint16_t* scales, int64_t kind, int64_t row, int64_t D,
                                  float* out) {
  const float sc = scales ? half_to_float(scales[row]) : 1.f;
  if (kind == KV_F32) {
    const float* p = static_cast<const float*>(base) + row * D;
    for (int64_t d = 0; d < D; ++d) out[d] = p[d] * sc;
  } else if (kind == KV_I8) {
    const int8_t* p = static_cast<const int8_t*>(base) + row * D;
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(p[d]) * sc;
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = load_scalar(base, row * D + d, kind) * sc;
  }
}

// One group of up to 8 lanes: scaled queries and outputs transposed (D, 8), running maxima and sums, key ranges.
struct LaneGroup {
  float* qs;
  float* o;
  alignas(32) float m[8], l[8];
  alignas(32) int32_t lo[8], hi[8];
  int64_t kmin, kmax, all_from, all_to;  // keys some lane reads; keys every lane reads
  int nl;
};

// The online softmax step of one key (score s) for the group's lanes in `mask` (every lane when full): the running
// maxima and sums updated, the key's weights returned: alpha for the outputs so far, p for the key's value row.
KVK_AVX2 inline void lane_softmax(LaneGroup& g, __m256 s, bool full, __m256 mask, __m256& alpha, __m256& p) {
  const __m256 m = _mm256_load_ps(g.m), mnew = _mm256_max_ps(s, m);  // std::max(m, s): s > m ? s : m
  // exp256 lane by lane is exp_portable, the portable routine's exp; lanes past the group's last, and a difference
  // of 0 (exp_portable(0) = 1 exactly), take 1 without it
  const __m256 da = _mm256_sub_ps(m, mnew), dp = _mm256_sub_ps(s, mnew), one = _mm256_set1_ps(1.f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(g.nl), lane));
  const __m256 zero = _mm256_setzero_ps();
  alpha = _mm256_blendv_ps(one, exp256(da), _mm256_and_ps(live, _mm256_cmp_ps(da, zero, _CMP_NEQ_UQ)));
  p = _mm256_blendv_ps(one, exp256(dp), _mm256_and_ps(live, _mm256_cmp_ps(dp, zero, _CMP_NEQ_UQ)));
  const __m256 l = _mm256_add_ps(_mm256_mul_ps(_mm256_load_ps(g.l), alpha), p);
  _mm256_store_ps(g.m, full ? mnew : _mm256_blendv_ps(m, mnew, mask));
  _mm256_store_ps(g.l, full ? l : _mm256_blendv_ps(_mm256_load_ps(g.l), l, mask));
}

// ND dims of the group's outputs (o: (ND, 8) floats) over the n keys whose weights are given, held in registers
// across the keys: o = o * alpha + p * v[d] key by key in key order (the portable routine's update of one output),
// a lane outside a partial key's mask kept.  v: the first key's value row at the first of the ND dims (stride D).
template <int ND>
KVK_AVX2 inline void lane_outputs(float* o, const float* v, int64_t D, int n, const __m256* alpha, const __m256* p,
                                  const bool* full, const __m256* mask) {
  __m256 acc[ND];
#pragma GCC unroll 8
  for (int j = 0; j < ND; ++j) acc[j] = _mm256_load_ps(o + j * 8);
  for (int t = 0; t < n; ++t, v += D) {
#pragma GCC unroll 8
    for (int j = 0; j < ND; ++j) {
      const __m256 u = _mm256_add_ps(_mm256_mul_ps(acc[j], alpha[t]), _mm256_mul_ps(p[t], _mm256_broadcast_ss(v + j)));
      acc[j] = full[t] ? u : _mm256_blendv_ps(acc[j], u, mask[t]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < ND; ++j) _mm256_store_ps(o + j * 8, acc[j]);
}

// Keys [a, b) of the converted chunk (rows kf, vf (16, D) from key k0 on; b - a <= 16) for one group: four scores
// side by side, the softmax steps in key order, then the outputs eight dims at a time over all the keys.
KVK_AVX2 void lane_group_keys(LaneGroup& g, const float* kf, const float* vf, int64_t k0, int64_t a, int64_t b,
                              int64_t D) {
  const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.lo));
  const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.hi));
  __m256 alpha[16], p[16], mask[16];
  bool full[16];
  for (int64_t t0 = a; t0 < b; t0 += 4) {
    const int nk = static_cast<int>(std::min<int64_t>(4, b - t0));
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const float* kr = kf + (t0 - k0) * D;
    for (int64_t d = 0; d < D; ++d) {
      const __m256 q = _mm256_load_ps(g.qs + d * 8);
      for (int c = 0; c < 4; ++c)
        if (c < nk) acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(q, _mm256_broadcast_ss(kr + c * D + d)));
    }
    for (int c = 0; c < nk; ++c) {
      const int64_t t = t0 + c, i = t - a;
      full[i] = t >= g.all_from && t < g.all_to;
      const __m256i tv = _mm256_set1_epi32(static_cast<int32_t>(t));
      mask[i] = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lo, tv), _mm256_cmpgt_epi32(hi, tv)));
      lane_softmax(g, acc[c], full[i], mask[i], alpha[i], p[i]);
    }
  }
  const int n = static_cast<int>(b - a);
  const float* v = vf + (a - k0) * D;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) lane_outputs<8>(g.o + d * 8, v + d, D, n, alpha, p, full, mask);
  for (; d < D; ++d) lane_outputs<1>(g.o + d * 8, v + d, D, n, alpha, p, full, mask);
}

// Sets up group `gi` (lanes [8 gi, 8 gi + 8) of `lanes`) in the scratch buffer `buf` ((D, 8) queries, then outputs).
KVK_AVX2 void lane_group_init(LaneGroup& g, const Lane* lanes, int64_t n, int64_t gi, float scale, int64_t D,
                              float* buf) {
  g.qs = buf, g.o = buf + D * 8;
  g.nl = static_cast<int>(std::min<int64_t>(8, n - gi * 8));
  g.kmin = std::numeric_limits<int64_t>::max(), g.kmax = 0, g.all_from = 0, g.all_to = g.kmin;
  for (int j = 0; j < 8; ++j) {
    const Lane* ln = j < g.nl ? lanes + gi * 8 + j : nullptr;
    for (int64_t d = 0; d < D; ++d) g.qs[d * 8 + j] = ln ? ln->q[d] * scale : 0.f;
    g.m[j] = -std::numeric_limits<float>::infinity(), g.l[j] = 0.f;
    g.lo[j] = ln ? static_cast<int32_t>(ln->lo) : 0, g.hi[j] = ln ? static_cast<int32_t>(ln->hi) : 0;
    if (!ln || ln->hi <= ln->lo) continue;
    g.kmin = std::min(g.kmin, ln->lo), g.kmax = std::max(g.kmax, ln->hi);
    g.all_from = std::max(g.all_from, ln->lo), g.all_to = std::min(g.all_to, ln->hi);
  }
  std::fill(g.o, g.o + D * 8, 0.f);
}

// Every lane of `lanes` (n of them, KV head h, block table bt): each lane's D outputs written to its dst.
KVK_AVX2 void attend_lanes_avx2(const Lane* lanes, int64_t n, float scale, const LaneKV& kv, int64_t h,
                                const int64_t* bt) {
  const int64_t D = kv.D, ng = (n + 7) / 8;
  thread_local std::vector<float> buf;
  thread_local std::vector<LaneGroup> groups;
  buf.resize(static_cast<size_t>(ng * 16 * D + 32 * D + 8));
  groups.resize(ng);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~uintptr_t{31});  // 32 B
  int64_t kmin = std::numeric_limits<int64_t>::max(), kmax = 0;
  for (int64_t gi = 0; gi < ng; ++gi) {
    lane_group_init(groups[gi], lanes, n, gi, scale, D, base + gi * 16 * D);
    kmin = std::min(kmin, groups[gi].kmin), kmax = std::max(kmax, groups[gi].kmax);
  }
  float *kf = base + ng * 16 * D, *vf = kf + 16 * D;
  for (int64_t k0 = kmin; k0 < kmax; k0 += 16) {
    const int64_t k1 = std::min(kmax, k0 + 16);
    for (int64_t p = k0; p < k1; ++p) {
      const int64_t row = (bt[p / kv.BS] * kv.BS + p % kv.BS) * kv.KVH + h;
      lane_row_f32(kv.k, kv.ks, kv.kind, row, D, kf + (p - k0) * D);
      lane_row_f32(kv.v, kv.vs, kv.kind, row, D, vf + (p - k0) * D);
    }
    for (auto& g : groups) {
      const int64_t a = std::max(k0, g.kmin), b = std::min(k1, g.kmax);
      if (a < b) lane_group_keys(g, kf, vf, k0, a, b, D);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const LaneGroup& g = groups[i / 8];
    const int j = static_cast<int>(i % 8);
    for (int64_t d = 0; d < D; ++d) lanes[i].dst[d] = lanes[i].hi > lanes[i].lo ? g.o[d * 8 + j] / g.l[j] : 0.f;
  }
}

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

// Keys [k0, k0 + n) of one sequence (block table bt) as float32 rows (n, D) of K and of V, scaled.
KVK_AVX512 inline void kv_chunk_to_f32(const void* k, const void* v, const uint16_t* ks, const uint16_t* vs,
                                       int64_t kind, const int64_t* bt, int64_t BS, int64_t KVH, int64_t h, int64_t D,
                                       int64_t k0, int64_t n, float* kf, float* vf) {
  for (int64_t t = 0; t < n;) {
    const int64_t pos = k0 + t, off = pos % BS;
    const int64_t take = std::min<int64_t>(n - t, BS - off);
    const int64_t slot = bt[pos / BS] * BS + off;
    kv_rows_to_f32(k, ks, kind, slot, take, KVH, h, D, kf + t * D);
    kv_rows_to_f32(v, vs, kind, slot, take, KVH, h, D, vf + t * D);
    t += take;
  }
}

// Permute indices of transpose16's four stages (b = 8, 4, 2, 1), computed at compile time.
struct TransposeIdx {
  alignas(64) int32_t lo[4][16];
  alignas(64) int32_t hi[4][16];
};
constexpr TransposeIdx make_transpose_idx() {
  TransposeIdx t{};
  int s = 0;
  for (int b = 8; b >= 1; b /= 2, ++s)
    for (int j = 0; j < 16; ++j) {
      t.lo[s][j] = (j & b) == 0 ? j : 16 + j - b;
      t.hi[s][j] = (j & b) == 0 ? j + b : 16 + j;
    }
  return t;
}
constexpr TransposeIdx kTransposeIdx = make_transpose_idx();

// Transposes 16 rows of 16 floats in place (r[i] lane j <-> r[j] lane i): four stages, each swapping the
// off-diagonal b x b sub-blocks of every 2b x 2b block (b = 8, 4, 2, 1).
KVK_AVX512 inline void transpose16(__m512* r) {
  int s = 0;
  for (int b = 8; b >= 1; b /= 2, ++s) {
    const __m512i x1 = _mm512_load_si512(kTransposeIdx.lo[s]), x2 = _mm512_load_si512(kTransposeIdx.hi[s]);
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const __m512 lo = _mm512_permutex2var_ps(r[i], x1, r[i + b]);
      const __m512 hi = _mm512_permutex2var_ps(r[i], x2, r[i + b]);
      r[i] = lo, r[i + b] = hi;
    }
  }
}

// Invariant decode (see the top of this file): one query token of row b, the G query heads of KV head h, over
// the keys [k_from, k_to) of one segment (k_from a multiple of 16), with extend_item_avx512's operations for one
// query lane, keys in 16-key chunks from an absolute multiple of 16.  q (B, H, D) is multiplied by a.qscale here
// (as extend multiplies its q by the softmax scale).  Writes the segment's unnormalized outputs po (G, D), running
// maxima pm (G) and sums pl (G) for combine_segments.
template <int G_, int DV>
KVK_AVX512 void decode_item_invariant(const AttnArgs& a, int64_t b, int64_t h, int64_t k_from, int64_t k_to,
                                      float* pm, float* pl, float* po) {
  constexpr int64_t D = 16 * DV;
  constexpr int64_t G = G_;
  const int64_t H = a.H;
  const int64_t ctx = k_to;
  const int64_t lo = first_key(a, a.ctx[b]), kbeg = k_from;
  const int64_t* bt = a.bt + b * a.W;
  const float ninf = -std::numeric_limits<float>::infinity();
  alignas(64) float qs[G_][D];
  alignas(64) float O[G_][D];
  alignas(64) float Kf[2][16][D];  // two chunks at a time: their 2G score chains interleave
  alignas(64) float Vf[2][16][D];
  float m[G_], l[G_];
  for (int64_t g = 0; g < G; ++g) {
    const float* src = a.q + (b * H + h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) qs[g][d] = src[d] * a.qscale;
    for (int64_t d = 0; d < D; ++d) O[g][d] = 0.f;
    m[g] = ninf, l[g] = 0.f;
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t k00 = kbeg; k00 < ctx; k00 += 32) {
    const int nc = k00 + 16 < ctx ? 2 : 1;
    int64_t n[2];
    __m512 Kt[2][D];  // K transposed: Kt[c][d] holds dimension d of chunk c's 16 keys
    for (int c = 0; c < nc; ++c) {
      const int64_t k0 = k00 + 16 * c;
      n[c] = std::min<int64_t>(16, ctx - k0);
      kv_chunk_to_f32(a.k, a.v, a.ks, a.vs, a.kind, bt, a.BS, a.KVH, h, D, k0, n[c], &Kf[c][0][0], &Vf[c][0][0]);
      for (int64_t t = n[c]; t < 16; ++t)
        for (int64_t d = 0; d < D; ++d) Kf[c][t][d] = 0.f;
      for (int dv = 0; dv < DV; ++dv) {
        __m512* r = Kt[c] + 16 * dv;
        for (int t = 0; t < 16; ++t) r[t] = _mm512_load_ps(&Kf[c][t][16 * dv]);
        transpose16(r);
      }
    }
    __m512 acc[2][G_];  // each score chain still in the order d = 0 .. D-1
    for (int c = 0; c < 2; ++c)
      for (int g = 0; g < G_; ++g) acc[c][g] = _mm512_setzero_ps();
    if (nc == 2) {
      for (int64_t d = 0; d < D; ++d)
        for (int g = 0; g < G_; ++g) {
          const __m512 qv = _mm512_set1_ps(qs[g][d]);
          acc[0][g] = _mm512_fmadd_ps(qv, Kt[0][d], acc[0][g]);
          acc[1][g] = _mm512_fmadd_ps(qv, Kt[1][d], acc[1][g]);
        }
    } else {
      for (int64_t d = 0; d < D; ++d)
        for (int g = 0; g < G_; ++g) acc[0][g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g][d]), Kt[0][d], acc[0][g]);
    }
    for (int c = 0; c < nc; ++c) {  // the chunks' softmax updates in key order
      const int64_t k0 = k00 + 16 * c;
      // visible keys: t < n and position >= lo
      const __mmask16 vis = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(n[c]))) &
                            _mm512_cmpge_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(k0))),
                                                    _mm512_set1_epi32(static_cast<int>(lo)));
      // The G heads' chains are independent: each loop below runs them side by side (t outer, g inner) so that
      // their latencies overlap; every chain keeps extend's operations in extend's order (key order), so the
      // result is the same bit for bit as one head at a time.
      alignas(64) float sc[G_][16];
      for (int g = 0; g < G_; ++g) _mm512_store_ps(sc[g], _mm512_mask_mov_ps(_mm512_set1_ps(ninf), vis, acc[c][g]));
      float bm[G_];  // MAXPS order, as extend's running maximum over the chunk's keys
      for (int g = 0; g < G_; ++g) bm[g] = sc[g][0];
      for (int64_t t = 1; t < n[c]; ++t)
        for (int g = 0; g < G_; ++g) bm[g] = bm[g] > sc[g][t] ? bm[g] : sc[g][t];
      alignas(64) float dm[16] = {0.f};
      float msafe[G_], alpha[G_];
      for (int g = 0; g < G_; ++g) {
        const float mnew = m[g] > bm[g] ? m[g] : bm[g];
        msafe[g] = mnew != ninf ? mnew : 0.f;
        dm[g] = m[g] - msafe[g];
      }
      alignas(64) float ex[16];  // exp512 works lane by lane: one call gives every head's alpha
      _mm512_store_ps(ex, exp512(_mm512_load_ps(dm)));
      alignas(64) float PP[G_][16];
      for (int g = 0; g < G_; ++g) {
        alpha[g] = m[g] != ninf ? ex[g] : 0.f;
        const __m512 S = _mm512_load_ps(sc[g]);
        const __mmask16 live = _mm512_cmp_ps_mask(S, _mm512_set1_ps(ninf), _CMP_NEQ_OQ);
        _mm512_store_ps(PP[g], _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(S, _mm512_set1_ps(msafe[g])))));
      }
      float sum[G_];
      for (int g = 0; g < G_; ++g) sum[g] = 0.f;
      for (int64_t t = 0; t < n[c]; ++t)
        for (int g = 0; g < G_; ++g) sum[g] = sum[g] + PP[g][t];
      for (int g = 0; g < G_; ++g) {
        l[g] = l[g] * alpha[g] + sum[g];
        m[g] = m[g] > bm[g] ? m[g] : bm[g];
      }
      // O[g] = O[g] * alpha + sum_t P[g][t] V[t], in groups of heads x dims that fit the registers
      constexpr int NB = (G_ * DV <= 24) ? DV : 24 / G_;  // G_ <= 8: at least 3 dims at a time
      for (int dv0 = 0; dv0 < DV; dv0 += NB) {
        const int nb = dv0 + NB <= DV ? NB : DV - dv0;
        __m512 o[G_][NB];
        for (int g = 0; g < G_; ++g) {
          const __m512 av = _mm512_set1_ps(alpha[g]);
          for (int j = 0; j < NB; ++j)
            if (j < nb) o[g][j] = _mm512_mul_ps(_mm512_load_ps(&O[g][16 * (dv0 + j)]), av);
        }
        for (int64_t t = 0; t < n[c]; ++t) {
          __m512 vv[NB];
          for (int j = 0; j < NB; ++j)
            if (j < nb) vv[j] = _mm512_load_ps(&Vf[c][t][16 * (dv0 + j)]);
          for (int g = 0; g < G_; ++g) {
            const __m512 pt = _mm512_set1_ps(PP[g][t]);
            for (int j = 0; j < NB; ++j)
              if (j < nb) o[g][j] = _mm512_fmadd_ps(pt, vv[j], o[g][j]);
          }
        }
        for (int g = 0; g < G_; ++g)
          for (int j = 0; j < NB; ++j)
            if (j < nb) _mm512_store_ps(&O[g][16 * (dv0 + j)], o[g][j]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    pm[g] = m[g], pl[g] = l[g];
    for (int64_t d = 0; d < D; ++d) po[g * D + d] = O[g][d];
  }
}

KVK_AVX512 void decode_item_invariant_dispatch(const AttnArgs& a, int64_t b, int64_t h, int64_t k_from,
                                               int64_t k_to, float* pm, float* pl, float* po) {
#define KVK_DEC_CASE(GG, DDV) \
  if (a.G == GG && a.D == 16 * DDV) return decode_item_invariant<GG, DDV>(a, b, h, k_from, k_to, pm, pl, po);
  KVK_DEC_CASE(1, 4) KVK_DEC_CASE(2, 4) KVK_DEC_CASE(3, 4) KVK_DEC_CASE(4, 4)
  KVK_DEC_CASE(1, 8) KVK_DEC_CASE(2, 8) KVK_DEC_CASE(4, 8) KVK_DEC_CASE(8, 8)
  KVK_DEC_CASE(1, 2) KVK_DEC_CASE(2, 2) KVK_DEC_CASE(4, 2) KVK_DEC_CASE(5, 4) KVK_DEC_CASE(6, 4)
  KVK_DEC_CASE(1, 16) KVK_DEC_CASE(2, 16) KVK_DEC_CASE(4, 16)
#undef KVK_DEC_CASE
}  // the cases of extend_fast (the caller checks it)

bool extend_fast(int64_t G, int64_t D);

constexpr int MAXDV = 16;  // head_dim / 16
constexpr int TCH = 16;    // tokens per score chunk

// One block (n tokens from slot bid * BS) of one KV head h for the G query heads of its group, continuing the
// online softmax held in (o, m, l): o (G, D) unnormalized outputs, m and l (G) running maxima and sums.
// KIND is the storage format (a template argument: no per-element branch); quantized formats apply their per-token
// scales to the 16 scores and to the 16 probabilities of a chunk instead of to every element.
template <int DV, int KIND, bool QUANT>
KVK_AVX512 void attn_block_head_avx512(const AttnArgs& a, const float* qh, int64_t h, int64_t bid, int64_t t_begin,
                                       int64_t n, float* o, float* m, float* l) {
  const int64_t G = a.G, KVH = a.KVH, BS = a.BS;
  constexpr int64_t D = 16 * DV;
  alignas(64) float p[MAXG][TCH];
  alignas(64) float ksc[TCH], vsc[TCH];
  __m512 qv[MAXG][DV];
  for (int64_t g = 0; g < G; ++g)
    for (int dv = 0; dv < DV; ++dv) qv[g][dv] = _mm512_loadu_ps(qh + g * D + 16 * dv);
  for (int64_t t0 = t_begin; t0 < n; t0 += TCH) {
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
  const int64_t len = a.ctx[it.b], lo = first_key(a, len);
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
    const int64_t t_begin = std::max<int64_t>(0, lo - blk * a.BS);
    for (int64_t h = 0; h < a.KVH; ++h)
      attn_block_head_avx512<DV, KIND, QUANT>(a, qb + h * G * D, h, bid, t_begin, n, o + h * G * D, mx + h * G,
                                              sm + h * G);
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

// A segment's weight per lane in the combine: exp(m_s - M), 0 where the segment saw no key (m_s = -inf).
KVK_AVX512 inline __m512 seg_weight(__m512 ms, __m512 M, __m512 ninf) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ms, ninf, _CMP_NEQ_OQ), exp512(_mm512_sub_ps(ms, M)));
}

struct InvItem {
  int64_t b, h, k_from, k_to;  // batch row, KV head, keys [k_from, k_to) of one segment
};

struct InvScratch {
  std::vector<InvItem> items;
  std::vector<int64_t> first;  // (B * KVH + 1): the first item of each (row, KV head)
  std::vector<float> pm, pl, po;
};

// One query head's result from its ns segments' partials (maxima pm, sums pl, unnormalized outputs po (D) at
// strides sm, so): extend_item_avx512's combine for one query lane, the same operations in the same order (weights
// exp(m_s - M), zero for a segment without a visible key; sums and outputs accumulated in segment order from zero;
// one reciprocal of the sum).  A single segment is normalized directly: its weight exp512(0) is exactly 1, so the
// combine would give the same bits.
KVK_AVX512 void combine_segments(int64_t ns, const float* pm, const float* pl, const float* po, int64_t sm,
                                 int64_t so, int64_t D, float* dst) {
  const float ninf = -std::numeric_limits<float>::infinity();
  if (ns == 1) {
    const float inv = 1.f / pl[0];
    for (int64_t d = 0; d < D; ++d) dst[d] = po[d] * inv;
    return;
  }
  float M = ninf;
  for (int64_t i = 0; i < ns; ++i) M = M > pm[i * sm] ? M : pm[i * sm];
  __m512 L = _mm512_setzero_ps();
  __m512 O[MAXDV_DEC];
  const int64_t DV = D / 16;
  for (int64_t dv = 0; dv < DV; ++dv) O[dv] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; ++i) {
    const __m512 wv = _mm512_set1_ps(
        _mm512_cvtss_f32(seg_weight(_mm512_set1_ps(pm[i * sm]), _mm512_set1_ps(M), _mm512_set1_ps(ninf))));
    L = _mm512_add_ps(L, _mm512_mul_ps(_mm512_set1_ps(pl[i * sm]), wv));
    for (int64_t dv = 0; dv < DV; ++dv)
      O[dv] = _mm512_add_ps(O[dv], _mm512_mul_ps(_mm512_loadu_ps(po + i * so + 16 * dv), wv));
  }
  const float inv = 1.f / _mm512_cvtss_f32(L);
  alignas(64) float tmp[16];
  for (int64_t dv = 0; dv < DV; ++dv) {
    _mm512_store_ps(tmp, O[dv]);
    for (int d = 0; d < 16; ++d) dst[16 * dv + d] = tmp[d] * inv;
  }
}

// The invariant decode's n tasks: on the calling thread for a short step (work: keys x query heads under 8192;
// waking the pool costs more than it saves there), else on the pool.  Each task's result is fixed by absolute key
// positions, so it does not depend on this choice nor on the thread count.
template <class F>
void run_invariant_tasks(int64_t work, int64_t n, F&& task) {
  if (work < 8192) {
    for (int64_t i = 0; i < n; ++i) task(i);
  } else {
    parallel_tasks(n, task);
  }
}

// The portable decode of row b, KV head h (its G query heads over the same keys), 8 heads at a time on AVX2.
KVK_AVX2 void decode_row_avx2(const AttnArgs& a, int64_t b, int64_t h, float* out) {
  const int64_t ctx = a.ctx[b];
  thread_local std::vector<Lane> lanes;
  lanes.clear();
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t r = b * a.H + h * a.G + g;
    lanes.push_back({a.q + r * a.D, out + r * a.D, first_key(a, ctx), ctx});
  }
  const LaneKV kv{a.k, a.v, a.ks, a.vs, a.kind, a.BS, a.KVH, a.D};
  attend_lanes_avx2(lanes.data(), a.G, a.qscale, kv, h, a.bt + b * a.W);
}

struct AttnScratch {
  std::vector<WorkItem> items;
  std::vector<int64_t> first;
  std::vector<float> po, pm, ps;
};
}  // namespace

// Decode attention of B sequences (a.q pre-scaled) into out (B, H, D) float32.
void attention_raw(const AttnArgs& a, int64_t B, int64_t split_blocks, float* out) {
  if (g_invariant) {  // one task per (row, KV head, segment), the prefill kernel's arithmetic (top of this file)
    const bool fast = use_avx512() && extend_fast(a.G, a.D) && a.G <= MAXG;
    int64_t keys = 0;
    for (int64_t b = 0; b < B; ++b) keys += a.ctx[b];
    if (!fast) {  // portable: one (row, KV head) a task, key by key (the prefill kernel's portable routine)
      const bool avx2 = use_avx2();
      const auto task = [&](int64_t i) {
        const int64_t b = i / a.KVH, h = i % a.KVH, ctx = a.ctx[b];
        if (avx2) return decode_row_avx2(a, b, h, out);
        for (int64_t g = 0; g < a.G; ++g) {
          const int64_t hq = h * a.G + g;
          attend_query_generic(a.q + (b * a.H + hq) * a.D, a.qscale, a.k, a.v, a.ks, a.vs, a.kind, a.bt + b * a.W,
                               a.BS, a.KVH, h, a.D, first_key(a, ctx), ctx, out + (b * a.H + hq) * a.D);
        }
      };
      run_invariant_tasks(keys * a.H, B * a.KVH, task);
      return;
    }
    thread_local InvScratch scratch;
    InvScratch& s = scratch;  // the calling thread's (a thread_local named in the task would be the worker's own)
    const int64_t G = a.G, D = a.D, KVH = a.KVH;
    s.items.clear();
    s.first.assign(B * KVH + 1, 0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t ctx = a.ctx[b], lo = first_key(a, ctx), kbeg = lo - lo % 16;
      for (int64_t h = 0; h < KVH; ++h) {
        s.first[b * KVH + h] = static_cast<int64_t>(s.items.size());
        for (int64_t k0 = kbeg; k0 < ctx; k0 = (k0 / kSegKeys + 1) * kSegKeys)
          s.items.push_back({b, h, k0, std::min(ctx, (k0 / kSegKeys + 1) * kSegKeys)});
      }
    }
    s.first[B * KVH] = static_cast<int64_t>(s.items.size());
    const int64_t NI = static_cast<int64_t>(s.items.size());
    s.pm.resize(NI * G);
    s.pl.resize(NI * G);
    s.po.resize(NI * G * D);
    const auto task = [&](int64_t i) {
      const InvItem& it = s.items[i];
      decode_item_invariant_dispatch(a, it.b, it.h, it.k_from, it.k_to, s.pm.data() + i * G, s.pl.data() + i * G,
                                     s.po.data() + i * G * D);
    };
    run_invariant_tasks(keys * a.H, NI, task);
    for (int64_t bh = 0; bh < B * KVH; ++bh) {
      const int64_t b = bh / KVH, h = bh % KVH, i0 = s.first[bh], ns = s.first[bh + 1] - i0;
      for (int64_t g = 0; g < G; ++g) {
        float* dst = out + (b * a.H + h * G + g) * D;
        if (ns == 0) {
          std::fill(dst, dst + D, 0.f);
          continue;
        }
        combine_segments(ns, s.pm.data() + i0 * G + g, s.pl.data() + i0 * G + g, s.po.data() + (i0 * G + g) * D,
                         G, G * D, D, dst);
      }
    }
    return;
  }
  thread_local AttnScratch s;
  const int64_t D = a.D, H = a.H, BS = a.BS;
  s.items.clear();
  s.first.assign(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    s.first[b] = static_cast<int64_t>(s.items.size());
    const int64_t nblocks = (a.ctx[b] + BS - 1) / BS;
    for (int64_t s0 = first_key(a, a.ctx[b]) / BS; s0 < nblocks; s0 += split_blocks)
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
  parallel_tasks(NI, [&](int64_t i) {
    if (fast)
      attn_item_avx512_dispatch(a, items[i], po + i * H * D, pm + i * H, ps + i * H);
    else
      attn_item_generic(a, items[i], po + i * H * D, pm + i * H, ps + i * H);
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
                               int64_t kind, int64_t split_blocks, int64_t window) {
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
  // the invariant kernel scales q itself (as extend_attention does), the previous one reads it pre-scaled
  const auto qs = g_invariant ? q.contiguous() : (q.contiguous() * scale).contiguous();
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
             bt.data_ptr<int64_t>(), ctxp, kind, H, KVH, D, BS, W, G, std::max<int64_t>(0, window),
             g_invariant ? static_cast<float>(scale) : 1.f};
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
namespace {
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
  int64_t window = 0;  // > 0: a query at KV index i sees keys (i - window, i] only
};

template <int G_, int DV>
KVK_AVX512 void extend_item_avx512(const ExtendArgs& a, const ExtendItem& it) {
  constexpr int D = 16 * DV;
  const int64_t G = G_, H = a.H, KVH = a.KVH, BS = a.BS;
  const int64_t qlen = a.qlens[it.span], ctx = a.ctxs[it.span], start = a.starts[it.span];
  const int64_t nq = std::min<int64_t>(16, qlen - it.i0);      // queries in this tile
  const int64_t qpos0 = ctx - qlen + it.i0;                    // position of the tile's first query
  const int64_t kend = qpos0 + nq;                             // keys [kbeg, kend) are visible to some query
  // keys in chunks of 16 from an absolute multiple of 16 (not from the tile's first visible key), so that a query's
  // chunks, and thus its result, do not depend on which tile or prefill chunk it falls in
  const int64_t kfirst = a.window > 0 ? std::max<int64_t>(0, qpos0 - a.window + 1) : 0, kbeg = kfirst - kfirst % 16;
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
  const __m512i lastv = _mm512_add_epi32(qposv, _mm512_set1_epi32(static_cast<int>(1 - a.window)));  // window
  // the finished segments' states (kSegKeys, see combine_segments): per segment m (G, 16), l (G, 16), Ot (G, D, 16)
  thread_local std::vector<float> segs;
  constexpr int64_t PER = G_ * (2 + D) * 16;
  int64_t nseg = 0;
  for (int64_t k0 = kbeg; k0 < kend; k0 += 16) {
    if (k0 > kbeg && k0 % kSegKeys == 0) {  // a segment ends: keep its state, start the next from scratch
      segs.resize((nseg + 1) * PER);
      float* sp = segs.data() + nseg * PER;
      for (int g = 0; g < G_; ++g) {
        _mm512_storeu_ps(sp + g * 16, m[g]);
        _mm512_storeu_ps(sp + (G_ + g) * 16, l[g]);
        std::memcpy(sp + 2 * G_ * 16 + g * D * 16, &Ot[g][0][0], sizeof(float) * D * 16);
        m[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        l[g] = _mm512_setzero_ps();
        for (int d = 0; d < D; ++d) _mm512_store_ps(Ot[g][d], _mm512_setzero_ps());
      }
      ++nseg;
    }
    // 16 keys (or fewer) from one or two blocks
    const int64_t n = std::min<int64_t>(16, kend - k0);
    kv_chunk_to_f32(a.k, a.v, a.ks, a.vs, a.kind, bt, BS, KVH, it.h, D, k0, n, &Kf[0][0], &Vf[0][0]);
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
    // and, in a window, a key at p is visible to queries at positions <= p + window - 1
    const bool diag = k0 + n - 1 > qpos0, edge = a.window > 0 && k0 <= qpos0 + nq - 1 - a.window;
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; ++t) {
      __mmask16 vis = qmask;
      if (diag) vis &= _mm512_cmpge_epi32_mask(qposv, _mm512_set1_epi32(static_cast<int>(k0 + t)));
      if (edge) vis &= _mm512_cmple_epi32_mask(lastv, _mm512_set1_epi32(static_cast<int>(k0 + t)));
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
  if (nseg > 0) {  // combine the segments per query lane, in segment order (decode's combine_segments, lane by lane)
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    thread_local std::vector<float> w;  // each finished segment's weight (16 lanes), computed once per head
    w.resize(nseg * 16);
    for (int g = 0; g < G_; ++g) {
      __m512 M = m[g];
      for (int64_t i = 0; i < nseg; ++i) M = _mm512_max_ps(M, _mm512_loadu_ps(segs.data() + i * PER + g * 16));
      __m512 L = _mm512_setzero_ps();
      for (int64_t i = 0; i < nseg; ++i) {
        const float* sp = segs.data() + i * PER;
        const __m512 wi = seg_weight(_mm512_loadu_ps(sp + g * 16), M, ninf);
        _mm512_storeu_ps(w.data() + i * 16, wi);
        L = _mm512_add_ps(L, _mm512_mul_ps(_mm512_loadu_ps(sp + (G_ + g) * 16), wi));
      }
      const __m512 wcur = seg_weight(m[g], M, ninf);
      L = _mm512_add_ps(L, _mm512_mul_ps(l[g], wcur));
      for (int d = 0; d < D; ++d) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < nseg; ++i) {
          const float* ot = segs.data() + i * PER + 2 * G_ * 16 + (g * D + d) * 16;
          acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(ot), _mm512_loadu_ps(w.data() + i * 16)));
        }
        _mm512_store_ps(Ot[g][d], _mm512_add_ps(acc, _mm512_mul_ps(_mm512_load_ps(Ot[g][d]), wcur)));
      }
      l[g] = L;
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

// Portable version: one query at a time, online softmax over its visible keys (the decode kernel's portable routine).
void extend_item_generic(const ExtendArgs& a, const ExtendItem& it) {
  const int64_t G = a.G, D = a.D, H = a.H;
  const int64_t qlen = a.qlens[it.span], ctx = a.ctxs[it.span], start = a.starts[it.span];
  const int64_t nq = std::min<int64_t>(16, qlen - it.i0);
  const int64_t* bt = a.bt + it.span * a.W;
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t qpos = ctx - qlen + it.i0 + j;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, qpos - a.window + 1) : 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (start + it.i0 + j) * H + it.h * G + g;
      attend_query_generic(a.q + r * D, a.scale, a.k, a.v, a.ks, a.vs, a.kind, bt, a.BS, a.KVH, it.h, D, lo,
                           qpos + 1, a.out + r * D);
    }
  }
}

// The portable routine's tile on AVX2: the tile's queries x the G heads as lanes (attend_lanes_avx2).
KVK_AVX2 void extend_item_avx2(const ExtendArgs& a, const ExtendItem& it) {
  const int64_t G = a.G, D = a.D, H = a.H;
  const int64_t qlen = a.qlens[it.span], ctx = a.ctxs[it.span], start = a.starts[it.span];
  const int64_t nq = std::min<int64_t>(16, qlen - it.i0);
  thread_local std::vector<Lane> lanes;
  lanes.clear();
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t qpos = ctx - qlen + it.i0 + j;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, qpos - a.window + 1) : 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (start + it.i0 + j) * H + it.h * G + g;
      lanes.push_back({a.q + r * D, a.out + r * D, lo, qpos + 1});
    }
  }
  const LaneKV kv{a.k, a.v, a.ks, a.vs, a.kind, a.BS, a.KVH, D};
  attend_lanes_avx2(lanes.data(), nq * G, a.scale, kv, it.h, a.bt + it.span * a.W);
}

KVK_AVX512 void extend_item_avx512_dispatch(const ExtendArgs& a, const ExtendItem& it) {
#define KVK_EXT_CASE(GG, DDV) if (a.G == GG && a.D == 16 * DDV) return extend_item_avx512<GG, DDV>(a, it);
  KVK_EXT_CASE(1, 4) KVK_EXT_CASE(2, 4) KVK_EXT_CASE(3, 4) KVK_EXT_CASE(4, 4)
  KVK_EXT_CASE(1, 8) KVK_EXT_CASE(2, 8) KVK_EXT_CASE(4, 8) KVK_EXT_CASE(8, 8)
  KVK_EXT_CASE(1, 2) KVK_EXT_CASE(2, 2) KVK_EXT_CASE(4, 2) KVK_EXT_CASE(5, 4) KVK_EXT_CASE(6, 4)
  KVK_EXT_CASE(1, 16) KVK_EXT_CASE(2, 16) KVK_EXT_CASE(4, 16)
#undef KVK_EXT_CASE
  extend_item_generic(a, it);
}

bool extend_fast(int64_t G, int64_t D) {
  const int combos[][2] = {{1, 64}, {2, 64}, {3, 64}, {4, 64}, {1, 128}, {2, 128}, {4, 128}, {8, 128},
                           {1, 32}, {2, 32}, {4, 32}, {5, 64}, {6, 64}, {1, 256}, {2, 256}, {4, 256}};
  for (auto& c : combos)
    if (G == c[0] && D == c[1]) return true;
  return false;
}
}  // namespace

// q (T, H, D) float32 (packed tokens of every span); spans: starts, q_lens, context_lens (S,) int64 and
// block_tables (S, W) int64; KV as in decode_attention.  Returns (T, H, D) float32 with the spans' rows filled
// (rows outside every span are left as zeros).
torch::Tensor extend_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& k_scale, const torch::Tensor& v_scale, const torch::Tensor& starts,
                               const torch::Tensor& q_lens, const torch::Tensor& context_lens,
                               const torch::Tensor& block_tables, double scale, int64_t kind, int64_t window) {
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
               stp, qlp, clp, bt.data_ptr<int64_t>(), W, kind, H, KVH, D, BS, H / KVH, static_cast<float>(scale),
               std::max<int64_t>(0, window)};
  const bool fast = use_avx512() && extend_fast(H / KVH, D), avx2 = !fast && use_avx2();
  // tasks are claimed one at a time: tiles late in a causal prompt see more keys
  parallel_tasks(static_cast<int64_t>(items.size()), [&](int64_t i) {
    if (fast)
      extend_item_avx512_dispatch(a, items[i]);
    else if (avx2)
      extend_item_avx2(a, items[i]);
    else
      extend_item_generic(a, items[i]);
  });
  return out;
}

// ===================================================================================================
// 2c. KIVI int4 / int2 KV (kvkeeper.kvcache.quant; Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit
//     Quantization for KV Cache"): decode and prefill ("extend") attention in one kernel, kivi_attention.
//
//    Spans of queries (a prefill span, or a decode token as a span of one query) attend causally to their
//    sequence's paged K/V, held as packed 4- or 2-bit codes and read in place block by block.  A closed block's
//    keys are codes * scale + min per (KV head, channel) over the block, its values codes * scale + min per
//    (token, KV head, group of channels).  The own-block rule: a query reads the block of its own position from the
//    16-bit window (bfloat16 rows of res_k / res_v: an open block's tokens, or the copy a block closed in this step
//    keeps for the step, res_of = -2 - window block), every earlier block from its codes, so a prefilled token
//    sees what it would see decoded (KIVI's full-precision recent tokens, Liu et al., 2024, section 3.3).  For each
//    16-key chunk of one KV head the codes are converted to float32 once for all the query lanes that read them (up
//    to 16 queries x the GQA group), and the scales are folded out of the inner loops: a score is
//    (q * k_scale) . codes + q . k_min, a value group's sum (p * v_scale) . codes + p . v_min.  No dequantized copy
//    of the context is ever made.  Keys are split at fixed absolute positions (every kKiviSegKeys keys): each
//    segment's online softmax (Milakov & Gimelshein, 2018) runs alone, the segments are combined in order
//    (flash-decoding's split, Dao et al., 2023).  A query lane's arithmetic depends only on its own query and keys
//    (not on the other lanes of its tile, nor on whether its segments ran in parallel), so a token's output is the
//    same bit for bit whether it was prefilled, in any chunk, or decoded: the kernel is batch-invariant by
//    construction, and runs alike in both modes of set_invariant_attention.  AVX-512 path: head_dim and
//    block_size multiples of 16, the value group a multiple of 16 and at most 16 query heads per KV head;
//    otherwise the portable path (same rule, key by key; equal to the reference within rounding, not bit for bit
//    to the AVX-512 path).
// ===================================================================================================
namespace {

constexpr int64_t kKiviSegKeys = 512;
constexpr int64_t kMaxG = 16;  // query heads per KV head (the fast path's lane arrays)

struct KiviArgs {
  const float* q;            // (T, H, D), not scaled
  float* out;                // (T, H, D)
  const uint8_t *kp, *vp;    // (NB, BS, KVH, PB) packed codes
  const uint16_t *ks, *km;   // (NB, KVH, D) float16
  const uint16_t *vs, *vm;   // (NB, BS, KVH, NG) float16
  const int32_t* res_of;     // (NB,)
  const uint16_t *rk, *rv;   // (R, BS, KVH, D) bfloat16
  const int64_t *starts, *qlens, *ctxs, *bt;
  int64_t W, H, KVH, D, BS, G, PB, NG, GV, bits, window;
  float scale;
};

struct KiviTile {
  int64_t s, h, i0, nq;  // span, KV head, first query of the tile, queries (<= 16)
  int64_t seg0, nseg;    // the segments the tile's queries can see
};

inline float kivi_bf16(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline int kivi_code(const uint8_t* row, int64_t d, int64_t bits) {
  return bits == 4 ? (row[d >> 1] >> ((d & 1) * 4)) & 15 : (row[d >> 2] >> ((d & 3) * 2)) & 3;
}

// Absolute positions [lo, hi] that query i of span s sees.
inline void kivi_visible(const KiviArgs& a, int64_t s, int64_t i, int64_t& lo, int64_t& hi) {
  hi = a.ctxs[s] - a.qlens[s] + i;
  lo = a.window > 0 ? std::max<int64_t>(0, hi - a.window + 1) : 0;
}

// res_of[blk]: >= 0, an open block (its window block, read by every query); <= -2, a closed block whose 16-bit copy
// is kept for this step (window block -2 - res_of, read by the queries of that block only: the own-block rule);
// -1, closed.  Whether a query lane (its position hi) reads table entry ti (block blk) from the window:
inline bool kivi_reads_window(const KiviArgs& a, int64_t blk, int64_t ti, int64_t hi) {
  const int32_t r = a.res_of[blk];
  return r >= 0 || (r <= -2 && ti == hi / a.BS);
}
inline int64_t kivi_window_block(int32_t r) { return r >= 0 ? r : -2 - r; }

// Key (or value) of token `off` of block blk, KV head h, as float32 (D,): from the window or dequantized.
void kivi_row(const KiviArgs& a, bool value, bool window, int64_t blk, int64_t off, int64_t h, float* x) {
  const int64_t D = a.D;
  if (window) {
    const uint16_t* src = (value ? a.rv : a.rk) + ((kivi_window_block(a.res_of[blk]) * a.BS + off) * a.KVH + h) * D;
    for (int64_t d = 0; d < D; ++d) x[d] = kivi_bf16(src[d]);
    return;
  }
  const int64_t row = (blk * a.BS + off) * a.KVH + h;
  const uint8_t* codes = (value ? a.vp : a.kp) + row * a.PB;
  for (int64_t d = 0; d < D; ++d) {
    const float c = static_cast<float>(kivi_code(codes, d, a.bits));
    if (value)
      x[d] = c * half_to_float(a.vs[row * a.NG + d / a.GV]) + half_to_float(a.vm[row * a.NG + d / a.GV]);
    else
      x[d] = c * half_to_float(a.ks[(blk * a.KVH + h) * D + d]) + half_to_float(a.km[(blk * a.KVH + h) * D + d]);
  }
}

// Segment seg of a tile, portable code: writes per lane (lane = query j * G + g) o (D), m, l.
void kivi_segment_generic(const KiviArgs& a, const KiviTile& t, int64_t seg, float* o, float* m, float* l) {
  const int64_t D = a.D, G = a.G, lanes = t.nq * G;
  std::vector<float> qs(lanes * D), kr(D), vr(D);
  for (int64_t x = 0; x < lanes; ++x) {
    const float* qrow = a.q + ((a.starts[t.s] + t.i0 + x / G) * a.H + t.h * G + x % G) * D;
    for (int64_t d = 0; d < D; ++d) qs[x * D + d] = qrow[d] * a.scale;
    m[x] = -std::numeric_limits<float>::infinity();
    l[x] = 0.f;
    std::fill(o + x * D, o + (x + 1) * D, 0.f);
  }
  int64_t lo0, hi0, lo1, hi1;
  kivi_visible(a, t.s, t.i0, lo0, hi0);
  kivi_visible(a, t.s, t.i0 + t.nq - 1, lo1, hi1);
  const int64_t k0 = std::max(seg * kKiviSegKeys, lo0), k1 = std::min((seg + 1) * kKiviSegKeys, hi1 + 1);
  for (int64_t key = k0; key < k1; ++key) {
    const int64_t ti = key / a.BS, blk = a.bt[t.s * a.W + ti], off = key % a.BS;
    for (int64_t x = 0; x < lanes; ++x) {
      int64_t lo, hi;
      kivi_visible(a, t.s, t.i0 + x / G, lo, hi);
      if (key < lo || key > hi) continue;
      const bool win = kivi_reads_window(a, blk, ti, hi);
      kivi_row(a, false, win, blk, off, t.h, kr.data());
      kivi_row(a, true, win, blk, off, t.h, vr.data());
      float sc = 0.f;
      for (int64_t d = 0; d < D; ++d) sc += qs[x * D + d] * kr[d];
      const float mn = std::max(m[x], sc), corr = std::exp(m[x] - mn), p = std::exp(sc - mn);
      l[x] = l[x] * corr + p;
      for (int64_t d = 0; d < D; ++d) o[x * D + d] = o[x * D + d] * corr + p * vr[d];
      m[x] = mn;
    }
  }
}

// 16 codes (channels c .. c + 15 of a packed row) as float32.
KVK_AVX512 inline __m512 kivi_codes16(const uint8_t* row, int64_t c, int64_t bits) {
  __m128i codes;
  if (bits == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
    const __m128i mask = _mm_set1_epi8(15);
    codes = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
  } else {
    int32_t w;
    std::memcpy(&w, row + c / 4, 4);
    const __m128i b = _mm_cvtsi32_si128(w), mask = _mm_set1_epi8(3);
    const __m128i c0 = _mm_and_si128(b, mask), c1 = _mm_and_si128(_mm_srli_epi16(b, 2), mask);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(b, 4), mask), c3 = _mm_and_si128(_mm_srli_epi16(b, 6), mask);
    codes = _mm_unpacklo_epi16(_mm_unpacklo_epi8(c0, c1), _mm_unpacklo_epi8(c2, c3));
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
}

KVK_AVX512 inline __m512 kivi_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// A packed row's D codes as float32 (the codes themselves: scale and min are applied by the caller).
KVK_AVX512 inline void kivi_codes_row(const uint8_t* row, int64_t D, int64_t bits, float* dst) {
  int64_t c = 0;
  if (bits == 4) {  // 32 channels from 16 bytes: low nibbles are the even channels, high the odd ones
    const __m128i mask = _mm_set1_epi8(15);
    for (; c + 32 <= D; c += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2));
      const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      _mm512_store_ps(dst + c, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))));
      _mm512_store_ps(dst + c + 16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))));
    }
  }
  for (; c < D; c += 16) _mm512_store_ps(dst + c, kivi_codes16(row, c, bits));
}

// Segment seg of a tile, AVX-512 (head_dim D = 16 * NV): per lane the same online softmax, 16 keys at a time.
// For each chunk of 16 keys the codes (and, where a lane's own block is in the window, the 16-bit rows) are
// converted once for every lane of the tile.  Scale and min are folded out of the inner loops: a closed block's
// score is (q * k_scale) . codes + q . k_min; a value group's sum is sum_t (p_t * v_scale_t) codes_t +
// sum_t p_t * v_min_t.  A lane's score is summed per token over the head dimension in 16-channel vectors, then
// reduced by transpose_reduce16 (a fixed tree): a lane's arithmetic depends only on its own query and keys, never
// on the other lanes of its tile.
template <int NV>
KVK_AVX512 void kivi_segment_avx512_t(const KiviArgs& a, const KiviTile& t, int64_t seg, float* o, float* m,
                                      float* l) {
  constexpr int64_t D = 16 * NV;
  const int64_t G = a.G, lanes = t.nq * G, NG = a.NG, vpg = a.GV / 16;
  thread_local std::vector<float> qbuf;
  qbuf.resize(2 * lanes * D);
  float *qs = qbuf.data(), *qk = qs + lanes * D;  // the lanes' queries (scaled), and times the block's key scales
  float bk[16 * kMaxG];
  int64_t los[16 * kMaxG], his[16 * kMaxG];
  for (int64_t x = 0; x < lanes; ++x) {
    const float* qrow = a.q + ((a.starts[t.s] + t.i0 + x / G) * a.H + t.h * G + x % G) * D;
    for (int64_t d = 0; d < D; ++d) qs[x * D + d] = qrow[d] * a.scale;
    kivi_visible(a, t.s, t.i0 + x / G, los[x], his[x]);
    m[x] = -std::numeric_limits<float>::infinity();
    l[x] = 0.f;
    std::fill(o + x * D, o + (x + 1) * D, 0.f);
  }
  alignas(64) float kc[16 * D], vc[16 * D];  // codes of the chunk's 16 tokens (token-major)
  alignas(64) float kw[16 * D], vw[16 * D];  // the window's rows
  alignas(64) float vsc[16][16], vmn[16][16];  // per value group: the 16 tokens' scales and minima
  alignas(64) float pg[16][16];               // per value group: p * scale
  float bias[16];
  int gof[NV];
  for (int v = 0; v < NV; ++v) gof[v] = static_cast<int>(v / vpg);
  alignas(64) __m512 part[16];
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t k0 = std::max(seg * kKiviSegKeys, los[0] / 16 * 16);
  const int64_t k1 = std::min((seg + 1) * kKiviSegKeys, his[lanes - 1] + 1);
  int64_t qk_ti = -1;  // the table entry qk / bk were computed for
  for (int64_t c0 = k0; c0 < k1; c0 += 16) {
    const int64_t ti = c0 / a.BS, blk = a.bt[t.s * a.W + ti], off = c0 % a.BS;
    const int64_t r = kivi_window_block(a.res_of[blk]);
    bool need_codes = false, need_win = false;
    for (int64_t x = 0; x < lanes; ++x) {
      if (his[x] < c0 || los[x] > c0 + 15) continue;
      (kivi_reads_window(a, blk, ti, his[x]) ? need_win : need_codes) = true;
    }
    if (need_codes) {
      const int64_t row0 = (blk * a.BS + off) * a.KVH + t.h;
      for (int j = 0; j < 16; ++j) {
        const int64_t row = row0 + j * a.KVH;
        kivi_codes_row(a.kp + row * a.PB, D, a.bits, kc + j * D);
        kivi_codes_row(a.vp + row * a.PB, D, a.bits, vc + j * D);
        for (int64_t g = 0; g < NG; ++g) {
          vsc[g][j] = _cvtsh_ss(a.vs[row * NG + g]);
          vmn[g][j] = _cvtsh_ss(a.vm[row * NG + g]);
        }
      }
      if (qk_ti != ti) {  // this block's key scales folded into every lane's query
        qk_ti = ti;
        const uint16_t *ks = a.ks + (blk * a.KVH + t.h) * D, *km = a.km + (blk * a.KVH + t.h) * D;
        __m512 s[NV], mn[NV];
        for (int v = 0; v < NV; ++v) {
          s[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ks + 16 * v)));
          mn[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(km + 16 * v)));
        }
        for (int64_t x = 0; x < lanes; ++x) {
          __m512 b = _mm512_setzero_ps();
          for (int v = 0; v < NV; ++v) {
            const __m512 q = _mm512_loadu_ps(qs + x * D + 16 * v);
            _mm512_storeu_ps(qk + x * D + 16 * v, _mm512_mul_ps(q, s[v]));
            b = _mm512_fmadd_ps(q, mn[v], b);
          }
          bk[x] = _mm512_reduce_add_ps(b);
        }
      }
    }
    if (need_win)
      for (int j = 0; j < 16; ++j) {
        const int64_t row = ((r * a.BS + off + j) * a.KVH + t.h) * D;
        for (int v = 0; v < NV; ++v) {
          _mm512_store_ps(kw + j * D + 16 * v, kivi_bf16x16(a.rk + row + 16 * v));
          _mm512_store_ps(vw + j * D + 16 * v, kivi_bf16x16(a.rv + row + 16 * v));
        }
      }
    const __m512i pos = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(c0)));
    for (int64_t x = 0; x < lanes; ++x) {
      if (his[x] < c0 || los[x] > c0 + 15) continue;
      const bool win = kivi_reads_window(a, blk, ti, his[x]);
      const float* qx = win ? qs + x * D : qk + x * D;
      const float* K = win ? kw : kc;
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(qx + 16 * v);
      for (int j = 0; j < 16; ++j) {
        __m512 p = _mm512_mul_ps(qv[0], _mm512_load_ps(K + j * D));
        for (int v = 1; v < NV; ++v) p = _mm512_fmadd_ps(qv[v], _mm512_load_ps(K + j * D + 16 * v), p);
        part[j] = p;
      }
      __m512 sc = transpose_reduce16(part);
      if (!win) sc = _mm512_add_ps(sc, _mm512_set1_ps(bk[x]));
      const __mmask16 vis = _mm512_cmple_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(his[x]))) &
                            _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(los[x])));
      sc = _mm512_mask_blend_ps(vis, ninf, sc);
      const float mx = std::max(m[x], _mm512_reduce_max_ps(sc));
      const float corr = std::exp(m[x] - mx);
      const __m512 p = _mm512_maskz_mov_ps(vis, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
      l[x] = l[x] * corr + _mm512_reduce_add_ps(p);
      m[x] = mx;
      float* ox = o + x * D;
      const __m512 cv = _mm512_set1_ps(corr);
      __m512 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = _mm512_mul_ps(_mm512_loadu_ps(ox + 16 * v), cv);
      if (win) {
        _mm512_store_ps(pg[0], p);
        for (int j = 0; j < 16; ++j) {
          const __m512 pj = _mm512_set1_ps(pg[0][j]);
          for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(pj, _mm512_load_ps(vw + j * D + 16 * v), acc[v]);
        }
      } else {
        for (int64_t g = 0; g < NG; ++g) {
          _mm512_store_ps(pg[g], _mm512_mul_ps(p, _mm512_load_ps(vsc[g])));
          bias[g] = _mm512_reduce_add_ps(_mm512_mul_ps(p, _mm512_load_ps(vmn[g])));
        }
        for (int j = 0; j < 16; ++j)
          for (int v = 0; v < NV; ++v)
            acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(pg[gof[v]][j]), _mm512_load_ps(vc + j * D + 16 * v), acc[v]);
        for (int v = 0; v < NV; ++v) acc[v] = _mm512_add_ps(acc[v], _mm512_set1_ps(bias[gof[v]]));
      }
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ox + 16 * v, acc[v]);
    }
  }
}

KVK_AVX512 void kivi_segment_avx512(const KiviArgs& a, const KiviTile& t, int64_t seg, float* o, float* m, float* l) {
  switch (a.D / 16) {
    case 1: return kivi_segment_avx512_t<1>(a, t, seg, o, m, l);
    case 2: return kivi_segment_avx512_t<2>(a, t, seg, o, m, l);
    case 3: return kivi_segment_avx512_t<3>(a, t, seg, o, m, l);
    case 4: return kivi_segment_avx512_t<4>(a, t, seg, o, m, l);
    case 5: return kivi_segment_avx512_t<5>(a, t, seg, o, m, l);
    case 6: return kivi_segment_avx512_t<6>(a, t, seg, o, m, l);
    case 7: return kivi_segment_avx512_t<7>(a, t, seg, o, m, l);
    case 8: return kivi_segment_avx512_t<8>(a, t, seg, o, m, l);
    case 10: return kivi_segment_avx512_t<10>(a, t, seg, o, m, l);
    case 12: return kivi_segment_avx512_t<12>(a, t, seg, o, m, l);
    case 16: return kivi_segment_avx512_t<16>(a, t, seg, o, m, l);
    default: return kivi_segment_generic(a, t, seg, o, m, l);
  }
}

// A tile's output from its segments' partials (in segment order; a segment without a visible key weighs 0).
void kivi_combine(const KiviArgs& a, const KiviTile& t, const float* part, int64_t stride) {
  const int64_t D = a.D, G = a.G, lanes = t.nq * G;
  for (int64_t x = 0; x < lanes; ++x) {
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < t.nseg; ++s) M = std::max(M, part[s * stride + lanes * D + x]);
    float* out = a.out + ((a.starts[t.s] + t.i0 + x / G) * a.H + t.h * G + x % G) * D;
    std::fill(out, out + D, 0.f);
    if (M == -std::numeric_limits<float>::infinity()) continue;
    float L = 0.f;
    for (int64_t s = 0; s < t.nseg; ++s) {
      const float ms = part[s * stride + lanes * D + x];
      if (ms == -std::numeric_limits<float>::infinity()) continue;
      const float w = std::exp(ms - M);
      L += w * part[s * stride + lanes * D + lanes + x];
      const float* os = part + s * stride + x * D;
      for (int64_t d = 0; d < D; ++d) out[d] += w * os[d];
    }
    const float inv = 1.f / L;
    for (int64_t d = 0; d < D; ++d) out[d] *= inv;
  }
}

}  // namespace

torch::Tensor kivi_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& k_scale, const torch::Tensor& k_min, const torch::Tensor& v_scale,
                             const torch::Tensor& v_min, const torch::Tensor& res_of, const torch::Tensor& res_k,
                             const torch::Tensor& res_v, const torch::Tensor& starts, const torch::Tensor& q_lens,
                             const torch::Tensor& context_lens, const torch::Tensor& block_tables, double scale,
                             int64_t bits, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "kivi_attention: q must be (T, H, D) float32");
  TORCH_CHECK(bits == 4 || bits == 2, "kivi_attention: bits must be 4 or 2, got ", bits);
  TORCH_CHECK(k.dim() == 4 && k.scalar_type() == at::kByte && v.sizes() == k.sizes() && v.scalar_type() == at::kByte &&
                  k.is_contiguous() && v.is_contiguous(),
              "kivi_attention: k and v must be contiguous (blocks, block_size, kv_heads, packed) uint8");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), NB = k.size(0), BS = k.size(1), KVH = k.size(2);
  TORCH_CHECK(D % 8 == 0 && k.size(3) == D * bits / 8 && H % KVH == 0,
              "kivi_attention: head_dim, packed width or head counts do not match");
  TORCH_CHECK(k_scale.scalar_type() == at::kHalf && k_min.scalar_type() == at::kHalf && k_scale.is_contiguous() &&
                  k_min.is_contiguous() && k_scale.numel() == NB * KVH * D && k_min.numel() == NB * KVH * D,
              "kivi_attention: k_scale and k_min must be contiguous (blocks, kv_heads, head_dim) float16");
  TORCH_CHECK(v_scale.dim() == 4 && v_scale.scalar_type() == at::kHalf && v_min.scalar_type() == at::kHalf &&
                  v_scale.is_contiguous() && v_min.is_contiguous() && v_min.sizes() == v_scale.sizes() &&
                  v_scale.size(0) == NB && v_scale.size(1) == BS && v_scale.size(2) == KVH && D % v_scale.size(3) == 0,
              "kivi_attention: v_scale and v_min must be contiguous (blocks, block_size, kv_heads, groups) float16");
  TORCH_CHECK(res_of.scalar_type() == at::kInt && res_of.numel() == NB && res_of.is_contiguous(),
              "kivi_attention: res_of must be (blocks,) int32");
  TORCH_CHECK(res_k.dim() == 4 && res_k.scalar_type() == at::kBFloat16 && res_v.sizes() == res_k.sizes() &&
                  res_v.scalar_type() == at::kBFloat16 && res_k.is_contiguous() && res_v.is_contiguous() &&
                  res_k.size(1) == BS && res_k.size(2) == KVH && res_k.size(3) == D,
              "kivi_attention: res_k and res_v must be contiguous (residual_blocks, block_size, kv_heads, head_dim) "
              "bfloat16");
  const int64_t S = starts.numel();
  TORCH_CHECK(starts.scalar_type() == at::kLong && q_lens.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
                  q_lens.numel() == S && context_lens.numel() == S && block_tables.dim() == 2 &&
                  block_tables.size(0) == S,
              "kivi_attention: starts, q_lens, context_lens (S,) and block_tables (S, W) must be int64");
  const auto qc = q.contiguous();
  const auto st = starts.contiguous(), ql = q_lens.contiguous(), cl = context_lens.contiguous();
  const auto bt = block_tables.contiguous();
  const int64_t W = bt.size(1);
  const int64_t *stp = st.data_ptr<int64_t>(), *qlp = ql.data_ptr<int64_t>(), *clp = cl.data_ptr<int64_t>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int32_t* rop = res_of.data_ptr<int32_t>();
  const int64_t R = res_k.size(0);
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(qlp[i] >= 1 && clp[i] >= qlp[i] && clp[i] <= W * BS && stp[i] >= 0 && stp[i] + qlp[i] <= T,
                "kivi_attention: span ", i, " (start ", stp[i], ", ", qlp[i], " queries, context ", clp[i],
                ") does not fit q or its block table");
    for (int64_t j = 0; j < (clp[i] + BS - 1) / BS; ++j) {
      const int64_t b = btp[i * W + j];
      TORCH_CHECK(b >= 0 && b < NB && rop[b] < R && rop[b] >= -1 - R, "kivi_attention: span ", i, " block ", b,
                  " out of range");
    }
  }
  const int64_t NG = v_scale.size(3), G = H / KVH;
  auto out = torch::zeros({T, H, D}, q.options());
  KiviArgs a{qc.data_ptr<float>(), out.data_ptr<float>(), k.data_ptr<uint8_t>(), v.data_ptr<uint8_t>(),
             reinterpret_cast<const uint16_t*>(k_scale.data_ptr<at::Half>()),
             reinterpret_cast<const uint16_t*>(k_min.data_ptr<at::Half>()),
             reinterpret_cast<const uint16_t*>(v_scale.data_ptr<at::Half>()),
             reinterpret_cast<const uint16_t*>(v_min.data_ptr<at::Half>()), rop,
             reinterpret_cast<const uint16_t*>(res_k.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(res_v.data_ptr<at::BFloat16>()), stp, qlp, clp, btp, W, H, KVH, D, BS,
             G, k.size(3), NG, D / NG, bits, std::max<int64_t>(0, window), static_cast<float>(scale)};
  const bool fast = use_avx512() && D % 16 == 0 && D <= 256 && BS % 16 == 0 && a.GV % 16 == 0 && G <= kMaxG;
  std::vector<KiviTile> tiles;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t i0 = 0; i0 < qlp[s]; i0 += 16) {
        const int64_t nq = std::min<int64_t>(16, qlp[s] - i0);
        int64_t lo0, hi0, lo1, hi1;
        kivi_visible(a, s, i0, lo0, hi0);
        kivi_visible(a, s, i0 + nq - 1, lo1, hi1);
        const int64_t seg0 = lo0 / kKiviSegKeys;
        tiles.push_back({s, h, i0, nq, seg0, hi1 / kKiviSegKeys + 1 - seg0});
      }
  auto segment = [&](const KiviTile& t, int64_t seg, float* part, int64_t lanes) {
    float *o = part, *m = part + lanes * D, *l = m + lanes;
    if (fast)
      kivi_segment_avx512(a, t, seg, o, m, l);
    else
      kivi_segment_generic(a, t, seg, o, m, l);
  };
  const int64_t n = static_cast<int64_t>(tiles.size());
  if (n >= 2 * pool_threads()) {  // enough tiles: one task each, its segments in order
    parallel_tasks(n, [&](int64_t i) {
      const KiviTile& t = tiles[i];
      const int64_t lanes = t.nq * G, stride = lanes * (D + 2);
      std::vector<float> part(t.nseg * stride);
      for (int64_t s = 0; s < t.nseg; ++s) segment(t, t.seg0 + s, part.data() + s * stride, lanes);
      kivi_combine(a, t, part.data(), stride);
    });
    return out;
  }
  // few tiles (decode): one task per (tile, segment), combined afterwards
  std::vector<int64_t> first(n + 1, 0), offs(n, 0);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    first[i + 1] = first[i] + tiles[i].nseg;
    offs[i] = total;
    total += tiles[i].nseg * tiles[i].nq * G * (D + 2);
  }
  std::vector<float> part(total);
  parallel_tasks(first[n], [&](int64_t j) {
    const int64_t i = std::upper_bound(first.begin(), first.end(), j) - first.begin() - 1;
    const KiviTile& t = tiles[i];
    const int64_t lanes = t.nq * G, stride = lanes * (D + 2), s = j - first[i];
    segment(t, t.seg0 + s, part.data() + offs[i] + s * stride, lanes);
  });
  for (int64_t i = 0; i < n; ++i) kivi_combine(a, tiles[i], part.data() + offs[i], tiles[i].nq * G * (D + 2));
  return out;
}

}  // namespace kvk
