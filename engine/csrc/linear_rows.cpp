// pdserve CPU kernels: small-M linear layers over fp32 / int8 / int4 weights stored as rows.
//
// Weight formats (see engine/quant.py, which makes them):
//   fp32: w [N, K] float, row n is output n.
//   int8: w [N, K] int8 and scale [N] float: W[n, k] = w[n, k] * scale[n] (per output channel).
//   int4: w [N, K/2] uint8 and scale [N, K/G] float, G % 32 == 0: in each run of 32 values of a row,
//         byte j (0..15) holds value j in its low nibble and value j + 16 in its high nibble, both
//         stored as q + 8 (q in [-8, 7]); W[n, k] = q * scale[n, k / G].
#include "kernels.h"

namespace pdserve {

// ---- linear: y[M, N] = x[M, K] W^T (+ bias) for small M -------------------------------------------


// Each weight type gives row(n, k): W[n, k..k+15] as floats, and row2(n, k): W[n, k..k+31] as two halves.
struct Fp32W {
  const float* w; int64_t K;
  inline v16f row(int64_t n, int64_t k) const { return load<v16f>(w + n * K + k); }
  inline void prefetch(int64_t n, int64_t k) const { prefetch_line(w + n * K + k); }
  inline void row2(int64_t n, int64_t k, v16f& lo, v16f& hi) const { lo = row(n, k); hi = row(n, k + 16); }
  inline float out_scale(int64_t) const { return 1.f; }
};
struct Int8W {
  const int8_t* w; const float* scale; int64_t K;
  inline v16f row(int64_t n, int64_t k) const { return load_b(w + n * K + k); }
  inline void prefetch(int64_t n, int64_t k) const { if (k % 64 == 0) prefetch_line(w + n * K + k); }
  inline void row2(int64_t n, int64_t k, v16f& lo, v16f& hi) const { lo = row(n, k); hi = row(n, k + 16); }
  inline float out_scale(int64_t n) const { return scale[n]; }
};

// y[m0 .. m0+MRc-1, n .. n+R-1]: R weight rows read once (32 values at a time) for MRc inputs. MRc is a
// compile-time count so the accumulators of a 1-row (decode) tile stay in registers even with AVX2.
template <class W, int R, int MRc>
inline void tile(const W& wt, const float* x, int64_t ldx, int64_t m0, int64_t n,
                 int64_t K, float* y, int64_t ldy, const float* bias) {
  v16f acc[MRc][R];
  for (int i = 0; i < MRc; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = v16f{};
  int64_t k = 0;
  // 32 values a step (one widening load for int4) while the registers allow it: with 4 inputs the 16
  // accumulators and 8 weight vectors would spill
  if constexpr (MRc <= 2) for (; k + 32 <= K; k += 32) {
    v16f lo[R], hi[R];
    for (int r = 0; r < R; ++r) { wt.prefetch(n + r + PF_TILES * R, k); wt.prefetch(n + r + PF_TILES * R, k + 16); }
    for (int r = 0; r < R; ++r) wt.row2(n + r, k, lo[r], hi[r]);
    for (int i = 0; i < MRc; ++i) {
      const float* xi = x + (m0 + i) * ldx + k;
      v16f xl = load<v16f>(xi), xh = load<v16f>(xi + 16);
      for (int r = 0; r < R; ++r) acc[i][r] += xl * lo[r] + xh * hi[r];
    }
  }
  for (; k < K; k += 16) {
    v16f wv[R];
    for (int r = 0; r < R; ++r) wt.prefetch(n + r + PF_TILES * R, k);
    for (int r = 0; r < R; ++r) wv[r] = wt.row(n + r, k);
    for (int i = 0; i < MRc; ++i) {
      v16f xv = load<v16f>(x + (m0 + i) * ldx + k);
      for (int r = 0; r < R; ++r) acc[i][r] += xv * wv[r];
    }
  }
  for (int i = 0; i < MRc; ++i)
    for (int r = 0; r < R; ++r) {
      float v = hsum(acc[i][r]) * wt.out_scale(n + r);
      y[(m0 + i) * ldy + n + r] = bias ? v + bias[n + r] : v;
    }
}

// The rows m0 .. m0+mr-1 (mr <= MR) against R weight rows at n.
template <class W, int R>
inline void tile_rows(const W& wt, const float* x, int64_t ldx, int64_t m0, int64_t mr, int64_t n,
                      int64_t K, float* y, int64_t ldy, const float* bias) {
  switch (mr) {
    case 1: tile<W, R, 1>(wt, x, ldx, m0, n, K, y, ldy, bias); break;
    case 2: tile<W, R, 2>(wt, x, ldx, m0, n, K, y, ldy, bias); break;
    case 3: tile<W, R, 3>(wt, x, ldx, m0, n, K, y, ldy, bias); break;
    default: tile<W, R, MR>(wt, x, ldx, m0, n, K, y, ldy, bias); break;
  }
}

// int4: row(n, k) for k % 16 == 0 is the low (k % 32 < 16) or high nibbles of that run's 16 bytes as levels q
// scaled by the group's scale (int4_scaled); out_scale is 1.
// gidx[k / 16] is k's group: a table, so the inner loops carry no integer division.
struct Int4W {
  const uint8_t* w; const float* scale; int64_t K, ng; const int32_t* gidx;
  inline void prefetch(int64_t n, int64_t k) const { if (k % 128 == 0) prefetch_line(w + n * (K / 2) + k / 2); }
  inline v16f row(int64_t n, int64_t k) const {
    v16i q = widen_u8(w + n * (K / 2) + (k / 32) * 16);
    return int4_scaled((k & 16) ? (q >> 4) : (q & 15), scale[n * ng + gidx[k >> 4]]);
  }
  // both halves of a 32-value run from one widening load (k % 32 == 0; a run never straddles a group)
  inline void row2(int64_t n, int64_t k, v16f& lo, v16f& hi) const {
    v16i q = widen_u8(w + n * (K / 2) + k / 2);
    float s = scale[n * ng + gidx[k >> 4]];
    lo = int4_scaled(q & 15, s);
    hi = int4_scaled(q >> 4, s);
  }
  inline float out_scale(int64_t) const { return 1.f; }
};

// A tile of rows already widened to float32 (row r of the tile at buf + r * K), with the source's scales.
template <class W>
struct Widened {
  const float* buf; const W& src; int64_t n0, K;
  inline v16f row(int64_t n, int64_t k) const { return load<v16f>(buf + (n - n0) * K + k); }
  inline void prefetch(int64_t, int64_t) const {}  // already in cache
  inline void row2(int64_t n, int64_t k, v16f& lo, v16f& hi) const { lo = row(n, k); hi = row(n, k + 16); }
  inline float out_scale(int64_t n) const { return src.out_scale(n); }
};

template <class W>
void linear_rows(const W& wt, const float* x, int64_t M, int64_t K, int64_t N, float* y,
                 const float* bias) {
  // grain: enough tiles per task that a thread streams a long contiguous slice of the weight.
  // An int4 tile with many 4-row passes is widened to float32 once (its decode costs more than a float
  // load); int8 decodes in two instructions and is read directly (measured: docs/benchmarks/history.md).
  constexpr bool narrow = std::is_same_v<W, Int4W>;
  at::parallel_for(0, (N + NR - 1) / NR, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      int64_t n = t * NR;
      if (narrow && M > 4 * MR && n + NR <= N) {
        // several passes over this tile: widen its narrow rows once, then every pass reads floats
        buf.resize(NR * K);
        for (int r = 0; r < NR; ++r)  // (row2 measured slower here than row)
          for (int64_t k = 0; k < K; k += 16) store(buf.data() + r * K + k, wt.row(n + r, k));
        Widened<W> wide{buf.data(), wt, n, K};
        for (int64_t m0 = 0; m0 < M; m0 += MR)
          tile_rows<Widened<W>, NR>(wide, x, K, m0, std::min<int64_t>(MR, M - m0), n, K, y, N, bias);
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        int64_t mr = std::min<int64_t>(MR, M - m0);
        if (n + NR <= N) tile_rows<W, NR>(wt, x, K, m0, mr, n, K, y, N, bias);
        else for (int64_t j = n; j < N; ++j) tile_rows<W, 1>(wt, x, K, m0, mr, j, K, y, N, bias);
      }
    }
  });
}

