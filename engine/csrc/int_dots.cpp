// pdserve CPU kernels: w8a8 / w4a8 linears (activations rounded to int8, exact integer dot products), with the
// weights as rows in step order or in the integer panel formats. The vector vocabulary (vi8, vu8, vi32, vf32, dot_us,
// dot_i8, ...) and every instruction-set choice behind it are in simd.h.
#include "kernels.h"

namespace pdserve {

// ---- W8A8 / W4A8 linears: activations rounded to int8, integer dot products -------------------------
//
// Each row of x is quantized in blocks of 32 values (engine/quant.py quantize_act is the reference):
// amax = max|x|, a = round_half_even(x * (127 / amax)), s = amax / 127 (a = s = 0 for an all-zero block).
// Then y[m, n] = out_scale[n] * sum_blocks s_b * (sum_{k in b} a[k] * q[n, k]) (* the weight group's scale
// for int4), so every inner product is exact integer arithmetic: the VNNI instruction dpbusd does 64
// (AVX-512) or 32 (AVX-VNNI) byte multiplies into 16 / 8 int32 lanes at once; plain AVX2 uses
// maddubs + madd; other builds a scalar loop.
//
// A step covers QS = 2 * VB values as two byte vectors A and B of VB bytes (VB = 64 with AVX-512 VNNI,
// 32 with AVX2, 16 in the scalar build): byte j of A is value 32 * (j / 16) + j % 16 of the step, byte j
// of B the value 16 after it. That is exactly the low and the high nibbles of VB bytes of the int4 format
// (one load, an and and a shift), and it puts lane l of A and lane l of B in the same 32-block, so both
// dot products go into one int32 accumulator before the one conversion to float per step. int8 weights
// are stored in this order by engine/model.py (``w8a8_order``); the activations are put in it here. In
// the scalar build (VB = 16) the order is the natural one.
//
// dpbusd multiplies unsigned by signed bytes, so the weight goes in as an unsigned value q + offset (int8:
// q ^ 0x80 = q + 128; int4: the stored nibble q + 8) and each lane starts from -offset * (the sum of its
// activation bytes), precomputed once per call with the activation's per-lane scale.
// (VB, VL = VB / 4 lanes, QS = 2 * VB, I8_OFFSET / I4_OFFSET and the integer vectors: simd.h)

// position p (0 .. QS-1) of a step holds value src_pos(p) of the step
inline int src_pos(int p) {
  const int half = p / VB, j = p % VB;
  return 32 * (j / 16) + 16 * half + j % 16;
}

// x [M, K] float -> a [M, K] int8 (step order), lane scale [M, K/8] float, lane start [M, K/8] int32
struct QAct {
  std::vector<int8_t> a; std::vector<float> sc; std::vector<int32_t> start;
  int64_t K;
  QAct(const float* x, int64_t M, int64_t K_, int offset) : a(M * K_), sc(M * K_ / 8), start(M * K_ / 8), K(K_) {
    std::vector<int8_t> q(K);
    std::vector<float> bs(K / 32);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      for (int64_t b = 0; b < K / 32; ++b) {
        float amax = 0.f;
        for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(xm[b * 32 + t]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        bs[b] = amax / 127.f;
        for (int t = 0; t < 32; ++t) {
          float v = std::nearbyint(xm[b * 32 + t] * inv);
          q[b * 32 + t] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
        }
      }
      int8_t* am = a.data() + m * K;
      for (int64_t c = 0; c < K / QS; ++c)
        for (int p = 0; p < QS; ++p) am[c * QS + p] = q[c * QS + src_pos(p)];
      // lane l of step c: bytes 4l .. 4l+3 of A and of B, both in block c * QS / 32 + l / 4
      for (int64_t c = 0; c < K / QS; ++c)
        for (int l = 0; l < VL; ++l) {
          int32_t s = 0;
          for (int t = 0; t < 4; ++t) s += am[c * QS + 4 * l + t] + am[c * QS + VB + 4 * l + t];
          sc[m * (K / 8) + c * VL + l] = bs[c * QS / 32 + l / 4];
          start[m * (K / 8) + c * VL + l] = -offset * s;
        }
    }
  }
};

// ---- W8A8 / W4A8 on panels (AVX2 and AVX-512 builds) ---------------------------------------------------
// The same arithmetic as above (activations rounded per 32 values, exact int32 dots per 32-block, then the
// scales), with the weights stored the way the fp32 panels are: a panel of QW outputs (64 with AVX-512, 16
// with AVX2: QNV int32 vectors of PW lanes), K-major inside, 4 inputs of an output per int32 lane. A step over
// 4 inputs is QNV weight vectors and, per input row, one broadcast of those 4 activation bytes into every
// lane and one dpbusd per vector: no horizontal sums, no reordering of the activations, a 32-block's int32
// accumulator is converted to float once per row and PW outputs (the row layout above converts once per row
// and output), and a tile reads one contiguous stream.
//   w8a8: [NP, K/4, QW, 4] bytes, byte (o, t) of quad j is W[panel * QW + o, 4j + t] as q ^ 0x80 with
//         VNNI (dpbusd takes it unsigned; lanes start at -128 * sum a) and as q without (maddubs on |q|).
//   w4a8: [NP, K/8, QW, 4] bytes, byte (o, t) of octet j holds W[., 8j + t] + 8 in its low nibble and
//         W[., 8j + 4 + t] + 8 in its high nibble; group scales [NP, K/group, QW] float.
// N is padded to a multiple of QW with zero weights. engine/quant.py to_panels_w8a8 / to_panels_w4a8 make these
// from its int8 [N, K] / int4 formats, and from_panels_* give the float [N, K] weight back (the dequantize + GEMM
// path where the kernels do not run). Each output is the same sequence of operations whatever the tile, so a row's
// result does not depend on its batch.
constexpr int PW = VL;  // outputs per panel
// vectors x rows per tile: 4 x 3 with AVX-512 VNNI (12 int32 + 12 float accumulators), 2 x 2 with AVX2
constexpr int QNV = Q_ISA == 3 ? 4 : 2, QMR = Q_ISA == 3 ? 3 : 2;
constexpr int QW = QNV * PW;  // outputs per panel of the stored format: one tile

// x [M, K] -> int8 [M, K] in natural order, per 32-block: scale and lane start -offset * sum(block)
struct QActP {
  std::vector<int8_t> a; std::vector<float> sc; std::vector<int32_t> start;
  int64_t K;
  QActP(const float* x, int64_t M, int64_t K_, int offset) : a(M * K_), sc(M * K_ / 32), start(M * K_ / 32), K(K_) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + m * K + b * 32;
        float amax = 0.f;
        for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(xb[t]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t s = 0;
        for (int t = 0; t < 32; ++t) {
          const float v = std::nearbyint(xb[t] * inv);
          const auto q = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
          a[m * K + b * 32 + t] = q;
          s += q;
        }
        sc[m * (K / 32) + b] = amax / 127.f;
        start[m * (K / 32) + b] = -offset * s;
      }
  }
};

