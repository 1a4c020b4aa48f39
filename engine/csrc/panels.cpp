// pdserve CPU kernels: linears on weights stored in panels of outputs (fp32 on oneDNN's prepacked layout,
// int8 / int4 weight-only in the same layout).
#include "kernels.h"

namespace pdserve {

// ---- fp32 on oneDNN's prepacked layout ---------------------------------------------------------------
// oneDNN prepacks a linear's [N, K] weight (engine/model.py Linear.pack) in panels of B outputs, K-major inside
// a panel: p[n / B][k][n % B] = W[n, k], N padded up to a multiple of B (B = 64 with torch 2.13 on AVX2 and
// AVX-512). That is the layout a small-M product wants: a step over k reads B contiguous weights and does
// one broadcast FMA per input row, with no horizontal sums. engine/model.py compares every packed weight
// with its dense original under this layout at load and hands it here only where they are equal, so the
// decode path reads the one prepacked copy of the weights (no second layout in memory) and oneDNN keeps the
// large-M products (prefill).
//
// Every output is one float accumulation over k in order (then + bias), whatever the tile, so a row's
// result does not depend on the batch it came in (tested: tests/engine/test_cpu_kernels.py).
// (Software prefetch of the weight stream: PanelPrefetch in kernels.h; the distances arrive with each call.)

// vectors of 16 outputs x input rows per tile: a whole 64-wide panel step (4 zmm) x 6 rows (24 zmm accumulators);
// with AVX2 (V16_REGS = 2) 2 x 2 (4 of the 16 ymm registers, 2 x 2 x 2 ymm accumulators)
constexpr int PNV = V16_REGS == 1 ? 4 : 2;
constexpr int PMR = V16_REGS == 1 ? 6 : 2;

// The weight as the panel kernel reads it, one k step (NV vectors of 16 outputs from column c of the panel)
// per call, k increasing by one from 0: float32 as is; int8 widened in registers (its per-output scale
// applied once at the end: [NP, K, B] and scale [NP * B], engine/quant.py to_panels_int8). int4 (PanelI4
// below) is [NP, K, B/2] bytes, byte j of a k row holding output j (low nibble) and j + B/2 (high), stored
// q + 8, with group scales [NP, K/G, B] (to_panels_int4), and has its own tile (panel_tile_i4).
template <class T>
struct PanelPlain {
  const T* p; int64_t B;
  template <int NV> inline void step(int64_t k, v16f* w) {
    for (int v = 0; v < NV; ++v) {
      if constexpr (std::is_same_v<T, float>) w[v] = load<v16f>(p + k * B + 16 * v);
      else w[v] = load_b(p + k * B + 16 * v);
    }
  }
  template <int NV> static constexpr int64_t step_bytes() { return 16 * NV * sizeof(T); }
  template <int NV> inline void prefetch(int64_t k) const {
    for (int64_t b = 0; b < step_bytes<NV>(); b += 64) prefetch_line(reinterpret_cast<const char*>(p + k * B) + b);
  }
  template <int NV> inline void prefetch_l2(int64_t k) const {
    for (int64_t b = 0; b < step_bytes<NV>(); b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p + k * B) + b, 0, 2);
  }
};
// int4 weight-only panels: the levels q - 8 are exact small integers, so a tile sums x * (q - 8) over one
// scale group in registers and scales that sum once at the group's end (out += scale * sum), instead of
// forming (q - 8) * scale per weight. On AVX-512 a tile of a whole panel turns 32 weights into levels with one
// widening load, one shift and two permutes through the 16 levels (vpermps reads an index's low 4 bits), where
// scaling each weight took twelve vector operations: 1.7x the rate at M=1, 1.5x at M=8 (benchmarks/cpu_linear.py,
// Zen 4). Loading two inputs' nibbles as one 64-byte line (no widening), or converting by vcvtdq2ps instead of
// the permute, measured no faster there: about three vector operations per 16 weights is the floor. A row's
// bits still do not depend on its batch: every row of every tile runs the same sums in the same order (tested).
struct PanelI4 {
  const uint8_t* p; int64_t B, c, G;
  const float* gs;   // this panel's scales [ng, B]
  // which nibbles a tile of NV vectors from column c reads, fixed for the whole tile so the k loop has no
  // branches: WHOLE = the tile is the whole panel (both nibbles of each byte, each byte loaded once), LOW /
  // HIGH = only low / only high nibbles, ANY = decided per vector
  enum Mode { WHOLE, LOW, HIGH, ANY };
  template <int NV> Mode mode() const {
    if (NV % 2 == 0 && c == 0 && B == 16 * NV) return WHOLE;
    if (c + 16 * NV <= B / 2) return LOW;
    if (c >= B / 2) return HIGH;
    return ANY;
  }
  // the bytes a tile of NV vectors reads at input k: half a line at most (B <= 128), one prefetch a step
  template <int NV> static constexpr int64_t step_bytes() { return 8 * NV; }
  template <int NV> inline void prefetch(int64_t k) const { prefetch_line(p + k * (B / 2) + (c < B / 2 ? c : c - B / 2)); }
  template <int NV> inline void prefetch_l2(int64_t k) const {
    __builtin_prefetch(p + k * (B / 2) + (c < B / 2 ? c : c - B / 2), 0, 2);
  }
  // the levels q - 8 (exact floats) of NV vectors of 16 outputs from column c at input k
  template <int NV, Mode M> __attribute__((always_inline)) inline void levels(int64_t k, v16f* w) const {
    const uint8_t* row = p + k * (B / 2);
    if constexpr (M == WHOLE) {
      for (int v = 0; v < NV / 2; ++v) {
        const v16i q = widen_u8(row + 16 * v);
        w[v] = int4_level(q, false);
        w[v + NV / 2] = int4_level(q, true);
      }
    } else {
      for (int v = 0; v < NV; ++v) {
        const int64_t col = c + 16 * v;
        const bool high = M == HIGH || (M == ANY && col >= B / 2);
        w[v] = int4_level(widen_u8(row + (high ? col - B / 2 : col)), high);
      }
    }
  }
};

