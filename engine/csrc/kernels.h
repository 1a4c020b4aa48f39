// pdserve CPU kernels: what the op files share (tile shapes, argument checks, the KV cache row reader,
// the panel prefetch distances) and the entry points each op file defines, for the fused layer and the bindings.
//
// Built at first use by engine/kernels.py (torch.utils.cpp_extension, -O3 -march=native, every .cpp of this
// folder; the build's name hashes every source and header). Everything is parallel over output columns
// (linears) or (sequence, KV head) pairs (attention) with at::parallel_for, i.e. torch's own OpenMP pool, so the
// kernels share the engine's threads instead of adding a second pool.
//
// Weight formats (see engine/quant.py, which makes them):
//   fp32: w [N, K] float, row n is output n.
//   int8: w [N, K] int8 and scale [N] float: W[n, k] = w[n, k] * scale[n] (per output channel).
//   int4: w [N, K/2] uint8 and scale [N, K/G] float, G % 32 == 0: in each run of 32 values of a row,
//         byte j (0..15) holds value j in its low nibble and value j + 16 in its high nibble, both
//         stored as q + 8 (q in [-8, 7]); W[n, k] = q * scale[n, k / G].
// KV cache formats for paged attention, [num_blocks, block_size, Hkv, Dp]:
//   float32 or bfloat16 with Dp = D; int8 with Dp = D + 4, the last 4 bytes of each (token, head) row
//   being that row's float32 scale (x = q * scale).
//
// Files: simd.h (the one SIMD vocabulary, where every instruction-set choice is made), linear_rows.cpp (fp32 / int8 /
// int4 weights as rows), panels.cpp (fp32 on oneDNN's packed panels, int8 / int4 in the same panels), int_dots.cpp
// (w8a8 / w4a8: rows and integer panels), norm_act.cpp (RMSNorm, silu * mul, RoPE), decode_attention.cpp,
// prefill_attention.cpp, decode_layer.cpp (a whole decoder layer per call), lora.cpp (LoRA adapters' deltas),
// bindings.cpp (the Python module, the weight-format enum).
#pragma once
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdserve {

// ---- linear tiles ----------------------------------------------------------------------------------------
// The tile fits the register file: with AVX-512 (32 registers of 16 floats) 4 output rows x 4 inputs keep
// 16 accumulators in registers; with AVX2 (16 registers of 8 floats, a v16f takes two) 2 x 2 does.
constexpr int NR = V16_REGS == 1 ? 4 : 2;  // output rows per tile: their weights are read once for all M inputs
constexpr int MR = V16_REGS == 1 ? 4 : 2;  // inputs per pass

// Weight rows are short (K values: a few hundred bytes to a few KB) and a tile reads R of them side by side,
// a pattern the hardware prefetcher does not follow from one tile to the next: every step also prefetches
// the same step of the rows PF_TILES tiles ahead (measured: benchmarks/cpu_linear.py, docs/benchmarks/history.md).
constexpr int PF_TILES = 4;

inline void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) == K,
              "x must be a contiguous float32 [M, ", K, "] tensor");
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16");
}

inline const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
              "bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// ---- software prefetch of the panel kernels' weight stream -------------------------------------------------
// Software prefetch of the panel kernels' weight stream (fp32, int8, int4, w8a8, w4a8 panels): how many bytes
// of its stream a tile requests ahead of its loads, for products of one input row (one_row) and of several
// (rows); 0 = none. Whether it pays depends on the machine, so engine/prefetch_tuning.py measures it once per
// loaded model and keeps it on that model (a CausalLM's ``panel_prefetch``), which passes it to every panel
// kernel call and to its fused layers: two models in one process (a target and its draft) each keep what they
// measured. Measured: on Zen 4 prefetching a batch-1 stream cost a third of its rate; on an Intel Xeon (Emerald
// Rapids) it left batch 1 as it was and sped up 8 and 32 rows by 1.2-1.5x, where a tile re-reads its panel from
// L2 for every row group (docs/benchmarks/history.md). No result changes: prefetches load nothing into registers.
struct PanelPrefetch {
  int64_t one_row = 0, rows = 0;
  int64_t bytes(int64_t M) const { return M > 1 ? rows : one_row; }
};

