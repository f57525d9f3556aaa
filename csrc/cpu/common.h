// kvkeeper CPU kernels: matmul over 4-/8-bit weight blocks computed in place, paged attention, and the element-wise
// parts of a layer.  This header holds what the kernel files share (includes, the AVX-512 target, the KV storage
// formats, exp of 16 floats, of 8 and of one with the same bits) and the declarations of every kernel, in namespace
// kvk.
//
// Built by `make setup` (kvkeeper.kernels.build) with torch.utils.cpp_extension; loaded by
// kvkeeper.kernels.cpu.  Every kernel has a portable C++ path and an AVX-512 path (AVX512F/BW/VL +
// VNNI + F16C) chosen at run time from the CPU's flags (`isa()`); the files are compiled for the
// baseline x86-64 ISA, so the .so loads on any x86-64 CPU.
//
// One file per operation (csrc/cpu/):
//   isa.cpp           the instruction set chosen at run time (AVX-512, else AVX2 where a kernel has that path)
//   qmm.cpp           activation quantization and the block matmul (qmm)
//   attention.cpp     paged decode attention and paged prefill ("extend") attention
//   elementwise.cpp   RMSNorm, SiLU(gate) * up, RoPE, storing a token's K/V
//   fused_decode.cpp  DecodeModel: a whole decode step of a Llama-family model in one call
//   pool.cpp          the thread pool every kernel parallelizes through
//   bindings.cpp      the Python module
// Helpers used by one file only live in an unnamed namespace of that file.
#pragma once

#include <torch/types.h>
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

#define KVK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define KVK_AVX2 __attribute__((target("avx2,fma,f16c")))

// y (M, N) = x (M, K) @ W^T on GGUF bytes w (N rows of row_bytes) of a K-quant, Q8_0 or F16 type (kquant.cpp).
namespace kquant {
void matmul_raw(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t type, int64_t N, float* y);
const uint8_t* weight_ptr(const torch::Tensor& w, int64_t type, int64_t N, int64_t K);  // checks, raises
// Several weights of one x in one parallel region, x quantized once per activation layout (a layer's q, k, v):
// outs[i] (M, ldy[i]) columns [0, N[i]) = x (M, K) @ W_i^T, W_i = N[i] rows of GGUF bytes w[i] of type[i].
void matmul_many(const float* x, int64_t M, int64_t K, const uint8_t* const* w, const int64_t* type,
                 const int64_t* N, float* const* outs, const int64_t* ldy, int64_t count);
}  // namespace kquant

namespace kvk {

// ---------------------------------------------------------------------------------------------------
// The kernels' thread pool (pool.cpp): tasks claimed by whichever thread is free; the caller works too and
// waits only for tasks another thread has claimed.  Every kernel parallelizes through it, not OpenMP.
// ---------------------------------------------------------------------------------------------------
int pool_threads();  // threads a region may use: torch's intra-op setting (torch.set_num_threads)
void run_tasks(int64_t n, void (*fn)(void*, int64_t), void* ctx);  // fn(ctx, t) for t in [0, n); n < 2^20

// f(t) for every task t in [0, n), in parallel.
template <class F>
void parallel_tasks(int64_t n, F&& f) {
  using Fn = std::remove_reference_t<F>;
  run_tasks(n, [](void* c, int64_t t) { (*static_cast<Fn*>(c))(t); }, const_cast<void*>(static_cast<const void*>(&f)));
}

// f(b, e) over chunks of [begin, end) of at least `grain` items (as at::parallel_for), up to 4 chunks a
// thread so that a thread that loses its core holds back little work.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& f) {
  const int64_t n = end - begin, th = pool_threads();
  if (n <= 0) return;
  if (th <= 1 || n <= grain) {
    f(begin, end);
    return;
  }
  const int64_t chunks = std::min<int64_t>((n + grain - 1) / grain, 4 * th);
  const int64_t step = (n + chunks - 1) / chunks;
  parallel_tasks((n + step - 1) / step, [&](int64_t t) {
    const int64_t b = begin + t * step;
    f(b, std::min(end, b + step));
  });
}