// What a tile prefetches besides the k steps pfd ahead of its own stream: a tile whose panel was read before (a
// second, third, ... group of rows) has its next stream come from L2 and its arithmetic to do, so it also requests
// part of `next`, the tile this thread runs after it, into L2: rows [k0, k0 + K / R) of it, one every R of its own
// steps, R being the number of such passes. The first pass over the next tile then finds it in L2 instead of waiting
// on memory (measured on the Emerald Rapids Xeon, fp32 weights: the bench model's linears 1.13x faster at 32 rows,
// 1.07x at 16; int8 unchanged).
template <class PA>
struct Ahead {
  int64_t pfd = 0;              // own stream: k steps ahead (0: no prefetch at all)
  const PA* next = nullptr;     // the next tile into L2, or none
  int64_t R = 1, k0 = 0;
  // at every step of a PF tile: the own stream pfd ahead, and one row of `next` every R steps
  template <int NV> __attribute__((always_inline)) inline void step(const PA& pa, int64_t k, int64_t& cnt, int64_t& kk) const {
    pa.template prefetch<NV>(k + pfd);
    if (next && ++cnt == R) { cnt = 0; next->template prefetch_l2<NV>(kk++); }
  }
};

template <int NV, int MRc, PanelI4::Mode MODE, bool PF>
inline void panel_tile_i4_mode(const PanelI4& pa, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                               int64_t ncols, const float* bias, const Ahead<PanelI4>& ah) {
  int64_t cnt = 0, kk = ah.k0;
  float out[MRc][16 * NV];  // the sums of the finished groups
  for (int i = 0; i < MRc; ++i)
    for (int j = 0; j < 16 * NV; ++j) out[i][j] = 0.f;
  const float* s = pa.gs + pa.c;
  for (int64_t k0 = 0; k0 < K; k0 += pa.G, s += pa.B) {
    v16f acc[MRc][NV];
    for (int i = 0; i < MRc; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = v16f{};
    for (int64_t k = k0; k < k0 + pa.G; ++k) {
      v16f w[NV];
      if constexpr (PF) ah.template step<NV>(pa, k, cnt, kk);
      pa.template levels<NV, MODE>(k, w);
      for (int i = 0; i < MRc; ++i) {
        const v16f xb = splat<v16f>(x[i * ldx + k]);
        for (int v = 0; v < NV; ++v) acc[i][v] += xb * w[v];
      }
    }
    for (int i = 0; i < MRc; ++i)
      for (int v = 0; v < NV; ++v)
        store(out[i] + 16 * v, load<v16f>(out[i] + 16 * v) + acc[i][v] * load<v16f>(s + 16 * v));
  }
  for (int i = 0; i < MRc; ++i)
    for (int64_t j = 0; j < ncols; ++j) y[i * ldy + j] = bias ? out[i][j] + bias[j] : out[i][j];
}

template <int NV, int MRc, bool PF>
inline void panel_tile_i4_pf(const PanelI4& pa, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                             int64_t ncols, const float* bias, const Ahead<PanelI4>& ah) {
  switch (pa.mode<NV>()) {
    case PanelI4::WHOLE: panel_tile_i4_mode<NV, MRc, PanelI4::WHOLE, PF>(pa, K, x, ldx, y, ldy, ncols, bias, ah); break;
    case PanelI4::LOW: panel_tile_i4_mode<NV, MRc, PanelI4::LOW, PF>(pa, K, x, ldx, y, ldy, ncols, bias, ah); break;
    case PanelI4::HIGH: panel_tile_i4_mode<NV, MRc, PanelI4::HIGH, PF>(pa, K, x, ldx, y, ldy, ncols, bias, ah); break;
    default: panel_tile_i4_mode<NV, MRc, PanelI4::ANY, PF>(pa, K, x, ldx, y, ldy, ncols, bias, ah); break;
  }
}

template <class PA, int NV, int MRc, bool PF>
inline void panel_tile(PA pa, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t ncols,
                       const float* scale, const float* bias, const Ahead<PA>& ah) {
  int64_t cnt = 0, kk = ah.k0;
  v16f acc[MRc][NV];
  for (int i = 0; i < MRc; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = v16f{};
  for (int64_t k = 0; k < K; ++k) {
    v16f w[NV];
    if constexpr (PF) ah.template step<NV>(pa, k, cnt, kk);
    pa.template step<NV>(k, w);
    for (int i = 0; i < MRc; ++i) {
      const v16f xb = splat<v16f>(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] += xb * w[v];
    }
  }
  for (int i = 0; i < MRc; ++i) {
    float out[16 * NV];
    for (int v = 0; v < NV; ++v) store(out + 16 * v, scale ? acc[i][v] * load<v16f>(scale + 16 * v) : acc[i][v]);
    for (int64_t j = 0; j < ncols; ++j) y[i * ldy + j] = bias ? out[j] + bias[j] : out[j];
  }
}

template <class PA, int NV, int MRc, bool PF>
inline void tile_pf(const PA& pa, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t ncols,
                    const float* scale, const float* bias, const Ahead<PA>& ah) {
  if constexpr (std::is_same<PA, PanelI4>::value) panel_tile_i4_pf<NV, MRc, PF>(pa, K, x, ldx, y, ldy, ncols, bias, ah);
  else panel_tile<PA, NV, MRc, PF>(pa, K, x, ldx, y, ldy, ncols, scale, bias, ah);
}
// pfb: bytes of prefetch ahead (see PanelPrefetch), turned into k steps of this tile's stream; next, R, k0: see Ahead
template <class PA, int NV, int MRc>
inline void tile(const PA& pa, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t ncols,
                 const float* scale, const float* bias, int64_t pfb, const PA* next, int64_t R, int64_t k0) {
  const Ahead<PA> ah{pfb / PA::template step_bytes<NV>(), next, R, k0};
  if (ah.pfd > 0) tile_pf<PA, NV, MRc, true>(pa, K, x, ldx, y, ldy, ncols, scale, bias, ah);
  else tile_pf<PA, NV, MRc, false>(pa, K, x, ldx, y, ldy, ncols, scale, bias, ah);
}

template <class PA, int NV>
inline void panel_rows(const PA& pa, int64_t K, const float* x, int64_t ldx, int64_t mr, float* y,
                       int64_t ldy, int64_t ncols, const float* scale, const float* bias, int64_t pfb,
                       const PA* next = nullptr, int64_t R = 1, int64_t k0 = 0) {
  switch (mr) {
    case 1: return tile<PA, NV, 1>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0);
    case 2: return tile<PA, NV, 2>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0);
  }
  if constexpr (PMR == 6) {  // rows 3 to 5 their own tiles too (AVX-512; with AVX2 a tile has 2 rows)
    switch (mr) {
      case 3: return tile<PA, NV, 3>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0);
      case 4: return tile<PA, NV, 4>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0);
      case 5: return tile<PA, NV, 5>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0);
    }
  }
  tile<PA, NV, PMR>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0);
}