// ---- KV cache rows (decode and prefill attention) ----------------------------------------------------------
enum class KV { F32, BF16, I8 };

// One cached row (token, kv head) as D floats, 16 at a time; the cache format is a template parameter
// so the inner loops carry no branch on it.
template <KV K>
struct Row {
  const uint8_t* p; int64_t D;
  inline v16f at(int64_t d) const {
    if constexpr (K == KV::F32) return load<v16f>(reinterpret_cast<const float*>(p) + d);
    else if constexpr (K == KV::BF16) return load_bf16(reinterpret_cast<const uint16_t*>(p) + d);
    else return load_b(reinterpret_cast<const int8_t*>(p) + d);
  }
  inline float scale() const {
    if constexpr (K != KV::I8) return 1.f;
    else { float s; std::memcpy(&s, p + D, sizeof s); return s; }
  }
};

// The cache format of a [num_blocks, block_size, Hkv, Dp] cache of head_dim D, its row width checked.
inline KV kv_kind(const torch::Tensor& cache, int64_t D) {
  const int64_t Dp = cache.size(3);
  switch (cache.scalar_type()) {
    case torch::kFloat: TORCH_CHECK(Dp == D, "float32 cache rows must be D wide"); return KV::F32;
    case torch::kBFloat16: TORCH_CHECK(Dp == D, "bfloat16 cache rows must be D wide"); return KV::BF16;
    case torch::kChar: TORCH_CHECK(Dp == D + 4, "int8 cache rows must be D + 4 bytes"); return KV::I8;
    default: TORCH_CHECK(false, "unsupported KV cache dtype");
  }
  return KV::F32;  // not reached: TORCH_CHECK(false) throws
}

// ---- entry points (each defined in its op file) ------------------------------------------------------------
// linear_rows.cpp
torch::Tensor linear_fp32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias);
torch::Tensor linear_int4(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t group,
                          c10::optional<torch::Tensor> bias);
// panels.cpp
torch::Tensor linear_panel(torch::Tensor x, torch::Tensor p, int64_t N, c10::optional<torch::Tensor> bias,
                           const PanelPrefetch& pf);
torch::Tensor linear_int8_panels(torch::Tensor x, torch::Tensor p, torch::Tensor scale, int64_t N,
                                 c10::optional<torch::Tensor> bias, const PanelPrefetch& pf);
torch::Tensor linear_int4_panels(torch::Tensor x, torch::Tensor p, torch::Tensor scale, int64_t N, int64_t group,
                                 c10::optional<torch::Tensor> bias, const PanelPrefetch& pf);
// int_dots.cpp
torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias);
torch::Tensor linear_w4a8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t group,
                          c10::optional<torch::Tensor> bias);
// (the integer panels: AVX2 / AVX-512 builds; elsewhere these refuse, and qpanel_width() is 0)
torch::Tensor linear_w8a8_panels(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t N,
                                 c10::optional<torch::Tensor> bias, const PanelPrefetch& pf);
torch::Tensor linear_w4a8_panels(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t N, int64_t group,
                                 c10::optional<torch::Tensor> bias, const PanelPrefetch& pf);
int64_t qstep();
int64_t qpanel_width();
bool qpanel_unsigned();
// norm_act.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
void rms_norm_row(const float* xr, float* yr, int64_t H, const float* wp, float feps);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor gelu_tanh_mul(torch::Tensor gu);
void rope_rows(float* x, int64_t heads, int64_t D, const float* c, const float* s);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads);
// lora.cpp
void lora_apply_(torch::Tensor x, torch::Tensor y, torch::Tensor row_slot, std::vector<torch::Tensor> a,
                 std::vector<torch::Tensor> b, std::vector<int64_t> lo, std::vector<int64_t> slot);
// decode_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t window,
                                     double sm_scale);
// prefill_attention.cpp
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t window, double sm_scale);
torch::Tensor prefill_attention_paged(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t ctx_len, int64_t window, double sm_scale);

}  // namespace pdserve