// ---------------------------------------------------------------------------------------------------
// ISA selection (isa.cpp)
// ---------------------------------------------------------------------------------------------------
bool cpu_has_avx512();                  // the CPU has AVX-512 F/BW/VL/DQ + VNNI + F16C + FMA
bool cpu_has_avx2();                    // the CPU has AVX2 + FMA + F16C
bool use_avx512();                      // the kernels take their AVX-512 paths now
bool use_avx2();                        // the kernels that have one take their AVX2 path now (not AVX-512)
std::string isa();                      // "avx512_vnni", "avx2" or "generic"
void set_isa(const std::string& name);  // auto, generic, avx2 or avx512_vnni (raises on another name)

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// Cephes' expf, shared by exp512, exp_portable and exp256: the input's clamp, log2(e), ln 2 in two parts, and the
// polynomial's coefficients from the highest power down.
constexpr float kExpMin = -87.3f, kExpMax = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                            5.0000001201e-1f};

// exp of 16 floats (Cephes-style: range reduction by ln 2, degree-6 polynomial, scalef); relative error ~2 ulp.
KVK_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpMax));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[1]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[2]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[3]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[4]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[5]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, fx);
}

// exp of one float for the portable attention routine, and exp256 below for its AVX2 twin: the same range reduction
// and polynomial as exp512 (Cephes' expf), in separate multiplies and adds (no fused multiply-add: these files are
// built with -ffp-contract=off), 2^n applied by one multiply with a float built from its exponent bits.  Every step
// is an IEEE operation whose AVX2 instruction rounds the same way, so exp256 gives these floats lane by lane and the
// portable and AVX2 paths agree bit for bit; relative error ~3 ulp.  exp(0) = 1 exactly; an input below -87.3
// (-inf included) gives exp(-87.3) ~ 1.2e-38, not 0.  The clamps take the bound for a NaN, as MAXPS / MINPS do.
inline float exp_portable(float x) {
  x = x > kExpMin ? x : kExpMin;
  x = x < kExpMax ? x : kExpMax;
  const float fx = std::nearbyint(x * kLog2e);  // round half to even, as VROUNDPS below
  float r = x - fx * kLn2Hi;
  r = r - fx * kLn2Lo;
  float p = kExpP[0];
  p = p * r + kExpP[1];
  p = p * r + kExpP[2];
  p = p * r + kExpP[3];
  p = p * r + kExpP[4];
  p = p * r + kExpP[5];
  p = p * (r * r) + (r + 1.f);
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;  // 2^fx, fx in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

KVK_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpMax));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(kLn2Hi)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(kExpP[0]);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpP[1]));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpP[2]));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpP[3]));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpP[4]));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpP[5]));
  p = _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// ---------------------------------------------------------------------------------------------------
// KV storage formats (kvkeeper.kvcache.quant)
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

// ---------------------------------------------------------------------------------------------------
// 1. qmm (qmm.cpp): activation quantization and the block matmul
// ---------------------------------------------------------------------------------------------------
constexpr int QK = 32;  // weights (and activations) per block

int activation_bits();                   // bits of the activation codes: 16 (default) or 8
void set_activation_bits(int64_t bits);  // raises unless 8 or 16

// A packed weight as the kernels see it (see kvkeeper.weights.formats).
struct QW {
  const uint8_t* qs;
  const uint16_t* sc;
  int64_t bits, n, k, groups;
};

// Checks qs (G, nb, 256|512) uint8 and sc (G, nb, 2, 16) float16 against bits and N (raises on a mismatch).
QW make_qw(const torch::Tensor& qs, const torch::Tensor& sc, int64_t bits, int64_t N);
// y (M, w.n) = x (M, w.k) @ W^T, both row-major float32.
void qmm_raw(const float* x, int64_t M, const QW& w, float* y);
// x: (M, K) float32; qs: (G, nb, 256|512) uint8; sc: (G, nb, 2, 16) float16; returns (M, N) float32.
torch::Tensor qmm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc, int64_t bits, int64_t N);
// The activation quantization alone (tests): x (M, K) float32 -> (q (M, K) int32, dx (M, K/32), sx (M, K/32)).
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x);