// make(panel, c): the accessor of panel `panel` from its column c
template <class Make>
void panel_linear(Make make, int64_t NP, int64_t K, int64_t B, const float* xp, int64_t M, float* yp, int64_t N,
                  const float* sp, const float* bp, const PanelPrefetch& pf) {
  const int64_t TW = 16 * PNV, per_panel = (B + TW - 1) / TW, pfb = pf.bytes(M);
  const int64_t passes = M / PMR - 1;  // whole row groups after the first: they prefetch the next tile (Ahead)
  using PA = decltype(make(0, 0));
  at::parallel_for(0, NP * per_panel, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t panel = t / per_panel, c = (t % per_panel) * TW;  // first column of the tile in its panel
      const int64_t n = panel * B + c, ncols = std::min<int64_t>({TW, B - c, N - n});
      if (ncols <= 0) continue;
      const float* s = sp ? sp + n : nullptr;
      const int64_t pn = (t + 1) / per_panel, cn = ((t + 1) % per_panel) * TW;
      const bool has_next = pfb > 0 && passes > 0 && t + 1 < t1 && B - cn >= TW && pn * B + cn < N;
      const PA next = make(has_next ? pn : panel, has_next ? cn : c);
      for (int64_t m0 = 0; m0 < M; m0 += PMR) {
        const int64_t mr = std::min<int64_t>(PMR, M - m0), pass = m0 / PMR;
        const float* b = bp ? bp + n : nullptr;
        const bool ahead = has_next && pass >= 1 && pass <= passes;
        if (B - c >= TW) panel_rows<PA, PNV>(make(panel, c), K, xp + m0 * K, K, mr, yp + m0 * N + n, N, ncols, s, b, pfb,
                                             ahead ? &next : nullptr, passes, ahead ? (pass - 1) * K / passes : 0);
        else for (int64_t j = 0; j < B - c && j < N - n; j += 16)  // a panel narrower than the tile
          panel_rows<PA, 1>(make(panel, c + j), K, xp + m0 * K, K, mr, yp + m0 * N + n + j, N,
                                                  std::min<int64_t>(16, N - n - j), s ? s + j : nullptr, b ? b + j : nullptr, pfb);
      }
    }
  });
}