// ---- the kernels: simd.h's integer dots (AVX2 / AVX-512), or one scalar loop -----------------------------------
#if PD_Q_ISA >= 2
// int8 weights [N, K] in step order (see above), scale [N]
struct I8Q {
  const int8_t* w; const float* scale; int64_t K;
  int64_t cpg = 0;  // one group: the whole row
  static constexpr bool grouped = false;
  using bytes = vi8;  // as load_i8w gives them
  inline void prefetch(int64_t n, int64_t c) const {
    for (int b = 0; b < QS; b += 64) prefetch_line(w + n * K + c * QS + b);
  }
  inline void get(int64_t n, int64_t c, vi8& A, vi8& B) const {
    const int8_t* p = w + n * K + c * QS;
    A = load_i8w(p); B = load_i8w(p + VB);
  }
  static inline vi32 dot(vi32 acc, vi8 wv, vi8 a) { return dot_i8(acc, wv, a); }
  inline float out_scale(int64_t n) const { return scale[n]; }
  inline float group_scale(int64_t, int64_t) const { return 1.f; }
};

// int4 weights in their storage format: VB bytes are one step's low (A) and high (B) nibbles
struct I4Q {
  const uint8_t* w; const float* scale; int64_t K, ng, cpg;  // cpg: steps per group
  static constexpr bool grouped = true;
  using bytes = vu8;  // nibbles, 0..15
  inline void prefetch(int64_t n, int64_t c) const {
    for (int b = 0; b < VB; b += 64) prefetch_line(w + n * (K / 2) + c * VB + b);
  }
  inline void get(int64_t n, int64_t c, vu8& A, vu8& B) const { nibbles(w + n * (K / 2) + c * VB, A, B); }
  static inline vi32 dot(vi32 acc, vu8 wv, vi8 a) { return dot_us(acc, wv, a); }
  inline float out_scale(int64_t) const { return 1.f; }
  inline float group_scale(int64_t n, int64_t g) const { return scale[n * ng + g]; }
};

