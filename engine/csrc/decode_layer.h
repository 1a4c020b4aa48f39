// pdserve CPU kernels: the weight formats the kernels read, as one enum, and the fused decode layer that runs a
// whole decoder layer in one call. bindings.cpp exports both; engine/weight_formats.py names its formats by this
// enum (one place for the codes: a format unknown here is an error, never a guess).
#pragma once
#include "kernels.h"

#include <memory>
#include <tuple>

namespace pdserve {

// One linear layer's weight format, as the kernels read it (engine/quant.py makes each; the comments in
// linear_rows.cpp, panels.cpp and int_dots.cpp describe the bytes). The values are stable: engine/weight_formats.py
// keeps a mirror of them for builds without the kernels, checked equal by tests/engine/test_weight_formats.py.
enum class WeightFormat : int64_t {
  FP32_ROWS = 0,    // float32 [N, K]                         linear_fp32
  INT8_ROWS = 1,    // int8 [N, K], scale [N]                  linear_int8
  INT4_ROWS = 2,    // int4 [N, K/2], scale [N, K/G]           linear_int4
  W8A8_ROWS = 3,    // int8 [N, K] in step order, scale [N]    linear_w8a8
  W4A8_ROWS = 4,    // int4 [N, K/2], scale [N, K/G]           linear_w4a8
  FP32_PANELS = 5,  // float32 [NP, K, B]: oneDNN's panels     linear_panel
  W8A8_PANELS = 6,  // the integer panel format                linear_w8a8_panels (AVX2 / AVX-512 builds)
  W4A8_PANELS = 7,  // the integer panel format                linear_w4a8_panels (AVX2 / AVX-512 builds)
  INT8_PANELS = 8,  // int8 in float-style panels              linear_int8_panels
  INT4_PANELS = 9,  // int4 in float-style panels              linear_int4_panels
};

// whether this build has the kernel of a format (the integer panel formats need AVX2 or AVX-512)
inline bool format_built(WeightFormat f) {
  return Q_ISA >= 2 || (f != WeightFormat::W8A8_PANELS && f != WeightFormat::W4A8_PANELS);
}

// One linear layer's weights in one of the formats above; N is the layer's output count.
struct KLinear {
  WeightFormat format;
  torch::Tensor w;
  c10::optional<torch::Tensor> scale, bias;
  int64_t group, N;
  torch::Tensor operator()(const torch::Tensor& x, const PanelPrefetch& pf) const;
};
// (format, w, scale or None, bias or None, group, N)
using KLinearSpec = std::tuple<WeightFormat, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                               int64_t, int64_t>;
KLinear make_linear(const KLinearSpec& s);

// A whole decoder layer for a batch of single-token decodes (decode_layer.cpp). ``pf`` is the owning model's panel
// prefetch distances (engine/prefetch_tuning.py), shared: re-tuning the model reaches its fused layers.
struct DecodeLayer {
  KLinear qkv, o, gate_up, down;
  torch::Tensor in_norm, post_norm;
  c10::optional<torch::Tensor> q_norm, k_norm;  // Qwen3: each query / key head RMS-normalised before RoPE
  c10::optional<torch::Tensor> attn_out_norm, mlp_out_norm;  // Gemma 3: the outputs normalised before the residual
  bool gelu;  // GeGLU (Gemma) instead of SwiGLU
  double eps;
  int64_t H, Hkv, D, window;
  double sm_scale;
  std::shared_ptr<PanelPrefetch> pf;

  DecodeLayer(const KLinearSpec& qkv_, const KLinearSpec& o_, const KLinearSpec& gu_, const KLinearSpec& down_,
              torch::Tensor in_norm_, torch::Tensor post_norm_, double eps_, int64_t H_, int64_t Hkv_, int64_t D_,
              int64_t window_, double sm_scale_, std::shared_ptr<PanelPrefetch> pf_,
              c10::optional<torch::Tensor> q_norm_ = c10::nullopt, c10::optional<torch::Tensor> k_norm_ = c10::nullopt,
              c10::optional<torch::Tensor> attn_out_norm_ = c10::nullopt,
              c10::optional<torch::Tensor> mlp_out_norm_ = c10::nullopt, bool gelu_ = false);

  // h [T, hidden] float32, every row one decode; cos/sin [T, 1, D/2]; slots [T]; block_tables/ctx_lens as
  // paged_decode_attention. Writes this step's K/V into the caches and returns the layer's output [T, hidden].
  torch::Tensor forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                        torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
                        torch::Tensor ctx_lens) const;
};

}  // namespace pdserve
