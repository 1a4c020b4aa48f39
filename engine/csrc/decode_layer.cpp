// pdserve CPU kernels: a whole decoder layer for a batch of single-token decodes, in one call.
//
// At batch 1 a layer's Python (module calls, views, RoPE as 8 torch ops, the K/V write, dtype checks) costs
// about as much as streaming its weights; this runs the same steps with the same kernels in C++. RoPE and the
// K/V write are compiled without fast-math so they round exactly like the torch ops they replace: the fused
// layer gives the same numbers as DecoderLayer.forward (tests/engine/test_fused_decode.py).
#include "decode_layer.h"

namespace pdserve {

torch::Tensor KLinear::operator()(const torch::Tensor& x, const PanelPrefetch& pf) const {
  switch (format) {
    case WeightFormat::FP32_ROWS: return linear_fp32(x, w, bias);
    case WeightFormat::INT8_ROWS: return linear_int8(x, w, *scale, bias);
    case WeightFormat::INT4_ROWS: return linear_int4(x, w, *scale, group, bias);
    case WeightFormat::W8A8_ROWS: return linear_w8a8(x, w, *scale, bias);
    case WeightFormat::W4A8_ROWS: return linear_w4a8(x, w, *scale, group, bias);
    case WeightFormat::FP32_PANELS: return linear_panel(x, w, N, bias, pf);
    case WeightFormat::INT8_PANELS: return linear_int8_panels(x, w, *scale, N, bias, pf);
    case WeightFormat::INT4_PANELS: return linear_int4_panels(x, w, *scale, N, group, bias, pf);
    case WeightFormat::W8A8_PANELS: return linear_w8a8_panels(x, w, *scale, N, bias, pf);
    case WeightFormat::W4A8_PANELS: return linear_w4a8_panels(x, w, *scale, N, group, bias, pf);
    default: TORCH_CHECK(false, "weight format ", static_cast<int64_t>(format), " has no kernel");
  }
  return {};  // not reached: TORCH_CHECK(false) throws
}

KLinear make_linear(const KLinearSpec& s) {
  KLinear l{std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s), std::get<4>(s), std::get<5>(s)};
  const auto f = static_cast<int64_t>(l.format);
  TORCH_CHECK(f >= 0 && f <= 9 && format_built(l.format), "weight format ", f, " out of range for this build");
  TORCH_CHECK(l.format == WeightFormat::FP32_ROWS || l.format == WeightFormat::FP32_PANELS || l.scale.has_value(),
              "a quantized linear needs its scale");
  return l;
}

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
// one K or V row of D floats into a cache row: float32 as is, bfloat16 rounded to nearest even, int8 as
// engine/quant.py quantize_kv (values round(x / s), then s = max(max|x| / 127, FLT_MIN) as 4 bytes)
static void store_kv_row(uint8_t* dst, const float* x, int64_t D, torch::ScalarType dt) {
  if (dt == torch::kFloat) {
    std::memcpy(dst, x, D * sizeof(float));
  } else if (dt == torch::kBFloat16) {
    auto* o = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < D; ++i) {
      uint32_t u; std::memcpy(&u, &x[i], 4);
      o[i] = std::isnan(x[i]) ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
  } else {
    float amax = 0.f;
    for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = std::max(amax / 127.f, std::numeric_limits<float>::min());
    auto* o = reinterpret_cast<int8_t*>(dst);
    for (int64_t i = 0; i < D; ++i) o[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / s))));
    std::memcpy(dst + D, &s, 4);
  }
}
#pragma GCC pop_options

// a += b, elementwise
static void add_into(torch::Tensor& a, const torch::Tensor& b) {
  float* ap = a.data_ptr<float>(); const float* bp = b.data_ptr<float>();
  const int64_t n = a.numel();
  for (int64_t i = 0; i < n; ++i) ap[i] += bp[i];
}