// y[m0 .. m0+MRc-1, n .. n+R-1] from R weight rows, each step of them loaded once for the MRc inputs
template <class W, int R, int MRc>
inline void qtile(const W& wt, const QAct& qa, int64_t m0, int64_t n, float* y, int64_t ldy, const float* bias) {
  const int64_t K = qa.K, ns = K / QS;
  const int64_t cpg = W::grouped ? wt.cpg : ns;
  vf32 acc[MRc][R];
  for (int i = 0; i < MRc; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = vf32{};
  for (int64_t c0 = 0, g = 0; c0 < ns; c0 += cpg, ++g) {
    vf32 gs[R];
    if constexpr (W::grouped)
      for (int r = 0; r < R; ++r) gs[r] = splat<vf32>(wt.group_scale(n + r, g));
    for (int64_t c = c0; c < c0 + cpg; ++c) {
      typename W::bytes wa[R], wb[R];
      for (int r = 0; r < R; ++r) wt.prefetch(n + r + PF_TILES * R, c);
      for (int r = 0; r < R; ++r) wt.get(n + r, c, wa[r], wb[r]);
      for (int i = 0; i < MRc; ++i) {
        const int64_t m = m0 + i;
        const int8_t* am = qa.a.data() + m * K + c * QS;
        const vi8 aa = load<vi8>(am), ab = load<vi8>(am + VB);
        const vi32 st = load<vi32>(qa.start.data() + m * (K / 8) + c * VL);
        const vf32 sv = load<vf32>(qa.sc.data() + m * (K / 8) + c * VL);
        for (int r = 0; r < R; ++r) {
          const vi32 d = W::dot(W::dot(st, wa[r], aa), wb[r], ab);
          if constexpr (W::grouped) acc[i][r] = fmadd(to_f(d), sv * gs[r], acc[i][r]);
          else acc[i][r] = fmadd(to_f(d), sv, acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < MRc; ++i)
    for (int r = 0; r < R; ++r) {
      const float v = hsum_tree(acc[i][r]) * wt.out_scale(n + r);
      y[(m0 + i) * ldy + n + r] = bias ? v + bias[n + r] : v;
    }
}

template <class W, int R>
inline void qtile_rows(const W& wt, const QAct& qa, int64_t m0, int64_t mr, int64_t n, float* y, int64_t ldy,
                       const float* bias) {
  switch (mr) {
    case 1: qtile<W, R, 1>(wt, qa, m0, n, y, ldy, bias); break;
    case 2: qtile<W, R, 2>(wt, qa, m0, n, y, ldy, bias); break;
    case 3: qtile<W, R, 3>(wt, qa, m0, n, y, ldy, bias); break;
    default: qtile<W, R, MR>(wt, qa, m0, n, y, ldy, bias); break;
  }
}

template <class W>
void qlinear_rows(const W& wt, const QAct& qa, int64_t M, int64_t N, float* y, const float* bias) {
  at::parallel_for(0, (N + NR - 1) / NR, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * NR;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int64_t mr = std::min<int64_t>(MR, M - m0);
        if (n + NR <= N) qtile_rows<W, NR>(wt, qa, m0, mr, n, y, N, bias);
        else for (int64_t j = n; j < N; ++j) qtile_rows<W, 1>(wt, qa, m0, mr, j, y, N, bias);
      }
    }
  });
}
// The w8a8 panels store their bytes as the row format does (q ^ 0x80 with VNNI, q without), so their dot (dot_i8)
// and lane offset (I8_OFFSET) are the rows'; int4 nibbles (<= 15) go straight into dot_us.

// y[m0 .. m0+MRc-1, NV panels from panel p0]: INT4 selects the w4a8 format
// pfd: prefetch this many quads (w8a8) / octets (w4a8) of the tile's stream ahead (PF only)
template <bool INT4, int NV, int MRc, bool PF>
inline void qpanel_tile(const uint8_t* w, const float* scale, int64_t K, int64_t ng, int64_t bpg,
                        const QActP& qa, int64_t m0, int64_t p0, float* y, int64_t ldy, int64_t N,
                        const float* bias, int64_t pfd) {
  // a tile's NV panels are interleaved per 4 (int4: 8) inputs, so a tile reads one contiguous stream
  const int64_t T = p0 / QNV, step = QNV * VB, tstride = (INT4 ? K / 8 : K / 4) * step;
  const uint8_t* wt = w + T * tstride + (p0 % QNV) * VB;
  const int64_t nb = K / 32;
  vf32 facc[MRc][NV];
  for (int i = 0; i < MRc; ++i)
    for (int v = 0; v < NV; ++v) facc[i][v] = vf32{};
  for (int64_t b = 0; b < nb; ++b) {
    vi32 iacc[MRc][NV];
    for (int i = 0; i < MRc; ++i) {
      const vi32 st = splat<vi32>(qa.start[(m0 + i) * nb + b]);
      for (int v = 0; v < NV; ++v) iacc[i][v] = st;
    }
    if constexpr (INT4) {
      for (int j = 0; j < 4; ++j) {  // 4 octets of inputs per block
        const int64_t o = b * 4 + j;
        vu8 lo[NV], hi[NV];
        if constexpr (PF) for (int v = 0; v < NV; ++v) prefetch_line(wt + (o + pfd) * step + v * VB);
        for (int v = 0; v < NV; ++v) nibbles(wt + o * step + v * VB, lo[v], hi[v]);
        for (int i = 0; i < MRc; ++i) {
          const int8_t* am = qa.a.data() + (m0 + i) * K + o * 8;
          const vi8 a0 = bcast4(am), a1 = bcast4(am + 4);
          for (int v = 0; v < NV; ++v) iacc[i][v] = dot_us(dot_us(iacc[i][v], lo[v], a0), hi[v], a1);
        }
      }
      const int64_t g = b / bpg;
      vf32 gs[NV];
      for (int v = 0; v < NV; ++v) gs[v] = load<vf32>(scale + (T * ng + g) * (QNV * PW) + ((p0 % QNV) + v) * PW);
      for (int i = 0; i < MRc; ++i) {
        const vf32 s = splat<vf32>(qa.sc[(m0 + i) * nb + b]);
        for (int v = 0; v < NV; ++v) facc[i][v] = fmadd(to_f(iacc[i][v]), s * gs[v], facc[i][v]);
      }
    } else {
      for (int j = 0; j < 8; ++j) {  // 8 quads of inputs per block
        const int64_t q = b * 8 + j;
        vi8 wv[NV];
        if constexpr (PF) for (int v = 0; v < NV; ++v) prefetch_line(wt + (q + pfd) * step + v * VB);
        for (int v = 0; v < NV; ++v) wv[v] = load<vi8>(wt + q * step + v * VB);
        for (int i = 0; i < MRc; ++i) {
          const vi8 ab = bcast4(qa.a.data() + (m0 + i) * K + q * 4);
          for (int v = 0; v < NV; ++v) iacc[i][v] = dot_i8(iacc[i][v], wv[v], ab);
        }
      }
      for (int i = 0; i < MRc; ++i) {
        const vf32 s = splat<vf32>(qa.sc[(m0 + i) * nb + b]);
        for (int v = 0; v < NV; ++v) facc[i][v] = fmadd(to_f(iacc[i][v]), s, facc[i][v]);
      }
    }
  }
  for (int i = 0; i < MRc; ++i)
    for (int v = 0; v < NV; ++v) {
      float out[PW];
      vf32 r = facc[i][v];
      if constexpr (!INT4) r = r * load<vf32>(scale + (p0 + v) * PW);
      store(out, r);
      const int64_t n = (p0 + v) * PW;
      for (int o = 0; o < PW && n + o < N; ++o) y[(m0 + i) * ldy + n + o] = bias ? out[o] + bias[n + o] : out[o];
    }
}

template <bool INT4, int NV, bool PF>
inline void qpanel_rows_pf(const uint8_t* w, const float* scale, int64_t K, int64_t ng, int64_t bpg, const QActP& qa,
                           int64_t m0, int64_t mr, int64_t p0, float* y, int64_t ldy, int64_t N, const float* bias,
                           int64_t pfd) {
  if (mr == 1) return qpanel_tile<INT4, NV, 1, PF>(w, scale, K, ng, bpg, qa, m0, p0, y, ldy, N, bias, pfd);
  if constexpr (QMR == 3) {  // 2 rows their own tile too (AVX-512; with AVX2 a tile has 2 rows)
    if (mr == 2) return qpanel_tile<INT4, NV, 2, PF>(w, scale, K, ng, bpg, qa, m0, p0, y, ldy, N, bias, pfd);
  }
  qpanel_tile<INT4, NV, QMR, PF>(w, scale, K, ng, bpg, qa, m0, p0, y, ldy, N, bias, pfd);
}
template <bool INT4, int NV>
inline void qpanel_rows(const uint8_t* w, const float* scale, int64_t K, int64_t ng, int64_t bpg, const QActP& qa,
                        int64_t m0, int64_t mr, int64_t p0, float* y, int64_t ldy, int64_t N, const float* bias,
                        int64_t pfb) {
  const int64_t pfd = pfb / (QNV * VB);  // a quad / octet step of a whole tile is QNV * VB bytes
  if (pfd > 0) qpanel_rows_pf<INT4, NV, true>(w, scale, K, ng, bpg, qa, m0, mr, p0, y, ldy, N, bias, pfd);
  else qpanel_rows_pf<INT4, NV, false>(w, scale, K, ng, bpg, qa, m0, mr, p0, y, ldy, N, bias, 0);
}

template <bool INT4>
void qpanel_linear(const uint8_t* w, const float* scale, int64_t K, int64_t N, int64_t group, const QActP& qa,
                   int64_t M, float* y, const float* bias, const PanelPrefetch& pf) {
  const int64_t NT = (N + QW - 1) / QW, ng = INT4 ? K / group : 1, bpg = INT4 ? group / 32 : 1, pfb = pf.bytes(M);
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += QMR)
        qpanel_rows<INT4, QNV>(w, scale, K, ng, bpg, qa, m0, std::min<int64_t>(QMR, M - m0), t * QNV, y, N, N, bias, pfb);
  });
}

