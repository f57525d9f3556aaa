// 4. a whole decode step of a Llama-family model with packed weights (qmm.cpp) or GGUF matrices in place
//    (kquant.cpp), in one call: x <- layer(x) for every layer
//    (see kvkeeper.worker.fused_decode for the contract).  It calls the routines of the layer-by-layer path
//    (elementwise.cpp, qmm.cpp, attention.cpp), so a decode token gets bit-identical results whichever path its
//    step takes.
#include "common.h"

namespace kvk {

DecodeModel::DecodeModel(int64_t hidden, int64_t inter, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                         int64_t kind)
    : hidden_(hidden), inter_(inter), H_(heads), KVH_(kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
      kind_(kind) {
  TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0 && kind >= 0 && kind <= 4, "DecodeModel: bad shapes");
}

void proj_raw(const float* x, int64_t M, const Proj& p, float* y, std::vector<float>& tmp) {
  if (p.parts.empty()) {
    qmm_raw(x, M, p.qw, y);
    return;
  }
  // every part's product in one parallel region: a part without a permutation straight into its columns of y,
  // a permuted one into tmp, then its columns into place
  const int64_t np = static_cast<int64_t>(p.parts.size());
  std::vector<const uint8_t*> w(np);
  std::vector<int64_t> type(np), n(np), ldy(np);
  std::vector<float*> out(np);
  int64_t tmp_n = 0;
  for (const GGUFPart& g : p.parts) tmp_n += g.perm != nullptr ? M * g.n : 0;
  tmp.resize(tmp_n);
  int64_t off = 0, toff = 0;
  for (int64_t i = 0; i < np; ++i) {
    const GGUFPart& g = p.parts[i];
    w[i] = g.w, type[i] = g.type, n[i] = g.n;
    if (g.perm != nullptr) {
      out[i] = tmp.data() + toff, ldy[i] = g.n;
      toff += M * g.n;
    } else {
      out[i] = y + off, ldy[i] = p.n;
    }
    off += g.n;
  }
  kquant::matmul_many(x, M, p.parts[0].k, w.data(), type.data(), n.data(), out.data(), ldy.data(), np);
  off = 0, toff = 0;
  for (const GGUFPart& g : p.parts) {
    if (g.perm != nullptr) {
      for (int64_t m = 0; m < M; ++m) {
        const float* src = tmp.data() + toff + m * g.n;
        float* dst = y + m * p.n + off;
        for (int64_t r = 0; r < g.n; ++r) dst[r] = src[g.perm[r]];
      }
      toff += M * g.n;
    }
    off += g.n;
  }
}

namespace {

Proj packed_proj(const torch::Tensor& qs, const torch::Tensor& sc, int64_t bits, int64_t n, int64_t k) {
  Proj p;
  p.qw = make_qw(qs, sc, bits, n);
  TORCH_CHECK(qs.size(1) * QK == k, "DecodeModel: a packed weight has K=", qs.size(1) * QK, ", the model needs ", k);
  p.n = n;
  return p;
}

Proj gguf_proj(const DecodeModel::Parts& parts, int64_t n, int64_t k, std::vector<torch::Tensor>& keep) {
  Proj p;
  for (const auto& [w, type, pn, pk, perm] : parts) {
    TORCH_CHECK(pk == k, "DecodeModel: a GGUF part has K=", pk, ", the model needs ", k);
    TORCH_CHECK(type != 1, "DecodeModel: F16 parts run layer by layer (their prefill takes torch's GEMM)");
    const uint8_t* wp = kquant::weight_ptr(w, type, pn, pk);
    const bool has_perm = perm.defined() && perm.numel() > 0;
    TORCH_CHECK(!has_perm || (perm.scalar_type() == at::kLong && perm.numel() == pn && perm.is_contiguous()),
                "DecodeModel: perm must be contiguous int64 (N,)");
    if (has_perm) {
      const int64_t* pp = perm.data_ptr<int64_t>();
      for (int64_t r = 0; r < pn; ++r) TORCH_CHECK(pp[r] >= 0 && pp[r] < pn, "DecodeModel: perm out of range");
    }
    p.parts.push_back({wp, type, pn, pk, has_perm ? perm.data_ptr<int64_t>() : nullptr});
    keep.push_back(w);
    if (has_perm) keep.push_back(perm);
    p.n += pn;
  }
  TORCH_CHECK(!p.parts.empty() && p.n == n, "DecodeModel: GGUF parts give ", p.n, " outputs, the model needs ", n);
  return p;
}

}  // namespace

void DecodeModel::add_layer(const torch::Tensor& ln1, const torch::Tensor& ln2, const torch::Tensor& qkv_bias,
                            const torch::Tensor& qkv_qs, const torch::Tensor& qkv_sc, int64_t qkv_bits,
                            const torch::Tensor& o_qs, const torch::Tensor& o_sc, int64_t o_bits,
                            const torch::Tensor& gu_qs, const torch::Tensor& gu_sc, int64_t gu_bits,
                            const torch::Tensor& dn_qs, const torch::Tensor& dn_sc, int64_t dn_bits,
                            const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& ks,
                            const torch::Tensor& vs) {
  // shape checks happen here, once, so that step() can use raw pointers
  DecodeLayer L{ln1, ln2, qkv_bias};
  L.qkv = packed_proj(qkv_qs, qkv_sc, qkv_bits, (H_ + 2 * KVH_) * D_, hidden_);
  L.o = packed_proj(o_qs, o_sc, o_bits, hidden_, H_ * D_);
  L.gu = packed_proj(gu_qs, gu_sc, gu_bits, 2 * inter_, hidden_);
  L.dn = packed_proj(dn_qs, dn_sc, dn_bits, hidden_, inter_);
  L.keep = {qkv_qs, qkv_sc, o_qs, o_sc, gu_qs, gu_sc, dn_qs, dn_sc};
  L.k = k, L.v = v, L.ks = ks, L.vs = vs;
  push_layer(std::move(L));
}

void DecodeModel::add_layer_gguf(const torch::Tensor& ln1, const torch::Tensor& ln2, const torch::Tensor& qkv_bias,
                                 const Parts& qkv, const Parts& o, const Parts& gu, const Parts& dn,
                                 const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& ks,
                                 const torch::Tensor& vs) {
  DecodeLayer L{ln1, ln2, qkv_bias};
  L.qkv = gguf_proj(qkv, (H_ + 2 * KVH_) * D_, hidden_, L.keep);
  L.o = gguf_proj(o, hidden_, H_ * D_, L.keep);
  L.gu = gguf_proj(gu, 2 * inter_, hidden_, L.keep);
  L.dn = gguf_proj(dn, hidden_, inter_, L.keep);
  L.k = k, L.v = v, L.ks = ks, L.vs = vs;
  push_layer(std::move(L));
}

void DecodeModel::push_layer(DecodeLayer L) {
  const int64_t qkv_n = (H_ + 2 * KVH_) * D_;
  const torch::Tensor &ln1 = L.ln1, &ln2 = L.ln2, &qkv_bias = L.qkv_bias, &k = L.k, &v = L.v, &ks = L.ks, &vs = L.vs;
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
  if (qkv_bias.defined() && qkv_bias.numel() == 0) L.qkv_bias = torch::Tensor();
  layers_.push_back(std::move(L));
}

void DecodeModel::set_style(int64_t act, int64_t window) {
  TORCH_CHECK((act == 0 || act == 1) && window >= 0, "DecodeModel.set_style: act 0 (SiLU) or 1 (GELU), window >= 0");
  act_kind_ = act, window_ = window;
}

void DecodeModel::set_layer_norms(int64_t i, const torch::Tensor& q_norm, const torch::Tensor& k_norm,
                                  const torch::Tensor& post_attn, const torch::Tensor& post_ffw, bool sliding) {
  TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeModel.set_layer_norms: no layer ", i);
  const auto ok = [](const torch::Tensor& t, int64_t n) {
    return !t.defined() || t.numel() == 0 || (t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n);
  };
  TORCH_CHECK(ok(q_norm, D_) && ok(k_norm, D_) && ok(post_attn, hidden_) && ok(post_ffw, hidden_),
              "DecodeModel.set_layer_norms: q/k norms (head_dim,), post norms (hidden,) float32 contiguous or empty");
  const auto keep = [](const torch::Tensor& t) { return t.defined() && t.numel() > 0 ? t : torch::Tensor(); };
  DecodeLayer& L = layers_[i];
  L.q_norm = keep(q_norm), L.k_norm = keep(k_norm), L.post_attn = keep(post_attn), L.post_ffw = keep(post_ffw);
  L.sliding = sliding;
}

namespace {

// One set of per-token step inputs: RoPE rows and where the layers using them read and write the cache.
struct StepTables {
  const float *cs, *sn;
  const int64_t *sl, *bt, *ctx;
  int64_t W;
};

StepTables check_tables(int64_t B, int64_t D, int64_t BS, int64_t NB, const torch::Tensor& cos,
                        const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& block_tables,
                        const torch::Tensor& context_lens) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.numel() == B * D && sin.numel() == B * D,
              "DecodeModel.step: cos and sin must be contiguous float32 (B, head_dim)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B && block_tables.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == at::kLong && context_lens.numel() == B &&
                  context_lens.is_contiguous() && slots.is_contiguous(),
              "DecodeModel.step: slots (B,), block_tables (B, W), context_lens (B,) int64 contiguous");
  const int64_t W = block_tables.size(1);
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ctx[b] >= 1 && ctx[b] <= W * BS, "DecodeModel.step: context length ", ctx[b], " of row ", b,
                " outside its block table");
    TORCH_CHECK(sl[b] >= 0 && sl[b] < NB * BS, "DecodeModel.step: slot ", sl[b], " outside the cache");
    for (int64_t j = 0; j < (ctx[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(bt[b * W + j] >= 0 && bt[b * W + j] < NB, "DecodeModel.step: block ", bt[b * W + j], " of row ",
                  b, " outside the cache");
  }
  return {cos.data_ptr<float>(), sin.data_ptr<float>(), sl, bt, ctx, W};
}

}  // namespace