void check_panels(const torch::Tensor& x, const torch::Tensor& p, int64_t N) {
  TORCH_CHECK(p.dim() == 3 && p.is_contiguous(), "p must be contiguous [panels, K, B]");
  const int64_t NP = p.size(0), K = p.size(1), B = p.size(2);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) == K,
              "x must be a contiguous float32 [M, ", K, "] tensor");
  TORCH_CHECK(B % 16 == 0 && N > (NP - 1) * B && N <= NP * B, "panels of B % 16 == 0 outputs must cover N");
}

// y [M, N] = x [M, K] W^T (+ bias) with W as float32 panels p [NP, K, B] (see above), N <= NP * B.
torch::Tensor linear_panel(torch::Tensor x, torch::Tensor p, int64_t N, c10::optional<torch::Tensor> bias,
                           const PanelPrefetch& pf) {
  check_panels(x, p, N);
  TORCH_CHECK(p.scalar_type() == torch::kFloat, "p must be float32");
  auto y = torch::empty({x.size(0), N}, x.options());
  const float* pp = p.data_ptr<float>();
  const int64_t K = p.size(1), B = p.size(2);
  panel_linear([&](int64_t panel, int64_t c) { return PanelPlain<float>{pp + panel * K * B + c, B}; }, p.size(0), K, B,
               x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), N, nullptr, bias_ptr(bias, N), pf);
  return y;
}

// int8 weight-only in the same panels: W[n, k] = p[n / B][k][n % B] * scale[n], scale [NP * B].
torch::Tensor linear_int8_panels(torch::Tensor x, torch::Tensor p, torch::Tensor scale, int64_t N,
                                 c10::optional<torch::Tensor> bias, const PanelPrefetch& pf) {
  check_panels(x, p, N);
  TORCH_CHECK(p.scalar_type() == torch::kChar, "p must be int8");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == p.size(0) * p.size(2),
              "scale must be float32 [panels * B]");
  auto y = torch::empty({x.size(0), N}, x.options());
  const int8_t* pp = p.data_ptr<int8_t>();
  const int64_t K = p.size(1), B = p.size(2);
  panel_linear([&](int64_t panel, int64_t c) { return PanelPlain<int8_t>{pp + panel * K * B + c, B}; }, p.size(0), K, B,
               x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), N, scale.data_ptr<float>(), bias_ptr(bias, N), pf);
  return y;
}

// int4 weight-only in panels: p [NP, K, B/2] uint8, scale [NP, K/group, B] (see PanelI4).
torch::Tensor linear_int4_panels(torch::Tensor x, torch::Tensor p, torch::Tensor scale, int64_t N, int64_t group,
                                 c10::optional<torch::Tensor> bias, const PanelPrefetch& pf) {
  TORCH_CHECK(p.dim() == 3 && p.is_contiguous() && p.scalar_type() == torch::kByte, "p must be contiguous uint8 [panels, K, B/2]");
  const int64_t NP = p.size(0), K = p.size(1), B = 2 * p.size(2);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) == K,
              "x must be a contiguous float32 [M, ", K, "] tensor");
  TORCH_CHECK(B % 32 == 0 && N > (NP - 1) * B && N <= NP * B, "panels of B % 32 == 0 outputs must cover N");
  TORCH_CHECK(group > 0 && K % group == 0, "group must divide K");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == NP * (K / group) * B,
              "scale must be float32 [panels, K/group, B]");
  auto y = torch::empty({x.size(0), N}, x.options());
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t ng = K / group;
  panel_linear([&](int64_t panel, int64_t c) { return PanelI4{pp + panel * K * (B / 2), B, c, group, sp + panel * ng * B}; },
               NP, K, B, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), N, nullptr, bias_ptr(bias, N), pf);
  return y;
}

}  // namespace pdserve