void w8a8_rows(const QAct& qa, int64_t M, int64_t N, const int8_t* w, const float* scale, float* y, const float* bias) {
  qlinear_rows(I8Q{w, scale, qa.K}, qa, M, N, y, bias);
}
void w4a8_rows(const QAct& qa, int64_t M, int64_t N, const uint8_t* w, const float* scale, int64_t group, float* y,
               const float* bias) {
  qlinear_rows(I4Q{w, scale, qa.K, qa.K / group, group / QS}, qa, M, N, y, bias);
}
#else
// The scalar build (no AVX2): the same arithmetic as a loop, the step order the natural one; exact int32 block dots
// (simd.h dot_bytes), then the scales. It has no integer panels (qpanel_width() is 0, so engine/quant_formats.py never
// asks for them).
void qlinear_scalar(const QAct& qa, int64_t M, int64_t N, bool int4, const void* w, const float* scale,
                    int64_t group, float* y, const float* bias) {
  static_assert(QS == 32, "the scalar build reads values in their natural order");
  const int64_t K = qa.K;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<int8_t> q(K);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t k = 0; k < K; ++k)
        q[k] = int4 ? static_cast<int8_t>(((static_cast<const uint8_t*>(w)[n * (K / 2) + (k / 32) * 16 + (k % 16)]
                                            >> ((k % 32) >= 16 ? 4 : 0)) & 15) - 8)
                    : static_cast<const int8_t*>(w)[n * K + k];
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* am = qa.a.data() + m * K;
        const float* sm = qa.sc.data() + m * (K / 8);  // 4 lanes per block of 32
        float acc = 0.f;
        for (int64_t b = 0; b < K / 32; ++b) {
          const int32_t d = dot_bytes(am + b * 32, q.data() + b * 32, 32);
          acc += static_cast<float>(d) * sm[b * 4] * (int4 ? scale[n * (K / group) + b * 32 / group] : 1.f);
        }
        const float v = acc * (int4 ? 1.f : scale[n]);
        y[m * N + n] = bias ? v + bias[n] : v;
      }
    }
  });
}
void w8a8_rows(const QAct& qa, int64_t M, int64_t N, const int8_t* w, const float* scale, float* y, const float* bias) {
  qlinear_scalar(qa, M, N, false, w, scale, 0, y, bias);
}
void w4a8_rows(const QAct& qa, int64_t M, int64_t N, const uint8_t* w, const float* scale, int64_t group, float* y,
               const float* bias) {
  qlinear_scalar(qa, M, N, true, w, scale, group, y, bias);
}
template <bool INT4>  // not reached: the panel entry points refuse first
void qpanel_linear(const uint8_t*, const float*, int64_t, int64_t, int64_t, const QActP&, int64_t, float*, const float*,
                   const PanelPrefetch&) {}
