// pdserve CPU kernels: the small per-layer ops (RMSNorm, silu * mul, RoPE), float32.
#include "kernels.h"

namespace pdserve {

// ---- small per-layer ops at float32 (torch runs each as several kernels: ~16 us for an RMSNorm at batch 1) ----

// one row of rms_norm (y may be x): every RMSNorm of the kernels, the fused decode layer's q/k norms included, goes
// through this one function, so they round alike whatever the compiler makes of the loops
void rms_norm_row(const float* xr, float* yr, int64_t H, const float* wp, float feps) {
  float ss = 0.f;
  for (int64_t k = 0; k < H; ++k) ss += xr[k] * xr[k];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
  for (int64_t k = 0; k < H; ++k) yr[k] = wp[k] * (xr[k] * r);
}

// y = w * (x / sqrt(mean(x^2) + eps)) row by row: HF's LlamaRMSNorm at float32
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, H]");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.is_contiguous() && w.numel() == H, "w must be float32 [H]");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_row(xp + m * H, yp + m * H, H, wp, feps);
  });
  return y;
}

// gate_up [M, 2I] (gate, then up) -> silu(gate) * up [M, I]
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gate_up must be contiguous float32 [M, 2I]");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({M, I}, gu.options());
  const float* g = gu.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* gr = g + m * 2 * I; const float* ur = gr + I; float* yr = yp + m * I;
      int64_t j = 0;
      for (; j + 16 <= I; j += 16) {  // exp16: libm's expf is not vectorized here (6 ms for a 2048 x 2048 prompt)
        const v16f gv = load<v16f>(gr + j);
        store(yr + j, gv / (exp16(splat<v16f>(0.f) - gv) + 1.f) * load<v16f>(ur + j));
      }
      for (; j < I; ++j) yr[j] = gr[j] / (1.f + std::exp(-gr[j])) * ur[j];
    }
  });
  return y;
}

// gate_up [M, 2I] (gate, then up) -> gelu_tanh(gate) * up [M, I]: Gemma's GeGLU (HF's gelu_pytorch_tanh)
torch::Tensor gelu_tanh_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gate_up must be contiguous float32 [M, 2I]");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({M, I}, gu.options());
  const float* g = gu.data_ptr<float>(); float* yp = y.data_ptr<float>();
  constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* gr = g + m * 2 * I; const float* ur = gr + I; float* yr = yp + m * I;
      int64_t j = 0;
      for (; j + 16 <= I; j += 16) {  // 0.5 (1 + tanh(u)) = 1 / (1 + e^-2u): exp16, as silu (tanhf is not vectorized)
        const v16f x = load<v16f>(gr + j);
        const v16f u2 = (x + x * x * x * 0.044715f) * (2.f * kAlpha);
        store(yr + j, x / (exp16(splat<v16f>(0.f) - u2) + 1.f) * load<v16f>(ur + j));
      }
      for (; j < I; ++j) {
        const float x = gr[j];
        yr[j] = 0.5f * x * (1.f + std::tanh(kAlpha * (x + 0.044715f * x * x * x))) * ur[j];
      }
    }
  });
  return y;
}

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
// rotate-half RoPE in place on `heads` rows of D floats: x1 * cos - x2 * sin, x2 * cos + x1 * sin (HF layout)
void rope_rows(float* x, int64_t heads, int64_t D, const float* c, const float* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* r = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = r[i], b = r[i + half];
      const float lo = a * c[i] - b * s[i];
      const float hi = b * c[i] + a * s[i];
      r[i] = lo; r[i + half] = hi;
    }
  }
}

// RoPE in place on the first `heads` heads of every row of x [T, Hx, D] (contiguous: the qkv projection's output,
// query heads then KV heads), cos / sin [T, 1, D/2]: the fused decode layer's arithmetic for the other steps
// (prefill, mixed, verify), in one pass instead of torch's five temporaries.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be contiguous CPU float32 [T, heads, D]");
  const int64_t T = x.size(0), Hx = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(heads >= 0 && heads <= Hx, "heads must be in [0, x.size(1)]");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == T * half && sin.numel() == T * half, "cos/sin must be float32 [T, 1, D/2]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>(); const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(heads * D, 1)), [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) rope_rows(xp + t * Hx * D, heads, D, cp + t * half, sp + t * half);
  });
}
#pragma GCC pop_options

}  // namespace pdserve
