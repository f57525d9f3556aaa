// 3. The element-wise parts of a layer: RMSNorm, SiLU(gate) * up, RoPE, storing a token's K/V.
//
// The fused decode step and the layer-by-layer path of a model with packed weights (kvkeeper.models.llama,
// via rmsnorm / silu_mul / rope_qk below) call the same routines, so a decode token gets bit-identical results
// whichever path its step takes.  Rows are independent (no cross-row arithmetic): a row's result does not
// depend on the batch.
#include "common.h"

namespace kvk {

namespace {
// RMSNorm (Zhang & Sennrich, 2019): y = x * (1 / sqrt(mean(x^2) + eps)) * w per row; the sum of squares in float64.
void rmsnorm_row(const float* xr, const float* w, int64_t N, float eps, float* y) {
  double ss = 0.0;
  for (int64_t i = 0; i < N; ++i) ss += static_cast<double>(xr[i]) * xr[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss / N) + eps);
  for (int64_t i = 0; i < N; ++i) y[i] = xr[i] * inv * w[i];
}
}  // namespace

void rmsnorm_rows(const float* x, const float* w, int64_t M, int64_t N, float eps, float* y) {
  parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(N, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rmsnorm_row(x + r * N, w, N, eps, y + r * N);
  });
}

// RoPE, half-split layout (as kvkeeper.layers.rope.apply_rope): x (heads, D) of one token, cos/sin (D).
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

namespace {
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
// act(gate) * up over M rows of gate_up (M, 2I) -> o (M, I): one row function per ISA.
using GatedRow = void (*)(const float*, int64_t, float*);
void gated_rows(const float* g, int64_t M, int64_t I, float* o, GatedRow fast_row, GatedRow generic_row) {
  const GatedRow row = use_avx512() ? fast_row : generic_row;
  parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(g + r * 2 * I, I, o + r * I);
  });
}
}  // namespace

void silu_mul_rows(const float* g, int64_t M, int64_t I, float* o) {
  gated_rows(g, M, I, o, silu_mul_row_avx512, silu_mul_row_generic);
}

// GELU with the tanh approximation (Hendrycks & Gimpel, 2016; PyTorch's approximate="tanh"), times up:
// o = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u, tanh(z) = 1 - 2 / (exp(2z) + 1).
namespace {
constexpr float GELU_C = 0.7978845608028654f, GELU_A = 0.044715f;

void gelu_mul_row_generic(const float* gu, int64_t I, float* o) {
  const float* u = gu + I;
  for (int64_t i = 0; i < I; ++i) {
    const float g = gu[i];
    const float t = 1.f - 2.f / (std::exp(2.f * GELU_C * (g + GELU_A * g * g * g)) + 1.f);
    o[i] = 0.5f * g * (1.f + t) * u[i];
  }
}

KVK_AVX512 void gelu_mul_row_avx512(const float* gu, int64_t I, float* o) {
  const float* u = gu + I;
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f), half = _mm512_set1_ps(0.5f);
  const __m512 c2 = _mm512_set1_ps(2.f * GELU_C), a = _mm512_set1_ps(GELU_A);
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 mk = I - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (I - i)) - 1u);
    const __m512 g = _mm512_maskz_loadu_ps(mk, gu + i);
    const __m512 z = _mm512_mul_ps(c2, _mm512_add_ps(g, _mm512_mul_ps(a, _mm512_mul_ps(g, _mm512_mul_ps(g, g)))));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(exp512(z), one)));
    _mm512_mask_storeu_ps(o + i, mk, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, t)),
                                                   _mm512_maskz_loadu_ps(mk, u + i)));
  }
}
}  // namespace

void gelu_mul_rows(const float* g, int64_t M, int64_t I, float* o) {
  gated_rows(g, M, I, o, gelu_mul_row_avx512, gelu_mul_row_generic);
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

namespace {
torch::Tensor gated(const torch::Tensor& gu, void (*rows)(const float*, int64_t, int64_t, float*), const char* name) {
  TORCH_CHECK(gu.scalar_type() == at::kFloat && gu.dim() == 2 && gu.size(1) % 2 == 0, name,
              ": gate_up must be (M, 2I) float32");
  const auto gc = gu.contiguous();
  const int64_t M = gc.size(0), I = gc.size(1) / 2;
  auto o = torch::empty({M, I}, gc.options());
  rows(gc.data_ptr<float>(), M, I, o.data_ptr<float>());
  return o;
}
}  // namespace

torch::Tensor silu_mul(const torch::Tensor& gu) { return gated(gu, silu_mul_rows, "silu_mul"); }

torch::Tensor gelu_mul(const torch::Tensor& gu) { return gated(gu, gelu_mul_rows, "gelu_mul"); }

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

}  // namespace kvk