#endif

// ---- entry points ----------------------------------------------------------------------------------------------
torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K);
  TORCH_CHECK(K % QS == 0, "K must be a multiple of ", QS);
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K] in step order");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.numel() == N && scale.is_contiguous(), "scale must be float32 [N]");
  auto y = torch::empty({M, N}, x.options());
  QAct qa(x.data_ptr<float>(), M, K, I8_OFFSET);
  w8a8_rows(qa, M, N, w.data_ptr<int8_t>(), scale.data_ptr<float>(), y.data_ptr<float>(), bias_ptr(bias, N));
  return y;
}

torch::Tensor linear_w4a8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t group,
                          c10::optional<torch::Tensor> bias) {
  const int64_t N = w.size(0), K = 2 * w.size(1), M = x.size(0);
  check_x(x, K);
  TORCH_CHECK(K % QS == 0 && group % QS == 0 && K % group == 0, "K and group must be multiples of ", QS,
              " and group must divide K");
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous(), "w must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == N * (K / group),
              "scale must be float32 [N, K/group]");
  auto y = torch::empty({M, N}, x.options());
  QAct qa(x.data_ptr<float>(), M, K, I4_OFFSET);
  w4a8_rows(qa, M, N, w.data_ptr<uint8_t>(), scale.data_ptr<float>(), group, y.data_ptr<float>(), bias_ptr(bias, N));
  return y;
}

