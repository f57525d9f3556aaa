// 4. a whole decode step of a Llama-family model with packed weights, in one call: x <- layer(x) for every layer
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

void DecodeModel::add_layer(const torch::Tensor& ln1, const torch::Tensor& ln2, const torch::Tensor& qkv_bias,
                            const torch::Tensor& qkv_qs, const torch::Tensor& qkv_sc, int64_t qkv_bits,
                            const torch::Tensor& o_qs, const torch::Tensor& o_sc, int64_t o_bits,
                            const torch::Tensor& gu_qs, const torch::Tensor& gu_sc, int64_t gu_bits,
                            const torch::Tensor& dn_qs, const torch::Tensor& dn_sc, int64_t dn_bits,
                            const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& ks,
                            const torch::Tensor& vs) {
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

void DecodeModel::step(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                       const torch::Tensor& slots, const torch::Tensor& block_tables,
                       const torch::Tensor& context_lens, double scale, int64_t split_blocks) {
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

}  // namespace kvk