DecodeLayer::DecodeLayer(const KLinearSpec& qkv_, const KLinearSpec& o_, const KLinearSpec& gu_, const KLinearSpec& down_,
                         torch::Tensor in_norm_, torch::Tensor post_norm_, double eps_, int64_t H_, int64_t Hkv_, int64_t D_,
                         int64_t window_, double sm_scale_, std::shared_ptr<PanelPrefetch> pf_,
                         c10::optional<torch::Tensor> q_norm_, c10::optional<torch::Tensor> k_norm_,
                         c10::optional<torch::Tensor> attn_out_norm_, c10::optional<torch::Tensor> mlp_out_norm_,
                         bool gelu_)
    : qkv(make_linear(qkv_)), o(make_linear(o_)), gate_up(make_linear(gu_)), down(make_linear(down_)),
      in_norm(in_norm_), post_norm(post_norm_), q_norm(q_norm_), k_norm(k_norm_), attn_out_norm(attn_out_norm_),
      mlp_out_norm(mlp_out_norm_), gelu(gelu_), eps(eps_), H(H_), Hkv(Hkv_), D(D_), window(window_),
      sm_scale(sm_scale_), pf(std::move(pf_)) {
  TORCH_CHECK(D % 16 == 0 && H % Hkv == 0, "head_dim must be a multiple of 16 and H a multiple of Hkv");
  TORCH_CHECK(pf != nullptr, "a fused layer needs its model's PanelPrefetch");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  for (const auto* w : {&q_norm, &k_norm})
    TORCH_CHECK(!w->has_value() || ((*w)->scalar_type() == torch::kFloat && (*w)->is_contiguous() && (*w)->numel() == D),
                "q_norm / k_norm must be float32 [head_dim]");
  TORCH_CHECK(attn_out_norm.has_value() == mlp_out_norm.has_value(), "attn_out_norm and mlp_out_norm come together");
  for (const auto* w : {&attn_out_norm, &mlp_out_norm})
    TORCH_CHECK(!w->has_value() || ((*w)->scalar_type() == torch::kFloat && (*w)->is_contiguous() &&
                                    (*w)->numel() == in_norm.numel()),
                "attn_out_norm / mlp_out_norm must be float32 [hidden]");
}

// RMSNorm of `heads` rows of D in place, each by rms_norm's own row function (norm_act.cpp), so the fused layer
// rounds exactly like the Python path's q/k norms on the kernels
static void norm_heads(float* x, int64_t heads, int64_t D, const float* w, float eps) {
  for (int64_t j = 0; j < heads; ++j) rms_norm_row(x + j * D, x + j * D, D, w, eps);
}

torch::Tensor DecodeLayer::forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                  torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
                                  torch::Tensor ctx_lens) const {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat && h.is_contiguous(), "h must be contiguous float32 [T, hidden]");
  const int64_t T = h.size(0), W = (H + 2 * Hkv) * D, half = D / 2;
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == T * half && sin.numel() == T * half, "cos/sin must be float32 [T, 1, D/2]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T, "slot_mapping must be int64 [T]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.scalar_type() == v_cache.scalar_type() && k_cache.size(2) == Hkv, "k_cache/v_cache must be [N, bs, Hkv, Dp]");
  const auto dt = k_cache.scalar_type();
  const int64_t esize = k_cache.element_size(), Dp = k_cache.size(3), nslots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(Dp == (dt == torch::kChar ? D + 4 : D), "cache rows must be D wide (D + 4 for int8)");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < nslots, "slot out of range");

  torch::Tensor x = qkv(rms_norm(h, in_norm, eps), *pf);  // [T, W]
  float* p = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>(); const float* sp = sin.data_ptr<float>();
  auto q = torch::empty({T, H, D}, h.options());
  float* qp = q.data_ptr<float>();
  auto* kb = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vb = static_cast<uint8_t*>(v_cache.data_ptr());
  const int64_t row_bytes = Dp * esize;
  const float* qn = q_norm ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm ? k_norm->data_ptr<float>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    float* r = p + t * W;
    if (qn != nullptr) {
      norm_heads(r, H, D, qn, static_cast<float>(eps));
      norm_heads(r + H * D, Hkv, D, kn, static_cast<float>(eps));
    }
    rope_rows(r, H + Hkv, D, cp + t * half, sp + t * half);
    std::memcpy(qp + t * H * D, r, H * D * sizeof(float));
    for (int64_t j = 0; j < Hkv; ++j) {
      store_kv_row(kb + (sl[t] * Hkv + j) * row_bytes, r + (H + j) * D, D, dt);
      store_kv_row(vb + (sl[t] * Hkv + j) * row_bytes, r + (H + Hkv + j) * D, D, dt);
    }
  }
  auto attn = paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, window, sm_scale);
  torch::Tensor h2 = o(attn.view({T, H * D}), *pf);
  if (attn_out_norm) h2 = rms_norm(h2, *attn_out_norm, eps);  // (Gemma 3: before the residual add)
  add_into(h2, h);
  torch::Tensor gu = gate_up(rms_norm(h2, post_norm, eps), *pf);
  torch::Tensor out = down(gelu ? gelu_tanh_mul(gu) : silu_mul(gu), *pf);
  if (mlp_out_norm) out = rms_norm(out, *mlp_out_norm, eps);
  add_into(out, h2);
  return out;
}

}  // namespace pdserve