// values per step of the integer-dot kernels: K and the int4 group must be multiples of it, and w8a8
// weights are stored in its step order (engine/quant.py step_order)
int64_t qstep() { return QS; }

torch::Tensor linear_w8a8_panels(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t N,
                                 c10::optional<torch::Tensor> bias, const PanelPrefetch& pf) {
  TORCH_CHECK(Q_ISA >= 2, "the integer panel kernels need AVX2 or AVX-512; this build has neither");
  const int64_t K = x.size(1), NP = (N + QW - 1) / QW;
  check_x(x, K);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous() && w.numel() == NP * K * QW,
              "w must be the contiguous uint8 panels of to_panels_w8a8 for N outputs and K inputs");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == NP * QW,
              "scale must be float32 [N padded to the panel width]");
  auto y = torch::empty({x.size(0), N}, x.options());
  QActP qa(x.data_ptr<float>(), x.size(0), K, I8_OFFSET);
  qpanel_linear<false>(w.data_ptr<uint8_t>(), scale.data_ptr<float>(), K, N, 0, qa, x.size(0), y.data_ptr<float>(),
                       bias_ptr(bias, N), pf);
  return y;
}

torch::Tensor linear_w4a8_panels(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t N, int64_t group,
                                 c10::optional<torch::Tensor> bias, const PanelPrefetch& pf) {
  TORCH_CHECK(Q_ISA >= 2, "the integer panel kernels need AVX2 or AVX-512; this build has neither");
  const int64_t K = x.size(1), NP = (N + QW - 1) / QW;
  check_x(x, K);
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 that divides K");
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous() && w.numel() == NP * K * QW / 2,
              "w must be the contiguous uint8 panels of to_panels_w4a8 for N outputs and K inputs");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == NP * (K / group) * QW,
              "scale must be float32 [panels, K/group, panel width]");
  auto y = torch::empty({x.size(0), N}, x.options());
  QActP qa(x.data_ptr<float>(), x.size(0), K, I4_OFFSET);
  qpanel_linear<true>(w.data_ptr<uint8_t>(), scale.data_ptr<float>(), K, N, group, qa, x.size(0), y.data_ptr<float>(),
                      bias_ptr(bias, N), pf);
  return y;
}

// outputs per panel of the integer panel kernels' formats; 0 where they are not built (the scalar build)
int64_t qpanel_width() { return Q_ISA >= 2 ? QW : 0; }

// whether the w8a8 panels store q ^ 0x80 (the VNNI builds)
bool qpanel_unsigned() { return Q_VNNI; }

}  // namespace pdserve