torch::Tensor linear_fp32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K);
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.is_contiguous(), "w must be contiguous float32 [N, K]");
  auto y = torch::empty({x.size(0), N}, x.options());
  linear_rows(Fp32W{w.data_ptr<float>(), K}, x.data_ptr<float>(), x.size(0), K, N, y.data_ptr<float>(),
              bias_ptr(bias, N));
  return y;
}

torch::Tensor linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K);
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.numel() == N && scale.is_contiguous(), "scale must be float32 [N]");
  auto y = torch::empty({x.size(0), N}, x.options());
  linear_rows(Int8W{w.data_ptr<int8_t>(), scale.data_ptr<float>(), K}, x.data_ptr<float>(), x.size(0), K, N,
              y.data_ptr<float>(), bias_ptr(bias, N));
  return y;
}

torch::Tensor linear_int4(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t group,
                          c10::optional<torch::Tensor> bias) {
  const int64_t N = w.size(0), K = 2 * w.size(1);
  check_x(x, K);
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous(), "w must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == N * (K / group),
              "scale must be float32 [N, K/group]");
  auto y = torch::empty({x.size(0), N}, x.options());
  std::vector<int32_t> gidx(K / 16);
  for (int64_t c = 0; c < K / 16; ++c) gidx[c] = static_cast<int32_t>(c * 16 / group);
  linear_rows(Int4W{w.data_ptr<uint8_t>(), scale.data_ptr<float>(), K, K / group, gidx.data()}, x.data_ptr<float>(),
              x.size(0), K, N, y.data_ptr<float>(), bias_ptr(bias, N));
  return y;
}

}  // namespace pdserve