// ---------------------------------------------------------------------------------------------------
// 2. paged attention (attention.cpp)
// ---------------------------------------------------------------------------------------------------
struct AttnArgs {
  const float* q;      // (B, H, D), pre-scaled by the softmax scale
  const void* k;       // (NB, BS, KVH, D)
  const void* v;
  const uint16_t* ks;  // (NB, BS, KVH) float16 or null
  const uint16_t* vs;
  const int64_t* bt;   // (B, W)
  const int64_t* ctx;  // (B,)
  int64_t kind, H, KVH, D, BS, W, G;
  int64_t window = 0;  // > 0: a row attends to its last `window` keys only (sliding-window layers)
  float qscale = 1.f;  // invariant kernel: q is multiplied by this (the softmax scale) as extend_attention does
};

// Invariant decode attention (attention.cpp; on by default): a decode token's output computed with the prefill
// kernel's operations in its order, so it does not depend on prefill vs decode, the batch or the thread count.
bool invariant_attention();
void set_invariant_attention(bool on);

// Decode attention of B sequences (a.q pre-scaled) into out (B, H, D) float32; split_blocks: blocks per work item.
void attention_raw(const AttnArgs& a, int64_t B, int64_t split_blocks, float* out);
// One query token per sequence; returns (B, H, D) float32 (arguments: see attention.cpp).
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                               const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                               int64_t kind, int64_t split_blocks, int64_t window);
// Causal attention of prefill spans; returns (T, H, D) float32 (arguments: see attention.cpp).
torch::Tensor extend_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& k_scale, const torch::Tensor& v_scale, const torch::Tensor& starts,
                               const torch::Tensor& q_lens, const torch::Tensor& context_lens,
                               const torch::Tensor& block_tables, double scale, int64_t kind, int64_t window);

// KIVI int4 / int2 KV (section 2c of attention.cpp): causal attention of spans (a decode token: a span of one
// query) over packed codes and the 16-bit window, read in place; returns (T, H, D) float32.
torch::Tensor kivi_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& k_scale, const torch::Tensor& k_min, const torch::Tensor& v_scale,
                             const torch::Tensor& v_min, const torch::Tensor& res_of, const torch::Tensor& res_k,
                             const torch::Tensor& res_v, const torch::Tensor& starts, const torch::Tensor& q_lens,
                             const torch::Tensor& context_lens, const torch::Tensor& block_tables, double scale,
                             int64_t bits, int64_t window);

// ---------------------------------------------------------------------------------------------------
// 3. element-wise parts of a layer (elementwise.cpp)
// ---------------------------------------------------------------------------------------------------
// RMSNorm of M rows of N floats: y = x * (1 / sqrt(mean(x^2) + eps)) * w.
void rmsnorm_rows(const float* x, const float* w, int64_t M, int64_t N, float eps, float* y);
// RoPE, half-split layout, in place on x (heads, D) of one token; cos/sin (D).
void rope_heads(float* x, int64_t heads, int64_t D, const float* cs, const float* sn);
// SiLU(gate) * up of M rows g (M, 2I) into o (M, I).
void silu_mul_rows(const float* g, int64_t M, int64_t I, float* o);
void gelu_mul_rows(const float* g, int64_t M, int64_t I, float* o);  // GELU(tanh)(gate) * up
// Store one token's K or V (KVH, D) at a slot in the storage format `kind` (its scales too for int8/fp8).
void store_token(const float* x, int64_t KVH, int64_t D, void* data, uint16_t* scales, int64_t slot, int64_t kind);
// Python-facing versions (the layer-by-layer path of packed models).
torch::Tensor rmsnorm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gu);
torch::Tensor gelu_mul(const torch::Tensor& gu);
void rope_qk(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t D);

// ---------------------------------------------------------------------------------------------------
// 4. a whole decode step of a Llama-family model with packed or GGUF weights, in one call (fused_decode.cpp;
//    see kvkeeper.worker.fused_decode for the contract)
// ---------------------------------------------------------------------------------------------------
// One matrix in GGUF's own bytes (a K-quant, Q8_0 or F16; kquant.cpp) and an optional output permutation:
// y[:, r] = (x @ W^T)[:, perm[r]] (llama.cpp's q/k row order undone).
struct GGUFPart {
  const uint8_t* w;
  int64_t type, n, k;
  const int64_t* perm;  // (n,) or null
};

// One projection of a decode layer: a packed weight (parts empty), or GGUF matrices whose outputs sit side by
// side (a fused q/k/v or gate/up kept as the file's separate tensors).  n: output columns in all.
struct Proj {
  QW qw{};
  std::vector<GGUFPart> parts;
  int64_t n = 0;
};