void DecodeModel::step(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                       const torch::Tensor& slots, const torch::Tensor& block_tables,
                       const torch::Tensor& context_lens, double scale, int64_t split_blocks) {
  step_hybrid(x, cos, sin, slots, block_tables, context_lens, scale, split_blocks, cos, sin, slots, block_tables,
              context_lens);
}

void DecodeModel::step_hybrid(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                              const torch::Tensor& slots, const torch::Tensor& block_tables,
                              const torch::Tensor& context_lens, double scale, int64_t split_blocks,
                              const torch::Tensor& cos_l, const torch::Tensor& sin_l, const torch::Tensor& slots_l,
                              const torch::Tensor& block_tables_l, const torch::Tensor& context_lens_l) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "DecodeModel.step: x must be contiguous float32 (B, hidden)");
  const int64_t B = x.size(0);
  if (layers_.empty() || B == 0) return;
  bool any_sliding = false, any_full = false;
  for (const DecodeLayer& L : layers_) (L.sliding ? any_sliding : any_full) = true;
  // each set is checked against the cache of a layer that uses it (sliding layers' caches hold window blocks)
  const DecodeLayer& Lg = *std::find_if(layers_.begin(), layers_.end(), [&](const DecodeLayer& L) {
    return L.sliding == !any_full;
  });
  const StepTables full = check_tables(B, D_, Lg.k.size(1), Lg.k.size(0), cos, sin, slots, block_tables,
                                       context_lens);
  StepTables local = full;
  if (any_sliding) {
    const DecodeLayer& Ls = *std::find_if(layers_.begin(), layers_.end(), [](const DecodeLayer& L) {
      return L.sliding;
    });
    local = check_tables(B, D_, Ls.k.size(1), Ls.k.size(0), cos_l, sin_l, slots_l, block_tables_l, context_lens_l);
  }
  const int64_t qn = H_ * D_, kvn = KVH_ * D_, qkv_n = qn + 2 * kvn;
  h_.resize(B * hidden_);
  qkv_.resize(B * qkv_n);
  att_.resize(B * qn);
  gu_.resize(B * 2 * inter_);
  act_.resize(B * inter_);
  y_.resize(B * hidden_);
  qbuf_.resize(B * qn);
  float* xp = x.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const bool quant = kind_ == KV_I8 || kind_ == KV_FP8;
  for (const DecodeLayer& L : layers_) {
    const StepTables& t = L.sliding ? local : full;
    rmsnorm_rows(xp, L.ln1.data_ptr<float>(), B, hidden_, eps_, h_.data());
    proj_raw(h_.data(), B, L.qkv, qkv_.data(), tmp_);
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkv_.data() + b * qkv_n;
      if (L.qkv_bias.defined()) {
        const float* bias = L.qkv_bias.data_ptr<float>();
        for (int64_t i = 0; i < qkv_n; ++i) row[i] += bias[i];
      }
      if (L.q_norm.defined()) rmsnorm_rows(row, L.q_norm.data_ptr<float>(), H_, D_, eps_, row);
      if (L.k_norm.defined()) rmsnorm_rows(row + qn, L.k_norm.data_ptr<float>(), KVH_, D_, eps_, row + qn);
      rope_heads(row, H_ + KVH_, D_, t.cs + b * D_, t.sn + b * D_);  // q and k heads are adjacent
      for (int64_t i = 0; i < qn; ++i) row[i] *= fscale;              // the softmax scale, folded into q
      store_token(row + qn, KVH_, D_, L.k.data_ptr(), quant ? reinterpret_cast<uint16_t*>(L.ks.data_ptr<at::Half>()) : nullptr,
                  t.sl[b], kind_);
      store_token(row + qn + kvn, KVH_, D_, L.v.data_ptr(), quant ? reinterpret_cast<uint16_t*>(L.vs.data_ptr<at::Half>()) : nullptr,
                  t.sl[b], kind_);
      std::memcpy(qbuf_.data() + b * qn, row, qn * sizeof(float));  // attention reads q as (B, H, D)
    }
    AttnArgs a{qbuf_.data(), L.k.data_ptr(), L.v.data_ptr(),
               quant ? reinterpret_cast<const uint16_t*>(L.ks.data_ptr<at::Half>()) : nullptr,
               quant ? reinterpret_cast<const uint16_t*>(L.vs.data_ptr<at::Half>()) : nullptr,
               t.bt, t.ctx, kind_, H_, KVH_, D_, L.k.size(1), t.W, H_ / KVH_, L.sliding ? window_ : 0};
    attention_raw(a, B, split_blocks, att_.data());
    proj_raw(att_.data(), B, L.o, y_.data(), tmp_);
    if (L.post_attn.defined()) rmsnorm_rows(y_.data(), L.post_attn.data_ptr<float>(), B, hidden_, eps_, y_.data());
    for (int64_t i = 0; i < B * hidden_; ++i) xp[i] += y_[i];
    rmsnorm_rows(xp, L.ln2.data_ptr<float>(), B, hidden_, eps_, h_.data());
    proj_raw(h_.data(), B, L.gu, gu_.data(), tmp_);
    if (act_kind_ == 1)
      gelu_mul_rows(gu_.data(), B, inter_, act_.data());  // GELU(tanh)(gate) * up
    else
      silu_mul_rows(gu_.data(), B, inter_, act_.data());  // SiLU(gate) * up
    proj_raw(act_.data(), B, L.dn, y_.data(), tmp_);
    if (L.post_ffw.defined()) rmsnorm_rows(y_.data(), L.post_ffw.data_ptr<float>(), B, hidden_, eps_, y_.data());
    for (int64_t i = 0; i < B * hidden_; ++i) xp[i] += y_[i];
  }
}

}  // namespace kvk
