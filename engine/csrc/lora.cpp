// pdserve CPU kernels: LoRA adapters' deltas for the rows of a batch (engine/lora.py), float32.
#include "kernels.h"

namespace pdserve {

// y[t, lo_k : lo_k + C_k] += (x[t] . A_k^T) B_k for every piece k and every row t whose slot is slot_k: one call per
// fused linear for the whole batch, whatever mix of adapters its rows use (S-LoRA's / Punica's batched adapters).
// A piece is one adapted projection of one adapter: A_k [r_k, K] (PEFT's lora_A), B_k [r_k, C_k] (lora_B^T with
// the scaling folded in), written at output columns lo_k. Pieces of one slot write different columns and pieces of
// different slots different rows, so the pieces run in parallel with no two writing one element. Within a piece each
// A row and each B row is read once for all of its rows (their x rows and r_k partial sums stay in cache).
void lora_apply_(torch::Tensor x, torch::Tensor y, torch::Tensor row_slot, std::vector<torch::Tensor> a,
                 std::vector<torch::Tensor> b, std::vector<int64_t> lo, std::vector<int64_t> slot) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, K]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat && y.is_contiguous() && y.size(0) == x.size(0),
              "y must be contiguous float32 [T, N]");
  TORCH_CHECK(row_slot.dim() == 1 && row_slot.scalar_type() == torch::kLong && row_slot.is_contiguous() &&
              row_slot.size(0) == x.size(0), "row_slot must be int64 [T]");
  const size_t P = a.size();
  TORCH_CHECK(b.size() == P && lo.size() == P && slot.size() == P, "a, b, lo and slot must have one entry a piece");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  for (size_t k = 0; k < P; ++k) {
    TORCH_CHECK(a[k].dim() == 2 && a[k].scalar_type() == torch::kFloat && a[k].is_contiguous() && a[k].size(1) == K,
                "a piece's A must be contiguous float32 [r, K]");
    TORCH_CHECK(b[k].dim() == 2 && b[k].scalar_type() == torch::kFloat && b[k].is_contiguous() &&
                b[k].size(0) == a[k].size(0) && lo[k] >= 0 && lo[k] + b[k].size(1) <= N,
                "a piece's B must be contiguous float32 [r, C] inside y's columns");
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t* sp = row_slot.data_ptr<int64_t>();
  at::parallel_for(0, static_cast<int64_t>(P), 1, [&](int64_t k0, int64_t k1) {
    std::vector<int64_t> rows;
    std::vector<float> u;
    for (int64_t k = k0; k < k1; ++k) {
      rows.clear();
      for (int64_t t = 0; t < T; ++t)
        if (sp[t] == slot[k]) rows.push_back(t);
      if (rows.empty()) continue;
      const int64_t R = a[k].size(0), C = b[k].size(1), n = static_cast<int64_t>(rows.size());
      const float* ap = a[k].data_ptr<float>();
      const float* bp = b[k].data_ptr<float>();
      u.assign(static_cast<size_t>(n * R), 0.f);
      // shrink: u[i, r] = x[rows[i]] . A[r]
      for (int64_t r = 0; r < R; ++r) {
        const float* ar = ap + r * K;
        for (int64_t i = 0; i < n; ++i) {
          const float* xr = xp + rows[i] * K;
          v16f acc{};
          int64_t j = 0;
          for (; j + 16 <= K; j += 16) acc = acc + load<v16f>(xr + j) * load<v16f>(ar + j);
          float s = hsum(acc);
          for (; j < K; ++j) s += xr[j] * ar[j];
          u[i * R + r] = s;
        }
      }
      // expand: y[rows[i], lo : lo + C] += sum_r u[i, r] B[r]
      for (int64_t i = 0; i < n; ++i) {
        float* yr = yp + rows[i] * N + lo[k];
        const float* ui = u.data() + i * R;
        int64_t j = 0;
        for (; j + 16 <= C; j += 16) {
          v16f acc = load<v16f>(yr + j);
          for (int64_t r = 0; r < R; ++r) acc = acc + splat<v16f>(ui[r]) * load<v16f>(bp + r * C + j);
          store(yr + j, acc);
        }
        for (; j < C; ++j) {
          float s = yr[j];
          for (int64_t r = 0; r < R; ++r) s += ui[r] * bp[r * C + j];
          yr[j] = s;
        }
      }
    }
  });
}

}  // namespace pdserve