// y (M, p.n) = x (M, K) @ W^T through qmm_raw or kquant::matmul_raw (the routines of the layer-by-layer path);
// tmp: scratch for the parts of a GGUF projection.
void proj_raw(const float* x, int64_t M, const Proj& p, float* y, std::vector<float>& tmp);

struct DecodeLayer {
  torch::Tensor ln1, ln2, qkv_bias;                       // (hidden,), (hidden,), (qkv_out,) or undefined
  Proj qkv, o, gu, dn;
  std::vector<torch::Tensor> keep;                        // the tensors the projections point into
  torch::Tensor k, v, ks, vs;                             // this layer's paged cache (ks, vs undefined unless quantized)
  // Gemma 3 (set_layer_norms): RMSNorm over each q and k head (head_dim,) before RoPE, RMSNorm of the attention
  // and feed-forward outputs (hidden,) before their residual adds; undefined when the model has none
  torch::Tensor q_norm, k_norm, post_attn, post_ffw;
  bool sliding = false;  // attends within the model's window, with the local RoPE and the sliding block tables
};

class DecodeModel {
 public:
  DecodeModel(int64_t hidden, int64_t inter, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
              int64_t kind);

  void add_layer(const torch::Tensor& ln1, const torch::Tensor& ln2, const torch::Tensor& qkv_bias,
                 const torch::Tensor& qkv_qs, const torch::Tensor& qkv_sc, int64_t qkv_bits,
                 const torch::Tensor& o_qs, const torch::Tensor& o_sc, int64_t o_bits,
                 const torch::Tensor& gu_qs, const torch::Tensor& gu_sc, int64_t gu_bits,
                 const torch::Tensor& dn_qs, const torch::Tensor& dn_sc, int64_t dn_bits,
                 const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& ks, const torch::Tensor& vs);

  // A layer over GGUF matrices in place: each projection a list of (bytes (N, row bytes) uint8, ggml type, N, K,
  // perm (N,) int64 or empty), their outputs side by side (q, k, v; gate, up).
  using Parts = std::vector<std::tuple<torch::Tensor, int64_t, int64_t, int64_t, torch::Tensor>>;
  void add_layer_gguf(const torch::Tensor& ln1, const torch::Tensor& ln2, const torch::Tensor& qkv_bias,
                      const Parts& qkv, const Parts& o, const Parts& gu, const Parts& dn, const torch::Tensor& k,
                      const torch::Tensor& v, const torch::Tensor& ks, const torch::Tensor& vs);

  // x (B, hidden) float32, updated in place: every layer applied to one new token per sequence.
  // cos, sin (B, D) float32 for the tokens' positions; slots (B,) int64; block_tables (B, W) int64;
  // context_lens (B,) int64 (including the new token).
  void step(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
            const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, int64_t split_blocks);

  // Gemma 3: GELU(tanh) instead of SiLU (act 1), sliding layers attending to their last `window` keys.
  void set_style(int64_t act, int64_t window);
  // Layer i's Gemma 3 norms (each float32 and contiguous, or empty: none) and whether it slides.
  void set_layer_norms(int64_t i, const torch::Tensor& q_norm, const torch::Tensor& k_norm,
                       const torch::Tensor& post_attn, const torch::Tensor& post_ffw, bool sliding);
  // step for a model with sliding layers: those take the local RoPE tables (cos_l, sin_l (B, D)) and the sliding
  // layers' own slots, block tables and context lengths (a hybrid KV cache's window blocks).
  void step_hybrid(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   const torch::Tensor& slots, const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                   double scale, int64_t split_blocks, const torch::Tensor& cos_l, const torch::Tensor& sin_l,
                   const torch::Tensor& slots_l, const torch::Tensor& block_tables_l,
                   const torch::Tensor& context_lens_l);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  int64_t hidden_, inter_, H_, KVH_, D_;
  float eps_;
  int64_t kind_;
  int64_t act_kind_ = 0, window_ = 0;
  std::vector<DecodeLayer> layers_;
  std::vector<float> h_, qkv_, att_, qbuf_, gu_, act_, y_, tmp_;

  void push_layer(DecodeLayer L);  // the checks shared by both add_layer forms
};

}  // namespace kvk
