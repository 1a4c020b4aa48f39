// pdserve CPU kernels: small-M linear layers over fp32 / int8 / int4 weights and paged decode attention.
//
// Built at first use by engine/kernels.py (torch.utils.cpp_extension, -O3 -march=native), so the
// vector code below compiles to whatever the machine offers: GCC vector extensions of 16 floats become
// one AVX-512 register, two AVX2 registers, or four SSE registers. Everything is parallel over output
// columns (linears) or (sequence, KV head) pairs (attention) with at::parallel_for, i.e. torch's own
// OpenMP pool, so the kernels share the engine's threads instead of adding a second pool.
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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: a 64-byte GCC vector has no machine mode here, so GCC keeps it in memory and every operation
// goes through loads and stores (measured: the linears 5-20x slower than this). A pair of native 8-float
// vectors with the few operators the kernels use compiles to register-resident ymm code instead.
#define PD_V16_PAIR 1
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
struct v16f { v8f lo, hi; };
struct v16i { v8i lo, hi; };
inline v16f operator+(v16f a, v16f b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16f operator*(v16f a, v16f b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16f operator*(v16f a, float b) { return {a.lo * b, a.hi * b}; }
inline v16f operator/(v16f a, v16f b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline v16f& operator+=(v16f& a, v16f b) { a.lo += b.lo; a.hi += b.hi; return a; }
inline v16i operator>>(v16i a, int n) { return {a.lo >> n, a.hi >> n}; }
inline v16i operator<<(v16i a, int n) { return {a.lo << n, a.hi << n}; }
inline v16i operator&(v16i a, int n) { return {a.lo & n, a.hi & n}; }
inline v16i operator-(v16i a, int n) { return {a.lo - n, a.hi - n}; }
inline v16f operator-(v16f a, v16f b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline v16f operator+(v16f a, float b) { return {a.lo + b, a.hi + b}; }
inline v16f operator-(v16f a, float b) { return {a.lo - b, a.hi - b}; }
inline v16i operator+(v16i a, int n) { return {a.lo + n, a.hi + n}; }
inline v16i operator-(v16i a, v16i b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline v16f vmax(v16f a, v16f b) { return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi}; }
inline v16f vmin(v16f a, v16f b) { return {a.lo < b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi}; }
inline v16f load_f(const float* p) { v8f a, b; std::memcpy(&a, p, 32); std::memcpy(&b, p + 8, 32); return {a, b}; }
inline void store_f(float* p, v16f v) { std::memcpy(p, &v.lo, 32); std::memcpy(p + 8, &v.hi, 32); }
inline v16f splat(float x) { return {v8f{} + x, v8f{} + x}; }
#else
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
inline v16f load_f(const float* p) { v16f v; std::memcpy(&v, p, sizeof v); return v; }
inline void store_f(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
inline v16f splat(float x) { return v16f{} + x; }
inline v16f vmax(v16f a, v16f b) { return a > b ? a : b; }
inline v16f vmin(v16f a, v16f b) { return a < b ? a : b; }
#endif
inline v16i as_i(v16f v) { v16i r; std::memcpy(&r, &v, sizeof r); return r; }
inline v16f as_f(v16i v) { v16f r; std::memcpy(&r, &v, sizeof r); return r; }
// A compiler barrier: v is computed here, as written, before any later use (no instruction is emitted);
// -ffast-math may not fold or reassociate across it.
__attribute__((always_inline)) inline void opaque(v16f& v) {
#if defined(PD_V16_PAIR)
  asm("" : "+x"(v.lo), "+x"(v.hi));
#elif defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  asm("" : "+m"(v));  // without AVX-512 or AVX2 a 64-byte vector lives in memory
#endif
}
// e^x in 16 lanes: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n), x
// clamped to [-87.3, 88.3] so 2^n stays a normal float; relative error within a few ulp of std::exp. One
// call replaces 16 calls of libm's scalar expf (the softmax of paged decode attention). With AVX-512 the 2^n
// factor is one vscalefps (the same bits: n is an integer in the normal range after the clamp).
inline v16f exp16(v16f x) {
  x = vmin(vmax(x, splat(-87.3f)), splat(88.3f));
  const float magic = 12582912.f;  // 1.5 * 2^23: x * log2(e) + magic holds round(x * log2(e)) in its low bits
  v16f t = x * 1.44269504088896341f + magic;
  opaque(t);  // fast-math would fold (t - magic) back into x * log2(e)
  const v16f n = t - magic;
  v16f r = x - n * 0.693359375f;  // ln 2 in two parts (Cody-Waite), kept apart
  opaque(r);
  r = r - n * -2.12194440e-4f;
  v16f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
#if defined(__AVX512F__)
  return (v16f)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
  return p * as_f(((as_i(t) - as_i(splat(magic))) + 127) << 23);
#endif
}
// Widening loads of 16 narrow integers into 16 int32 lanes. GCC lowers __builtin_convertvector of
// 8- and 16-bit vectors lane by lane, so these use the one-instruction widening moves directly.
#ifndef PD_V16_PAIR
template <class T>
inline v16i widen_scalar(const void* p) {
  T t[16]; std::memcpy(t, p, sizeof t);
  v16i r;
  for (int i = 0; i < 16; ++i) r[i] = t[i];
  return r;
}
#endif
#if defined(__AVX512F__)
inline v16i widen_i8(const void* p) { return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline v16i widen_u8(const void* p) { return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline v16i widen_u16(const void* p) { return (v16i)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(__AVX2__)
inline v16i join(__m256i lo, __m256i hi) { return {(v8i)lo, (v8i)hi}; }
inline v16i widen_i8(const void* p) {
  __m128i a = _mm_loadu_si128((const __m128i*)p);
  return join(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
inline v16i widen_u8(const void* p) {
  __m128i a = _mm_loadu_si128((const __m128i*)p);
  return join(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}
inline v16i widen_u16(const void* p) {
  const __m128i* q = (const __m128i*)p;
  return join(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), _mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)));
}
#else
inline v16i widen_i8(const void* p) { return widen_scalar<int8_t>(p); }
inline v16i widen_u8(const void* p) { return widen_scalar<uint8_t>(p); }
inline v16i widen_u16(const void* p) { return widen_scalar<uint16_t>(p); }
#endif

#ifdef PD_V16_PAIR
inline v16f to_f(v16i v) { return {__builtin_convertvector(v.lo, v8f), __builtin_convertvector(v.hi, v8f)}; }
inline v16f load_bf16(const uint16_t* p) {
  v16i w = widen_u16(p) << 16;
  return {(v8f)w.lo, (v8f)w.hi};
}
inline float hsum(v16f v) {
  v8f a = v.lo + v.hi;
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a[i];
  return s;
}
// the largest of the 16 lanes, by a log2 tree of shuffles (no 16-step scalar chain)
inline float hmax(v16f v) {
  v8f a = v.lo > v.hi ? v.lo : v.hi, b;
  b = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3); a = a > b ? a : b;
  b = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5); a = a > b ? a : b;
  b = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6); a = a > b ? a : b;
  return a[0];
}
#else
inline v16f to_f(v16i v) { return __builtin_convertvector(v, v16f); }
inline v16f load_bf16(const uint16_t* p) {
  v16i w = widen_u16(p) << 16;
  v16f f; std::memcpy(&f, &w, sizeof f);
  return f;
}
inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
inline float hmax(v16f v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}
#endif
inline v16f load_b(const int8_t* p) { return to_f(widen_i8(p)); }

#ifdef PD_V16_PAIR
// 16 vectors -> one vector of their 16 horizontal sums, in order
inline v16f reduce16(v16f* s) {
  float r[16];
  for (int j = 0; j < 16; ++j) r[j] = hsum(s[j]);
  return load_f(r);
}
#else
// 16 vectors -> one vector of their 16 horizontal sums, in order (a transpose-and-add tree: 15 adds)
inline v16f fold(v16f a, v16f b, int level) {
  switch (level) {
    case 0: return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    case 1: return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    case 2: return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                   __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    default: return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                    __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
}
inline v16f reduce16(v16f* s) {
  for (int level = 0, n = 16; n > 1; ++level, n /= 2)
    for (int i = 0; i < n / 2; ++i) s[i] = fold(s[2 * i], s[2 * i + 1], level);
  return s[0];
}
#endif

// ---- linear: y[M, N] = x[M, K] W^T (+ bias) for small M -------------------------------------------

// The tile fits the register file: with AVX-512 (32 registers of 16 floats) 4 output rows x 4 inputs keep
// 16 accumulators in registers; with AVX2 (16 registers of 8 floats, a v16f takes two) 2 x 2 does.
#ifdef PD_V16_PAIR
constexpr int NR = 2;
constexpr int MR = 2;
#else
constexpr int NR = 4;   // output rows per tile: their weights are read once for all M inputs
constexpr int MR = 4;   // inputs per pass
#endif

// Weight rows are short (K values: a few hundred bytes to a few KB) and a tile reads R of them side by side,
// a pattern the hardware prefetcher does not follow from one tile to the next: every step also prefetches
// the same step of the rows PF_TILES tiles ahead (measured: benchmarks/cpu_linear.py, docs/benchmarks.md).
constexpr int PF_TILES = 4;
inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 3); }

// Each weight type gives row(n, k): W[n, k..k+15] as floats, and row2(n, k): W[n, k..k+31] as two halves.
struct Fp32W {
  const float* w; int64_t K;
  inline v16f row(int64_t n, int64_t k) const { return load_f(w + n * K + k); }
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
      v16f xl = load_f(xi), xh = load_f(xi + 16);
      for (int r = 0; r < R; ++r) acc[i][r] += xl * lo[r] + xh * hi[r];
    }
  }
  for (; k < K; k += 16) {
    v16f wv[R];
    for (int r = 0; r < R; ++r) wt.prefetch(n + r + PF_TILES * R, k);
    for (int r = 0; r < R; ++r) wv[r] = wt.row(n + r, k);
    for (int i = 0; i < MRc; ++i) {
      v16f xv = load_f(x + (m0 + i) * ldx + k);
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

// int4: row(n, k) for k % 16 == 0 is the low (k % 32 < 16) or high nibbles of that run's 16 bytes, scaled
// by the group's scale; out_scale is 1.
// gidx[k / 16] is k's group: a table, so the inner loops carry no integer division.
struct Int4W {
  const uint8_t* w; const float* scale; int64_t K, ng; const int32_t* gidx;
  inline void prefetch(int64_t n, int64_t k) const { if (k % 128 == 0) prefetch_line(w + n * (K / 2) + k / 2); }
  inline v16f row(int64_t n, int64_t k) const {
    v16i q = widen_u8(w + n * (K / 2) + (k / 32) * 16);
    return lookup((k & 16) ? (q >> 4) : (q & 15), scale[n * ng + gidx[k >> 4]]);
  }
  // both halves of a 32-value run from one widening load (k % 32 == 0; a run never straddles a group)
  inline void row2(int64_t n, int64_t k, v16f& lo, v16f& hi) const {
    v16i q = widen_u8(w + n * (K / 2) + k / 2);
    float s = scale[n * ng + gidx[k >> 4]];
    lo = lookup(q & 15, s);
    hi = lookup(q >> 4, s);
  }
  // nibbles (0..15, stored as q + 8) -> (q) * s
  static inline v16f lookup(v16i nib, float s) {
#if defined(__AVX512F__)
    // one permute looks the 16 nibbles up in the group's table of (i - 8) * s
    const v16f base{-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
    return (v16f)_mm512_permutexvar_ps((__m512i)nib, (__m512)(base * splat(s)));
#else
    return to_f(nib - 8) * splat(s);
#endif
  }
  inline float out_scale(int64_t) const { return 1.f; }
};

// A tile of rows already widened to float32 (row r of the tile at buf + r * K), with the source's scales.
template <class W>
struct Widened {
  const float* buf; const W& src; int64_t n0, K;
  inline v16f row(int64_t n, int64_t k) const { return load_f(buf + (n - n0) * K + k); }
  inline void prefetch(int64_t, int64_t) const {}  // already in cache
  inline void row2(int64_t n, int64_t k, v16f& lo, v16f& hi) const { lo = row(n, k); hi = row(n, k + 16); }
  inline float out_scale(int64_t n) const { return src.out_scale(n); }
};

template <class W>
void linear_rows(const W& wt, const float* x, int64_t M, int64_t K, int64_t N, float* y,
                 const float* bias) {
  // grain: enough tiles per task that a thread streams a long contiguous slice of the weight.
  // An int4 tile with many 4-row passes is widened to float32 once (its decode costs more than a float
  // load); int8 decodes in two instructions and is read directly (measured: docs/benchmarks.md).
  constexpr bool narrow = std::is_same_v<W, Int4W>;
  at::parallel_for(0, (N + NR - 1) / NR, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      int64_t n = t * NR;
      if (narrow && M > 4 * MR && n + NR <= N) {
        // several passes over this tile: widen its narrow rows once, then every pass reads floats
        buf.resize(NR * K);
        for (int r = 0; r < NR; ++r)  // (row2 measured slower here than row)
          for (int64_t k = 0; k < K; k += 16) store_f(buf.data() + r * K + k, wt.row(n + r, k));
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

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) == K,
              "x must be a contiguous float32 [M, ", K, "] tensor");
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16");
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
              "bias must be float32 [N]");
  return bias->data_ptr<float>();
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
// Software prefetch of the panel kernels' weight stream (fp32, int8, int4, w8a8, w4a8 panels): how many bytes
// of its stream a tile requests ahead of its loads, for products of one input row ([0]) and of several ([1]);
// 0 = none. Whether it pays depends on the machine, so engine/kernels.py measures it once per process
// (tune_panel_prefetch) and sets it here. Measured: on Zen 4 prefetching a batch-1 stream cost a third of
// its rate; on an Intel Xeon (Emerald Rapids) it left batch 1 as it was and sped up 8 and 32 rows by 1.2-1.5x,
// where a tile re-reads its panel from L2 for every row group (docs/benchmarks.md). No result changes:
// prefetches load nothing into registers.
std::atomic<int64_t> g_panel_pf[2] = {0, 0};
inline int64_t panel_pf_bytes(int64_t M) { return g_panel_pf[M > 1 ? 1 : 0].load(std::memory_order_relaxed); }

#ifdef PD_V16_PAIR
constexpr int PNV = 2;  // vectors of 16 outputs per tile (AVX2: 4 of the 16 ymm registers)
constexpr int PMR = 2;  // input rows per tile: 2 x 2 x 2 ymm accumulators
#else
constexpr int PNV = 4;  // a whole 64-wide panel step: 4 zmm
constexpr int PMR = 6;  // 24 zmm accumulators
#endif

// The weight as the panel kernel reads it, one k step (NV vectors of 16 outputs from column c of the panel)
// per call, k increasing by one from 0: float32 as is; int8 widened in registers (its per-output scale
// applied once at the end: [NP, K, B] and scale [NP * B], engine/quant.py to_panels_int8). int4 (PanelI4
// below) is [NP, K, B/2] bytes, byte j of a k row holding output j (low nibble) and j + B/2 (high), stored
// q + 8, with group scales [NP, K/G, B] (to_panels_int4), and has its own tile (panel_tile_i4).
template <class T>
struct PanelPlain {
  const T* p; int64_t B;
  template <int NV> inline void step(int64_t k, v16f* w) {
    for (int v = 0; v < NV; ++v) w[v] = load(p + k * B + 16 * v);
  }
  template <int NV> static constexpr int64_t step_bytes() { return 16 * NV * sizeof(T); }
  template <int NV> inline void prefetch(int64_t k) const {
    for (int64_t b = 0; b < step_bytes<NV>(); b += 64) prefetch_line(reinterpret_cast<const char*>(p + k * B) + b);
  }
  template <int NV> inline void prefetch_l2(int64_t k) const {
    for (int64_t b = 0; b < step_bytes<NV>(); b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p + k * B) + b, 0, 2);
  }
  static inline v16f load(const float* q) { return load_f(q); }
  static inline v16f load(const int8_t* q) { return load_b(q); }
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
  __attribute__((always_inline)) static inline v16f level(v16i q, bool high) {  // q: bytes in int32 lanes
#if defined(__AVX512F__)
    // vpermps reads the low 4 bits of each index: the low nibble as is, the high one shifted down
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return (v16f)_mm512_permutexvar_ps((__m512i)(high ? q >> 4 : q), table);
#else
    return to_f((high ? q >> 4 : q & 15) - 8);
#endif
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
        w[v] = level(q, false);
        w[v + NV / 2] = level(q, true);
      }
    } else {
      for (int v = 0; v < NV; ++v) {
        const int64_t col = c + 16 * v;
        const bool high = M == HIGH || (M == ANY && col >= B / 2);
        w[v] = level(widen_u8(row + (high ? col - B / 2 : col)), high);
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
        const v16f xb = splat(x[i * ldx + k]);
        for (int v = 0; v < NV; ++v) acc[i][v] += xb * w[v];
      }
    }
    for (int i = 0; i < MRc; ++i)
      for (int v = 0; v < NV; ++v) store_f(out[i] + 16 * v, load_f(out[i] + 16 * v) + acc[i][v] * load_f(s + 16 * v));
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
      const v16f xb = splat(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] += xb * w[v];
    }
  }
  for (int i = 0; i < MRc; ++i) {
    float out[16 * NV];
    for (int v = 0; v < NV; ++v) store_f(out + 16 * v, scale ? acc[i][v] * load_f(scale + 16 * v) : acc[i][v]);
    for (int64_t j = 0; j < ncols; ++j) y[i * ldy + j] = bias ? out[j] + bias[j] : out[j];
  }
}

template <class PA, int NV, int MRc, bool PF>
inline void tile_pf(const PA& pa, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t ncols,
                    const float* scale, const float* bias, const Ahead<PA>& ah) {
  if constexpr (std::is_same<PA, PanelI4>::value) panel_tile_i4_pf<NV, MRc, PF>(pa, K, x, ldx, y, ldy, ncols, bias, ah);
  else panel_tile<PA, NV, MRc, PF>(pa, K, x, ldx, y, ldy, ncols, scale, bias, ah);
}
// pfb: bytes of prefetch ahead (see g_panel_pf), turned into k steps of this tile's stream; next, R, k0: see Ahead
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
    case 1: tile<PA, NV, 1>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0); break;
    case 2: tile<PA, NV, 2>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0); break;
#ifndef PD_V16_PAIR
    case 3: tile<PA, NV, 3>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0); break;
    case 4: tile<PA, NV, 4>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0); break;
    case 5: tile<PA, NV, 5>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0); break;
#endif
    default: tile<PA, NV, PMR>(pa, K, x, ldx, y, ldy, ncols, scale, bias, pfb, next, R, k0); break;
  }
}

// make(panel, c): the accessor of panel `panel` from its column c
template <class Make>
void panel_linear(Make make, int64_t NP, int64_t K, int64_t B, const float* xp, int64_t M, float* yp, int64_t N,
                  const float* sp, const float* bp) {
  const int64_t TW = 16 * PNV, per_panel = (B + TW - 1) / TW, pfb = panel_pf_bytes(M);
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
torch::Tensor linear_panel(torch::Tensor x, torch::Tensor p, int64_t N, c10::optional<torch::Tensor> bias) {
  check_panels(x, p, N);
  TORCH_CHECK(p.scalar_type() == torch::kFloat, "p must be float32");
  auto y = torch::empty({x.size(0), N}, x.options());
  const float* pp = p.data_ptr<float>();
  const int64_t K = p.size(1), B = p.size(2);
  panel_linear([&](int64_t panel, int64_t c) { return PanelPlain<float>{pp + panel * K * B + c, B}; }, p.size(0), K, B,
               x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), N, nullptr, bias_ptr(bias, N));
  return y;
}

// int8 weight-only in the same panels: W[n, k] = p[n / B][k][n % B] * scale[n], scale [NP * B].
torch::Tensor linear_int8_panels(torch::Tensor x, torch::Tensor p, torch::Tensor scale, int64_t N,
                                 c10::optional<torch::Tensor> bias) {
  check_panels(x, p, N);
  TORCH_CHECK(p.scalar_type() == torch::kChar, "p must be int8");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == p.size(0) * p.size(2),
              "scale must be float32 [panels * B]");
  auto y = torch::empty({x.size(0), N}, x.options());
  const int8_t* pp = p.data_ptr<int8_t>();
  const int64_t K = p.size(1), B = p.size(2);
  panel_linear([&](int64_t panel, int64_t c) { return PanelPlain<int8_t>{pp + panel * K * B + c, B}; }, p.size(0), K, B,
               x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), N, scale.data_ptr<float>(), bias_ptr(bias, N));
  return y;
}

// int4 weight-only in panels: p [NP, K, B/2] uint8, scale [NP, K/group, B] (see PanelI4).
torch::Tensor linear_int4_panels(torch::Tensor x, torch::Tensor p, torch::Tensor scale, int64_t N, int64_t group,
                                 c10::optional<torch::Tensor> bias) {
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
               NP, K, B, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), N, nullptr, bias_ptr(bias, N));
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
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PD_Q_ISA 3
constexpr int VB = 64;
#elif defined(__AVX2__)
#define PD_Q_ISA 2
constexpr int VB = 32;
#else
#define PD_Q_ISA 0
constexpr int VB = 16;
#endif
constexpr int QS = 2 * VB;  // values per step
constexpr int QL = VB / 4;  // int32 lanes per vector

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
        for (int l = 0; l < QL; ++l) {
          int32_t s = 0;
          for (int t = 0; t < 4; ++t) s += am[c * QS + 4 * l + t] + am[c * QS + VB + 4 * l + t];
          sc[m * (K / 8) + c * QL + l] = bs[c * QS / 32 + l / 4];
          start[m * (K / 8) + c * QL + l] = -offset * s;
        }
    }
  }
};

#if PD_Q_ISA == 3
typedef __m512i qiv; typedef __m512 qfv;
inline qiv qload(const void* p) { return _mm512_loadu_si512(p); }
inline qfv qloadf(const float* p) { return _mm512_loadu_ps(p); }
inline qfv qzero() { return _mm512_setzero_ps(); }
inline qfv qsplat(float s) { return _mm512_set1_ps(s); }
inline qfv qmul(qfv a, qfv b) { return _mm512_mul_ps(a, b); }
inline qfv qfma(qiv d, qfv s, qfv acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc); }
inline float qsum(qfv v) { return _mm512_reduce_add_ps(v); }
inline qiv dot_us(qiv acc, qiv u, qiv a) { return _mm512_dpbusd_epi32(acc, u, a); }
inline qiv qxor80(qiv v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline void nibbles(const uint8_t* p, qiv& lo, qiv& hi) {
  const qiv v = qload(p), m = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(v, m);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
}
#define PD_Q_VNNI 1
#elif PD_Q_ISA == 2
typedef __m256i qiv; typedef __m256 qfv;
inline qiv qload(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline qfv qloadf(const float* p) { return _mm256_loadu_ps(p); }
inline qfv qzero() { return _mm256_setzero_ps(); }
inline qfv qsplat(float s) { return _mm256_set1_ps(s); }
inline qfv qmul(qfv a, qfv b) { return _mm256_mul_ps(a, b); }
inline qfv qfma(qiv d, qfv s, qfv acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc); }
inline float qsum(qfv v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define PD_Q_VNNI 1
#endif
// unsigned bytes u times signed bytes a, 4 to a lane, added to acc
inline qiv dot_us(qiv acc, qiv u, qiv a) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, a);
#elif defined(PD_Q_VNNI)
  return _mm256_dpbusd_epi32(acc, u, a);
#else
  // only for int4 nibbles here (|u| <= 15), so the 16-bit pair sums of maddubs cannot saturate
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}
inline qiv qxor80(qiv v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline void nibbles(const uint8_t* p, qiv& lo, qiv& hi) {
  const qiv v = qload(p), m = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}
#endif

// what the weight's bytes are offset by where they enter the dot product (each lane starts at -offset * sum a)
#ifdef PD_Q_VNNI
constexpr int I8_OFFSET = 128;  // int8 weights enter dpbusd as q ^ 0x80
#else
constexpr int I8_OFFSET = 0;    // plain AVX2: |q| and sign(a, q) through maddubs; scalar: signed products
#endif
constexpr int I4_OFFSET = PD_Q_ISA >= 2 ? 8 : 0;  // the stored nibble q + 8; the scalar loop subtracts the 8

#if PD_Q_ISA >= 2

// int8 weights [N, K] in step order (see above), scale [N]
struct I8Q {
  const int8_t* w; const float* scale; int64_t K;
  int64_t cpg = 0;  // one group: the whole row
  static constexpr bool grouped = false;
  inline void prefetch(int64_t n, int64_t c) const {
    for (int b = 0; b < QS; b += 64) prefetch_line(w + n * K + c * QS + b);
  }
  inline void load(int64_t n, int64_t c, qiv& A, qiv& B) const {
    const int8_t* p = w + n * K + c * QS;
#ifdef PD_Q_VNNI
    A = qxor80(qload(p)); B = qxor80(qload(p + VB));
#else
    A = qload(p); B = qload(p + VB);
#endif
  }
  static inline qiv dot(qiv acc, qiv wv, qiv a) {
#ifdef PD_Q_VNNI
    return dot_us(acc, wv, a);
#else
    // |q| <= 127 and |a| <= 127: pair sums stay within int16
    __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(a, wv));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
  }
  inline float out_scale(int64_t n) const { return scale[n]; }
  inline float group_scale(int64_t, int64_t) const { return 1.f; }
};

// int4 weights in their storage format: VB bytes are one step's low (A) and high (B) nibbles
struct I4Q {
  const uint8_t* w; const float* scale; int64_t K, ng, cpg;  // cpg: steps per group
  static constexpr bool grouped = true;
  inline void prefetch(int64_t n, int64_t c) const {
    for (int b = 0; b < VB; b += 64) prefetch_line(w + n * (K / 2) + c * VB + b);
  }
  inline void load(int64_t n, int64_t c, qiv& A, qiv& B) const { nibbles(w + n * (K / 2) + c * VB, A, B); }
  static inline qiv dot(qiv acc, qiv wv, qiv a) { return dot_us(acc, wv, a); }
  inline float out_scale(int64_t) const { return 1.f; }
  inline float group_scale(int64_t n, int64_t g) const { return scale[n * ng + g]; }
};

// y[m0 .. m0+MRc-1, n .. n+R-1] from R weight rows, each step of them loaded once for the MRc inputs
template <class W, int R, int MRc>
inline void qtile(const W& wt, const QAct& qa, int64_t m0, int64_t n, float* y, int64_t ldy, const float* bias) {
  const int64_t K = qa.K, ns = K / QS;
  const int64_t cpg = W::grouped ? wt.cpg : ns;
  qfv acc[MRc][R];
  for (int i = 0; i < MRc; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = qzero();
  for (int64_t c0 = 0, g = 0; c0 < ns; c0 += cpg, ++g) {
    qfv gs[R];
    if constexpr (W::grouped)
      for (int r = 0; r < R; ++r) gs[r] = qsplat(wt.group_scale(n + r, g));
    for (int64_t c = c0; c < c0 + cpg; ++c) {
      qiv wa[R], wb[R];
      for (int r = 0; r < R; ++r) wt.prefetch(n + r + PF_TILES * R, c);
      for (int r = 0; r < R; ++r) wt.load(n + r, c, wa[r], wb[r]);
      for (int i = 0; i < MRc; ++i) {
        const int64_t m = m0 + i;
        const int8_t* am = qa.a.data() + m * K + c * QS;
        const qiv aa = qload(am), ab = qload(am + VB);
        const qiv st = qload(qa.start.data() + m * (K / 8) + c * QL);
        const qfv sv = qloadf(qa.sc.data() + m * (K / 8) + c * QL);
        for (int r = 0; r < R; ++r) {
          const qiv d = W::dot(W::dot(st, wa[r], aa), wb[r], ab);
          if constexpr (W::grouped) acc[i][r] = qfma(d, qmul(sv, gs[r]), acc[i][r]);
          else acc[i][r] = qfma(d, sv, acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < MRc; ++i)
    for (int r = 0; r < R; ++r) {
      const float v = qsum(acc[i][r]) * wt.out_scale(n + r);
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
#else
// Scalar form of the same arithmetic (builds without AVX2, where the step order is the natural one):
// exact int32 block dots, then the scales.
void qlinear_scalar(const QAct& qa, int64_t M, int64_t N, bool int4, const void* w, const float* scale,
                    int64_t group, float* y, const float* bias) {
  static_assert(PD_Q_ISA != 0 || QS == 32, "the scalar build reads values in their natural order");
  const int64_t K = qa.K;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<int32_t> q(K);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t k = 0; k < K; ++k)
        q[k] = int4 ? static_cast<int32_t>((static_cast<const uint8_t*>(w)[n * (K / 2) + (k / 32) * 16 + (k % 16)]
                                           >> ((k % 32) >= 16 ? 4 : 0)) & 15) - 8
                    : static_cast<const int8_t*>(w)[n * K + k];
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* am = qa.a.data() + m * K;
        const float* sm = qa.sc.data() + m * (K / 8);  // 4 lanes per block of 32
        float acc = 0.f;
        for (int64_t b = 0; b < K / 32; ++b) {
          int32_t d = 0;
          for (int t = 0; t < 32; ++t) d += static_cast<int32_t>(am[b * 32 + t]) * q[b * 32 + t];
          acc += static_cast<float>(d) * sm[b * 4] * (int4 ? scale[n * (K / group) + b * 32 / group] : 1.f);
        }
        const float v = acc * (int4 ? 1.f : scale[n]);
        y[m * N + n] = bias ? v + bias[n] : v;
      }
    }
  });
}
#endif

torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K);
  TORCH_CHECK(K % QS == 0, "K must be a multiple of ", QS);
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K] in step order");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.numel() == N && scale.is_contiguous(), "scale must be float32 [N]");
  auto y = torch::empty({M, N}, x.options());
  QAct qa(x.data_ptr<float>(), M, K, I8_OFFSET);
#if PD_Q_ISA >= 2
  qlinear_rows(I8Q{w.data_ptr<int8_t>(), scale.data_ptr<float>(), K}, qa, M, N, y.data_ptr<float>(), bias_ptr(bias, N));
#else
  qlinear_scalar(qa, M, N, false, w.data_ptr<int8_t>(), scale.data_ptr<float>(), 0, y.data_ptr<float>(), bias_ptr(bias, N));
#endif
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
#if PD_Q_ISA >= 2
  qlinear_rows(I4Q{w.data_ptr<uint8_t>(), scale.data_ptr<float>(), K, K / group, group / QS}, qa, M, N,
               y.data_ptr<float>(), bias_ptr(bias, N));
#else
  qlinear_scalar(qa, M, N, true, w.data_ptr<uint8_t>(), scale.data_ptr<float>(), group, y.data_ptr<float>(), bias_ptr(bias, N));
#endif
  return y;
}

// values per step of the integer-dot kernels: K and the int4 group must be multiples of it, and w8a8
// weights are stored in its step order (engine/quant.py step_order)
int64_t qstep() { return QS; }

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
#if PD_Q_ISA >= 2
constexpr int PW = VB / 4;  // outputs per panel
#if PD_Q_ISA == 3
constexpr int QNV = 4, QMR = 3;  // vectors x rows per tile: 12 int32 + 12 float accumulators
inline qiv qbcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline qiv qset1(int32_t v) { return _mm512_set1_epi32(v); }
#else
constexpr int QNV = 2, QMR = 2;
inline qiv qbcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline qiv qset1(int32_t v) { return _mm256_set1_epi32(v); }
#endif
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

// The w8a8 panels store their bytes as the row format does (q ^ 0x80 with VNNI, q without), so their dot and
// lane offset are I8Q's; int4 nibbles (<= 15) go straight into dot_us.

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
  qfv facc[MRc][NV];
  for (int i = 0; i < MRc; ++i)
    for (int v = 0; v < NV; ++v) facc[i][v] = qzero();
  for (int64_t b = 0; b < nb; ++b) {
    qiv iacc[MRc][NV];
    for (int i = 0; i < MRc; ++i) {
      const qiv st = qset1(qa.start[(m0 + i) * nb + b]);
      for (int v = 0; v < NV; ++v) iacc[i][v] = st;
    }
    if constexpr (INT4) {
      for (int j = 0; j < 4; ++j) {  // 4 octets of inputs per block
        const int64_t o = b * 4 + j;
        qiv lo[NV], hi[NV];
        if constexpr (PF) for (int v = 0; v < NV; ++v) prefetch_line(wt + (o + pfd) * step + v * VB);
        for (int v = 0; v < NV; ++v) nibbles(wt + o * step + v * VB, lo[v], hi[v]);
        for (int i = 0; i < MRc; ++i) {
          const int8_t* am = qa.a.data() + (m0 + i) * K + o * 8;
          const qiv a0 = qbcast(am), a1 = qbcast(am + 4);
          for (int v = 0; v < NV; ++v) iacc[i][v] = dot_us(dot_us(iacc[i][v], lo[v], a0), hi[v], a1);
        }
      }
      const int64_t g = b / bpg;
      qfv gs[NV];
      for (int v = 0; v < NV; ++v) gs[v] = qloadf(scale + (T * ng + g) * (QNV * PW) + ((p0 % QNV) + v) * PW);
      for (int i = 0; i < MRc; ++i) {
        const qfv s = qsplat(qa.sc[(m0 + i) * nb + b]);
        for (int v = 0; v < NV; ++v) facc[i][v] = qfma(iacc[i][v], qmul(s, gs[v]), facc[i][v]);
      }
    } else {
      for (int j = 0; j < 8; ++j) {  // 8 quads of inputs per block
        const int64_t q = b * 8 + j;
        qiv wv[NV];
        if constexpr (PF) for (int v = 0; v < NV; ++v) prefetch_line(wt + (q + pfd) * step + v * VB);
        for (int v = 0; v < NV; ++v) wv[v] = qload(wt + q * step + v * VB);
        for (int i = 0; i < MRc; ++i) {
          const qiv ab = qbcast(qa.a.data() + (m0 + i) * K + q * 4);
          for (int v = 0; v < NV; ++v) iacc[i][v] = I8Q::dot(iacc[i][v], wv[v], ab);
        }
      }
      for (int i = 0; i < MRc; ++i) {
        const qfv s = qsplat(qa.sc[(m0 + i) * nb + b]);
        for (int v = 0; v < NV; ++v) facc[i][v] = qfma(iacc[i][v], s, facc[i][v]);
      }
    }
  }
  for (int i = 0; i < MRc; ++i)
    for (int v = 0; v < NV; ++v) {
      float out[PW];
      qfv r = facc[i][v];
      if constexpr (!INT4) r = qmul(r, qloadf(scale + (p0 + v) * PW));
#if PD_Q_ISA == 3
      _mm512_storeu_ps(out, r);
#else
      _mm256_storeu_ps(out, r);
#endif
      const int64_t n = (p0 + v) * PW;
      for (int o = 0; o < PW && n + o < N; ++o) y[(m0 + i) * ldy + n + o] = bias ? out[o] + bias[n + o] : out[o];
    }
}

template <bool INT4, int NV, bool PF>
inline void qpanel_rows_pf(const uint8_t* w, const float* scale, int64_t K, int64_t ng, int64_t bpg, const QActP& qa,
                           int64_t m0, int64_t mr, int64_t p0, float* y, int64_t ldy, int64_t N, const float* bias,
                           int64_t pfd) {
  switch (mr) {
    case 1: qpanel_tile<INT4, NV, 1, PF>(w, scale, K, ng, bpg, qa, m0, p0, y, ldy, N, bias, pfd); break;
#if PD_Q_ISA == 3
    case 2: qpanel_tile<INT4, NV, 2, PF>(w, scale, K, ng, bpg, qa, m0, p0, y, ldy, N, bias, pfd); break;
#endif
    default: qpanel_tile<INT4, NV, QMR, PF>(w, scale, K, ng, bpg, qa, m0, p0, y, ldy, N, bias, pfd); break;
  }
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
                   int64_t M, float* y, const float* bias) {
  const int64_t NT = (N + QW - 1) / QW, ng = INT4 ? K / group : 1, bpg = INT4 ? group / 32 : 1, pfb = panel_pf_bytes(M);
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += QMR)
        qpanel_rows<INT4, QNV>(w, scale, K, ng, bpg, qa, m0, std::min<int64_t>(QMR, M - m0), t * QNV, y, N, N, bias, pfb);
  });
}

torch::Tensor linear_w8a8_panels(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t N,
                                 c10::optional<torch::Tensor> bias) {
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
                       bias_ptr(bias, N));
  return y;
}

torch::Tensor linear_w4a8_panels(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t N, int64_t group,
                                 c10::optional<torch::Tensor> bias) {
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
                      bias_ptr(bias, N));
  return y;
}
#endif

// outputs per panel of the integer panel kernels' formats; 0 where they are not built (the scalar build)
int64_t qpanel_width() {
#if PD_Q_ISA >= 2
  return QW;
#else
  return 0;
#endif
}

// ---- small per-layer ops at float32 (torch runs each as several kernels: ~16 us for an RMSNorm at batch 1) ----

// y = w * (x / sqrt(mean(x^2) + eps)) row by row: HF's LlamaRMSNorm at float32
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, H]");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.is_contiguous() && w.numel() == H, "w must be float32 [H]");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xp + m * H; float* yr = yp + m * H;
      float ss = 0.f;
      for (int64_t k = 0; k < H; ++k) ss += xr[k] * xr[k];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      for (int64_t k = 0; k < H; ++k) yr[k] = wp[k] * (xr[k] * r);
    }
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
        const v16f gv = load_f(gr + j);
        store_f(yr + j, gv / (exp16(splat(0.f) - gv) + 1.f) * load_f(ur + j));
      }
      for (; j < I; ++j) yr[j] = gr[j] / (1.f + std::exp(-gr[j])) * ur[j];
    }
  });
  return y;
}

// ---- paged decode attention ----------------------------------------------------------------------

enum class KV { F32, BF16, I8 };

// One cached row (token, kv head) as D floats, 16 at a time; the cache format is a template parameter
// so the inner loops carry no branch on it.
template <KV K>
struct Row {
  const uint8_t* p; int64_t D;
  inline v16f at(int64_t d) const {
    if constexpr (K == KV::F32) return load_f(reinterpret_cast<const float*>(p) + d);
    else if constexpr (K == KV::BF16) return load_bf16(reinterpret_cast<const uint16_t*>(p) + d);
    else return load_b(reinterpret_cast<const int8_t*>(p) + d);
  }
  inline float scale() const {
    if constexpr (K != KV::I8) return 1.f;
    else { float s; std::memcpy(&s, p + D, sizeof s); return s; }
  }
};

// The cache format of a [num_blocks, block_size, Hkv, Dp] cache of head_dim D, its row width checked.
KV kv_kind(const torch::Tensor& cache, int64_t D) {
  const int64_t Dp = cache.size(3);
  switch (cache.scalar_type()) {
    case torch::kFloat: TORCH_CHECK(Dp == D, "float32 cache rows must be D wide"); return KV::F32;
    case torch::kBFloat16: TORCH_CHECK(Dp == D, "bfloat16 cache rows must be D wide"); return KV::BF16;
    case torch::kChar: TORCH_CHECK(Dp == D + 4, "int8 cache rows must be D + 4 bytes"); return KV::I8;
    default: TORCH_CHECK(false, "unsupported KV cache dtype");
  }
  return KV::F32;  // not reached: TORCH_CHECK(false) throws
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t window,
                                     double sm_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, Dp] of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous int64 [B, max_blocks]");
  TORCH_CHECK(ctx_lens.scalar_type() == torch::kLong && ctx_lens.is_contiguous(), "ctx_lens must be int64 [B]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2), Dp = k_cache.size(3);
  const int64_t maxb = block_tables.size(1);
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == B && ctx_lens.numel() == B, "block_tables/ctx_lens must have B rows");
  const KV kind = kv_kind(k_cache, D);
  const int64_t esize = k_cache.element_size();
  const int64_t G = H / Hkv, row_bytes = Dp * esize;
  const auto* kb = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* vb = static_cast<const uint8_t*>(v_cache.data_ptr());
  const auto* bt = block_tables.data_ptr<int64_t>();
  const auto* lens = ctx_lens.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  auto out = torch::empty_like(q);
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);

  for (int64_t b = 0; b < B; ++b) {  // validate once, so the hot loops index without checks
    const int64_t ctx = lens[b];
    TORCH_CHECK(ctx >= 1 && (ctx + bs - 1) / bs <= maxb, "ctx_lens out of range of the block table");
    for (int64_t i = 0; i < (ctx + bs - 1) / bs; ++i)
      TORCH_CHECK(bt[b * maxb + i] >= 0 && bt[b * maxb + i] < NB, "block id out of range");
  }
  // DVC: D / 16 where it is known at compile time (head_dim 64 or 128: the accumulators of a query head
  // then live in registers), 0 otherwise
  auto run = [&](auto kind_c, auto dv_c) {
  constexpr KV KIND = decltype(kind_c)::value;
  constexpr int DVC = decltype(dv_c)::value;
  const int64_t DV = DVC ? DVC : D / 16;
  using R = Row<KIND>;
  constexpr int T = 16;  // tokens per block of V
  at::parallel_for(0, B * Hkv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores, vbuf(KIND == KV::F32 ? 0 : T * D), invs(G);
    std::vector<v16f> acc(G * DV);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hkv, h = p % Hkv, ctx = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t L = ctx - start, Lp = (L + 15) / 16 * 16;  // Lp: L padded to whole vectors
      scores.resize(G * Lp);
      auto row = [&](const uint8_t* base, int64_t t) {
        const int64_t blk = bt[b * maxb + t / bs];
        return R{base + ((blk * bs + t % bs) * Hkv + h) * row_bytes, D};
      };
      // scores = q . k * scale, per query head of the group: 16 tokens at a time, their 16 partial-sum
      // vectors folded into one vector of 16 scores (reduce16) instead of 16 horizontal sums
      int64_t t = 0;
      for (; t + 16 <= L; t += 16) {
        R ks[16];
        float kscale[16];
        for (int j = 0; j < 16; ++j) { ks[j] = row(kb, start + t + j); kscale[j] = ks[j].scale() * scale; }
        // the cache rows of a block are Hkv rows apart and blocks lie anywhere: fetch the next 16 K rows and
        // these tokens' V rows (read by the output pass) while this block computes
        for (int j = 0; j < 16; ++j) {
          const uint8_t* vr = row(vb, start + t + j).p;
          for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(vr + o, 0, 3);
          if (t + 16 + j < L) {
            const uint8_t* kr = row(kb, start + t + 16 + j).p;
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(kr + o, 0, 3);
          }
        }
        const v16f sv = load_f(kscale);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qp + (b * H + h * G + g) * D;
          v16f s[16];
          for (int j = 0; j < 16; ++j) s[j] = v16f{};
          for (int64_t d = 0; d < DV * 16; d += 16) {
            const v16f qv = load_f(qg + d);
            for (int j = 0; j < 16; ++j) s[j] += qv * ks[j].at(d);
          }
          store_f(scores.data() + g * Lp + t, reduce16(s) * sv);
        }
      }
      for (; t < L; ++t) {
        R k = row(kb, start + t);
        const float ksc = k.scale() * scale;
        for (int64_t g = 0; g < G; ++g) {
          v16f a{};
          for (int64_t d = 0; d < DV * 16; d += 16) a += load_f(qp + (b * H + h * G + g) * D + d) * k.at(d);
          scores[g * Lp + t] = hsum(a) * ksc;
        }
      }
      // softmax numerators per query head, 16 at a time (the padding past L becomes exp(-inf) = 0); the
      // division by their sum is applied to the output
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * Lp;
        for (int64_t t = L; t < Lp; ++t) sc[t] = -std::numeric_limits<float>::infinity();
        v16f mv = splat(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < Lp; t += 16) mv = vmax(mv, load_f(sc + t));
        float mvs[16];
        store_f(mvs, mv);
        float mx = mvs[0];
        for (int j = 1; j < 16; ++j) mx = std::max(mx, mvs[j]);
        v16f sum{};
        for (int64_t t = 0; t < Lp; t += 16) {
          const v16f e = exp16(load_f(sc + t) - mx);
          store_f(sc + t, e);
          sum += e;
        }
        invs[g] = 1.f / hsum(sum);
      }
      // out = sum_t p_t v_t / sum_t p_t, V in blocks of T tokens (as float rows: the cache's own rows for
      // float32, else converted and scaled once into vbuf), each block applied to every query head
      std::fill(acc.begin(), acc.end(), v16f{});
      for (int64_t t0 = 0; t0 < L; t0 += T) {
        const int nt = (int)std::min<int64_t>(T, L - t0);
        const float* vr[T];
        for (int j = 0; j < nt; ++j) {
          const R v = row(vb, start + t0 + j);
          if constexpr (KIND == KV::F32) {
            vr[j] = reinterpret_cast<const float*>(v.p);
          } else {
            const float vs = v.scale();
            for (int64_t d = 0; d < DV * 16; d += 16) store_f(vbuf.data() + j * D + d, v.at(d) * vs);
            vr[j] = vbuf.data() + j * D;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* pg = scores.data() + g * Lp + t0;
          v16f* ag = acc.data() + g * DV;
          if constexpr (DVC > 0) {
            v16f a[DVC];
            for (int dv = 0; dv < DVC; ++dv) a[dv] = ag[dv];
            for (int j = 0; j < nt; ++j) {
              const v16f pj = splat(pg[j]);
              for (int dv = 0; dv < DVC; ++dv) a[dv] += pj * load_f(vr[j] + 16 * dv);
            }
            for (int dv = 0; dv < DVC; ++dv) ag[dv] = a[dv];
          } else {
            for (int j = 0; j < nt; ++j) {
              const v16f pj = splat(pg[j]);
              for (int64_t dv = 0; dv < DV; ++dv) ag[dv] += pj * load_f(vr[j] + 16 * dv);
            }
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t dv = 0; dv < DV; ++dv) store_f(op + (b * H + h * G + g) * D + 16 * dv, acc[g * DV + dv] * invs[g]);
    }
  });
  };
  auto by_d = [&](auto kind_c) {
    if (D == 64) run(kind_c, std::integral_constant<int, 4>{});
    else if (D == 128) run(kind_c, std::integral_constant<int, 8>{});
    else run(kind_c, std::integral_constant<int, 0>{});
  };
  switch (kind) {
    case KV::F32: by_d(std::integral_constant<KV, KV::F32>{}); break;
    case KV::BF16: by_d(std::integral_constant<KV, KV::BF16>{}); break;
    default: by_d(std::integral_constant<KV, KV::I8>{}); break;
  }
  return out;
}


// ---- a whole decoder layer for a batch of single-token decodes, in one call ------------------------------
//
// At batch 1 a layer's Python (module calls, views, RoPE as 8 torch ops, the K/V write, dtype checks) costs
// about as much as streaming its weights; this runs the same steps with the same kernels in C++. RoPE and the
// K/V write are compiled without fast-math so they round exactly like the torch ops they replace: the fused
// layer gives the same numbers as DecoderLayer.forward (tests/engine/test_fused_decode.py).

// One linear layer's weights in one of the kernel formats: 0 fp32, 1 int8, 2 int4, 3 w8a8, 4 w4a8 (rows), 5 fp32
// in oneDNN's panels, 6 w8a8 / 7 w4a8 in the integer panel formats, 8 int8 / 9 int4 in float-style panels; N is
// the layer's output count.
struct KLinear {
  int64_t method;
  torch::Tensor w;
  c10::optional<torch::Tensor> scale, bias;
  int64_t group, N;
  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (method) {
      case 0: return linear_fp32(x, w, bias);
      case 1: return linear_int8(x, w, *scale, bias);
      case 2: return linear_int4(x, w, *scale, group, bias);
      case 3: return linear_w8a8(x, w, *scale, bias);
      case 5: return linear_panel(x, w, N, bias);
      case 8: return linear_int8_panels(x, w, *scale, N, bias);
      case 9: return linear_int4_panels(x, w, *scale, N, group, bias);
#if PD_Q_ISA >= 2
      case 6: return linear_w8a8_panels(x, w, *scale, N, bias);
      case 7: return linear_w4a8_panels(x, w, *scale, N, group, bias);
#endif
      default: return linear_w4a8(x, w, *scale, group, bias);
    }
  }
};
using KLinearSpec = std::tuple<int64_t, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, int64_t>;
KLinear make_linear(const KLinearSpec& s) {
  KLinear l{std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s), std::get<4>(s), std::get<5>(s)};
  TORCH_CHECK(l.method >= 0 && l.method <= 9 && (PD_Q_ISA >= 2 || l.method < 6 || l.method >= 8),
              "linear method out of range for this build");
  TORCH_CHECK(l.method == 0 || l.method == 5 || l.scale.has_value(), "a quantized linear needs its scale");
  return l;
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

// one K or V row of D floats into a cache row: float32 as is, bfloat16 rounded to nearest even, int8 as
// engine/quant.py quantize_kv (values round(x / s), then s = max(max|x| / 127, FLT_MIN) as 4 bytes)
void store_kv_row(uint8_t* dst, const float* x, int64_t D, torch::ScalarType dt) {
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
void add_into(torch::Tensor& a, const torch::Tensor& b) {
  float* ap = a.data_ptr<float>(); const float* bp = b.data_ptr<float>();
  const int64_t n = a.numel();
  for (int64_t i = 0; i < n; ++i) ap[i] += bp[i];
}

struct DecodeLayer {
  KLinear qkv, o, gate_up, down;
  torch::Tensor in_norm, post_norm;
  double eps;
  int64_t H, Hkv, D, window;
  double sm_scale;

  DecodeLayer(const KLinearSpec& qkv_, const KLinearSpec& o_, const KLinearSpec& gu_, const KLinearSpec& down_,
              torch::Tensor in_norm_, torch::Tensor post_norm_, double eps_, int64_t H_, int64_t Hkv_, int64_t D_,
              int64_t window_, double sm_scale_)
      : qkv(make_linear(qkv_)), o(make_linear(o_)), gate_up(make_linear(gu_)), down(make_linear(down_)),
        in_norm(in_norm_), post_norm(post_norm_), eps(eps_), H(H_), Hkv(Hkv_), D(D_), window(window_), sm_scale(sm_scale_) {
    TORCH_CHECK(D % 16 == 0 && H % Hkv == 0, "head_dim must be a multiple of 16 and H a multiple of Hkv");
  }

  // h [T, hidden] float32, every row one decode; cos/sin [T, 1, D/2]; slots [T]; block_tables/ctx_lens as
  // paged_decode_attention. Writes this step's K/V into the caches and returns the layer's output [T, hidden].
  torch::Tensor forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
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

    torch::Tensor x = qkv(rms_norm(h, in_norm, eps));  // [T, W]
    float* p = x.data_ptr<float>();
    const float* cp = cos.data_ptr<float>(); const float* sp = sin.data_ptr<float>();
    auto q = torch::empty({T, H, D}, h.options());
    float* qp = q.data_ptr<float>();
    auto* kb = static_cast<uint8_t*>(k_cache.data_ptr());
    auto* vb = static_cast<uint8_t*>(v_cache.data_ptr());
    const int64_t row_bytes = Dp * esize;
    for (int64_t t = 0; t < T; ++t) {
      float* r = p + t * W;
      rope_rows(r, H + Hkv, D, cp + t * half, sp + t * half);
      std::memcpy(qp + t * H * D, r, H * D * sizeof(float));
      for (int64_t j = 0; j < Hkv; ++j) {
        store_kv_row(kb + (sl[t] * Hkv + j) * row_bytes, r + (H + j) * D, D, dt);
        store_kv_row(vb + (sl[t] * Hkv + j) * row_bytes, r + (H + Hkv + j) * D, D, dt);
      }
    }
    auto attn = paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, window, sm_scale);
    torch::Tensor h2 = o(attn.view({T, H * D}));
    add_into(h2, h);
    torch::Tensor out = down(silu_mul(gate_up(rms_norm(h2, post_norm, eps))));
    add_into(out, h2);
    return out;
  }
};

// ---- causal prefill attention ------------------------------------------------------------------------
// n query rows of a prompt at positions off .. off + n - 1 over its nk = off + n keys (off = 0: a prompt with no
// cached context, K / V given as float32 [n, Hkv, D]; off > 0: a later chunk or a prefix-cache hit, K / V read from
// the paged cache through the block table, any cache dtype), causal, an optional sliding window (query i sees
// keys j with i - window < j <= i). Flash-style: a tile of PQ query rows of
// one head against blocks of PK keys, an online softmax per row, the scores and the output accumulated in
// registers through the same broadcast-FMA microkernel as the panel linears: K is transposed once per call to
// [Hkv, D, n] so a step over d is PK/16 contiguous key vectors times one broadcast per query row, and a step over
// keys is D/16 contiguous V vectors times one broadcast of each row's probability. Blocks past a tile's causal
// limit or before its window are skipped. Parallel over (query head, tile), head-major, so both threads get the
// same mix of short and long rows. Masked scores are -1e30 (finite under -ffast-math), whose exp is ~1e-38.
// K and V are first copied per KV head into contiguous float blocks (K as [Hkv, blocks, D, PK], V as [Hkv, nk, D];
// cache rows dequantized on the way): read in place, a block's rows sit a power of two apart (n * 4 or
// Hkv * D * 4 bytes) and crowd a few L1 sets.
constexpr int PQ = 6;    // query rows per tile
constexpr int PKV = 4;   // key vectors per block: PK = 64 keys
constexpr int PK = 16 * PKV;
constexpr float LAZY = 8.f;  // see the online softmax in prefill_tile

template <int DVC>
void prefill_tile(const float* q, int64_t qrow, const float* kt, const float* v, float* out, int64_t n, int64_t off,
                  int64_t H, int64_t Hkv, int64_t D, int64_t np, int64_t hq, int64_t i0, int64_t window, float scale) {
  const int64_t G = H / Hkv, h = hq / G, DV = DVC ? DVC : D / 16;
  const float* kth = kt + h * D * np;  // [np / PK, D, PK]
  const float* vh = v + h * np * D;     // [np, D]
  int64_t pos[PQ];
  for (int r = 0; r < PQ; ++r) pos[r] = off + std::min<int64_t>(i0 + r, n - 1);  // rows past n repeat the last one
  const int64_t hi = pos[PQ - 1] + 1;                                     // keys [lo, hi) matter to this tile
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[0] - window + 1) : 0;
  float qs[PQ][256];  // the tile's query rows, pre-scaled (D <= 256)
  for (int r = 0; r < PQ; ++r)
    for (int64_t d = 0; d < D; ++d) qs[r][d] = q[(pos[r] - off) * qrow + hq * D + d] * scale;
  float m[PQ];
  v16f lv[PQ];
  alignas(64) float o[PQ][256];
  alignas(64) float p[PQ][PK];
  for (int r = 0; r < PQ; ++r) {
    m[r] = -1e30f; lv[r] = v16f{};
    for (int64_t d = 0; d < D; ++d) o[r][d] = 0.f;
  }
  for (int64_t j0 = lo / PK * PK; j0 < hi; j0 += PK) {
    // scores of PQ rows x PK keys
    v16f s[PQ][PKV];
    for (int r = 0; r < PQ; ++r)
      for (int c = 0; c < PKV; ++c) s[r][c] = v16f{};
    for (int64_t d = 0; d < D; ++d) {
      v16f kv[PKV];
      for (int c = 0; c < PKV; ++c) kv[c] = load_f(kth + (j0 * D + d * PK) + 16 * c);
      for (int r = 0; r < PQ; ++r) {
        const v16f qb = splat(qs[r][d]);
        for (int c = 0; c < PKV; ++c) s[r][c] += qb * kv[c];
      }
    }
    // Masks only on blocks that cross the diagonal or the window's start.
    if (j0 + PK > pos[0] + 1 || (window > 0 && j0 <= pos[PQ - 1] - window))
      for (int r = 0; r < PQ; ++r) {
        for (int c = 0; c < PKV; ++c) store_f(p[r] + 16 * c, s[r][c]);
        for (int j = 0; j < PK; ++j) {
          const int64_t key = j0 + j;
          if (key > pos[r] || (window > 0 && key <= pos[r] - window)) p[r][j] = -1e30f;
        }
        for (int c = 0; c < PKV; ++c) s[r][c] = load_f(p[r] + 16 * c);
      }
    // Online softmax with a lazy maximum: a row's reference m moves (rescaling l and o) only when a score
    // exceeds it by more than LAZY, so most blocks skip the rescale; exp(s - m) <= e^LAZY keeps l and o far
    // from overflow, and o / l is unchanged by which m was used. l is kept per lane, summed at the end.
    for (int r = 0; r < PQ; ++r) {
      v16f mv = s[r][0];
      for (int c = 1; c < PKV; ++c) mv = vmax(mv, s[r][c]);
      const float bm = hmax(mv);
      if (bm > m[r] + LAZY) {
        const float alpha = std::exp(m[r] - bm);
        m[r] = bm;
        lv[r] = lv[r] * alpha;
        for (int64_t dv = 0; dv < DV; ++dv) store_f(o[r] + 16 * dv, load_f(o[r] + 16 * dv) * alpha);
      }
      const v16f mr = splat(m[r]);
      for (int c = 0; c < PKV; ++c) {
        const v16f e = exp16(s[r][c] - mr);
        store_f(p[r] + 16 * c, e);
        lv[r] += e;
      }
    }
    // o += p v over the block's keys (those below off + n), D/16 vectors at a time in chunks of 4
    const int64_t nk = std::min<int64_t>(PK, off + n - j0);
    for (int64_t dc = 0; dc < DV; dc += 4) {
      const int nv = (int)std::min<int64_t>(4, DV - dc);
      v16f a[PQ][4];
      for (int r = 0; r < PQ; ++r)
        for (int c = 0; c < nv; ++c) a[r][c] = load_f(o[r] + 16 * (dc + c));
      for (int64_t j = 0; j < nk; ++j) {
        const float* vr = vh + (j0 + j) * D + 16 * dc;
        v16f vv[4];
        for (int c = 0; c < nv; ++c) vv[c] = load_f(vr + 16 * c);
        for (int r = 0; r < PQ; ++r) {
          const v16f pb = splat(p[r][j]);
          for (int c = 0; c < nv; ++c) a[r][c] += pb * vv[c];
        }
      }
      for (int r = 0; r < PQ; ++r)
        for (int c = 0; c < nv; ++c) store_f(o[r] + 16 * (dc + c), a[r][c]);
    }
  }
  for (int r = 0; r < PQ && i0 + r < n; ++r) {
    const float inv = 1.f / hsum(lv[r]);
    for (int64_t dv = 0; dv < DV; ++dv) store_f(out + ((i0 + r) * H + hq) * D + 16 * dv, load_f(o[r] + 16 * dv) * inv);
  }
}

// [n, heads, D] float32 whose heads sit back to back in each token's row; the rows themselves may be strided (q, k
// and v as views into one qkv projection output), which saves three copies per layer.
bool heads_in_rows(const torch::Tensor& t) {
  return t.dim() == 3 && t.device().is_cpu() && t.scalar_type() == torch::kFloat && (t.size(2) <= 1 || t.stride(2) == 1) &&
         (t.size(1) <= 1 || t.stride(1) == t.size(2)) && (t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2));
}

// The shared body: q [n, H, D] (heads contiguous, rows strided) at positions off.., keys [0, off + n) of Hkv heads,
// fetch(j, h, k_dst, v_dst) writing key j's K and V rows of head h as D floats.
template <class Fetch>
torch::Tensor prefill_core(const torch::Tensor& q, int64_t off, int64_t Hkv, int64_t window, double sm_scale, Fetch fetch) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), nk = off + n, qrow = q.stride(0);
  auto out = torch::empty({n, H, D}, q.options());
  if (n == 0) return out;
  const int64_t np = (nk + PK - 1) / PK * PK;  // keys padded to whole blocks (zeros; masked)
  auto kt = torch::zeros({Hkv, np / PK, D, PK}, q.options());
  auto vt = torch::zeros({Hkv, np, D}, q.options());
  float* ktp = kt.data_ptr<float>(); float* vtp = vt.data_ptr<float>();
  at::parallel_for(0, Hkv * (np / PK), 1, [&](int64_t a, int64_t b) {
    alignas(64) float kr[256];
    for (int64_t hb = a; hb < b; ++hb) {
      const int64_t h = hb / (np / PK), j0 = (hb % (np / PK)) * PK;
      for (int64_t j = j0; j < std::min(nk, j0 + PK); ++j) {
        fetch(j, h, kr, vtp + (h * np + j) * D);
        for (int64_t d = 0; d < D; ++d) ktp[(hb * D + d) * PK + (j - j0)] = kr[d];
      }
    }
  });
  const float* qp = q.data_ptr<float>(); const float* vp = vtp; float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);
  const int64_t tiles = (n + PQ - 1) / PQ;
  at::parallel_for(0, H * tiles, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const int64_t hq = t / tiles, i0 = (t % tiles) * PQ;
      if (D == 64) prefill_tile<4>(qp, qrow, ktp, vp, op, n, off, H, Hkv, D, np, hq, i0, window, scale);
      else if (D == 128) prefill_tile<8>(qp, qrow, ktp, vp, op, n, off, H, Hkv, D, np, hq, i0, window, scale);
      else prefill_tile<0>(qp, qrow, ktp, vp, op, n, off, H, Hkv, D, np, hq, i0, window, scale);
    }
  });
  return out;
}

void check_prefill_q(const torch::Tensor& q, int64_t Hkv, int64_t window) {
  TORCH_CHECK(heads_in_rows(q), "q must be CPU float32 [n, H, D] with each token's heads contiguous (rows may be strided)");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 256, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(Hkv > 0 && q.size(1) % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 = none)");
}

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t window, double sm_scale) {
  TORCH_CHECK(heads_in_rows(k) && heads_in_rows(v) && k.sizes() == v.sizes(),
              "k and v must be CPU float32 [n, Hkv, D] of one shape with each token's heads contiguous");
  check_prefill_q(q, k.size(1), window);
  const int64_t D = q.size(2);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == D, "k/v must have q's tokens and head_dim");
  const float* kp = k.data_ptr<float>(); const float* vp = v.data_ptr<float>();
  const int64_t krow = k.stride(0), vrow = v.stride(0);
  return prefill_core(q, 0, k.size(1), window, sm_scale, [&](int64_t j, int64_t h, float* kd, float* vd) {
    std::memcpy(kd, kp + j * krow + h * D, D * sizeof(float));
    std::memcpy(vd, vp + j * vrow + h * D, D * sizeof(float));
  });
}

// The chunk's own K/V must already be in the cache (engine/attention.py writes them first).
torch::Tensor prefill_attention_paged(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t ctx_len, int64_t window, double sm_scale) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous CPU [num_blocks, block_size, Hkv, Dp] of one dtype");
  const int64_t NB = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2), Dp = k_cache.size(3);
  check_prefill_q(q, Hkv, window);
  const int64_t n = q.size(0), D = q.size(2);
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && block_table.dim() == 1 && block_table.is_contiguous(),
              "block_table must be contiguous int64 [blocks]");
  TORCH_CHECK(ctx_len >= n, "ctx_len must be at least q's tokens (they are the context's last ones)");
  TORCH_CHECK(bs > 0 && (ctx_len + bs - 1) / bs <= block_table.numel(), "block_table must cover ctx_len tokens");
  const int64_t* bt = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (ctx_len + bs - 1) / bs; ++i) TORCH_CHECK(bt[i] >= 0 && bt[i] < NB, "block id out of range");
  const KV kind = kv_kind(k_cache, D);
  const int64_t esize = k_cache.element_size();
  const auto* kb = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* vb = static_cast<const uint8_t*>(v_cache.data_ptr());
  const int64_t row_bytes = Dp * esize;
  auto run = [&](auto kind_c) {
    using R = Row<decltype(kind_c)::value>;
    return prefill_core(q, ctx_len - n, Hkv, window, sm_scale, [&](int64_t j, int64_t h, float* kd, float* vd) {
      const int64_t row = ((bt[j / bs] * bs + j % bs) * Hkv + h) * row_bytes;
      const R kr{kb + row, D}, vr{vb + row, D};
      const float ks = kr.scale(), vs = vr.scale();  // int8 rows: q * s, as engine/quant.py dequantize_kv
      for (int64_t d = 0; d < D; d += 16) {
        store_f(kd + d, kr.at(d) * ks);
        store_f(vd + d, vr.at(d) * vs);
      }
    });
  };
  if (kind == KV::F32) return run(std::integral_constant<KV, KV::F32>{});
  if (kind == KV::BF16) return run(std::integral_constant<KV, KV::BF16>{});
  return run(std::integral_constant<KV, KV::I8>{});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_fp32", &linear_fp32, "y = x w^T (+ bias), w float32 [N, K]");
  m.def("linear_int4_panels", &linear_int4_panels, "int4 weight-only in panels [NP, K, B/2] with group scales [NP, K/G, B]");
  m.def("linear_int8_panels", &linear_int8_panels, "int8 weight-only in panels [NP, K, B] with scale [NP * B]");
  m.def("linear_panel", &linear_panel, "y = x W^T (+ bias), W float32 in oneDNN's panels [NP, K, B] (see the source)");
  m.def("linear_int8", &linear_int8, "y = x (w * scale)^T (+ bias), w int8 [N, K], scale [N]");
  m.def("linear_int4", &linear_int4, "y = x W^T (+ bias), W int4 group-wise (see file header)");
  m.def("linear_w8a8", &linear_w8a8, "y = x (w * scale)^T (+ bias), w in step order, x rounded to int8 per 32 values");
  m.def("linear_w4a8", &linear_w4a8, "int4 group-wise W (see file header) with x rounded to int8 per 32 values");
#if PD_Q_ISA >= 2
  m.def("linear_w8a8_panels", &linear_w8a8_panels, "w8a8 with the weights in the integer panel format (see the source)");
  m.def("linear_w4a8_panels", &linear_w4a8_panels, "w4a8 with the weights in the integer panel format (see the source)");
#endif
  m.def("qpanel_width", &qpanel_width, "outputs per panel of the integer panel kernels, 0 where not built");
  m.def("qpanel_unsigned", []() {
#ifdef PD_Q_VNNI
    return true;
#else
    return false;
#endif
  }, "whether w8a8 panels store q ^ 0x80 (the VNNI builds)");
  m.def("set_panel_prefetch", [](int64_t one_row, int64_t rows) {
    TORCH_CHECK(one_row >= 0 && rows >= 0, "prefetch distances must be >= 0 bytes");
    g_panel_pf[0] = one_row; g_panel_pf[1] = rows;
  }, "bytes of its weight stream a panel tile prefetches ahead: for one input row, for several (0 = none)");
  m.def("panel_prefetch", []() { return std::make_pair(g_panel_pf[0].load(), g_panel_pf[1].load()); },
        "the (one row, several rows) prefetch distances in bytes");
  m.def("qstep", &qstep, "values per step of linear_w8a8 / linear_w4a8 (see the file's W8A8 section)");
  m.def("rms_norm", &rms_norm, "w * x / sqrt(mean(x^2) + eps) per row, float32");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from gate_up [M, 2I], float32");
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<const KLinearSpec&, const KLinearSpec&, const KLinearSpec&, const KLinearSpec&, torch::Tensor,
                          torch::Tensor, double, int64_t, int64_t, int64_t, int64_t, double>(),
           "(qkv, o, gate_up, down, in_norm, post_norm, eps, H, Hkv, D, window, sm_scale); a linear is "
           "(method 0 fp32 | 1 int8 | 2 int4 | 3 w8a8 | 4 w4a8 | 5 fp32 panels | 6 w8a8 panels | 7 w4a8 panels | "
           "8 int8 panels | 9 int4 panels, w, "
           "scale or None, bias or None, group, N)")
      .def("forward", &DecodeLayer::forward, "one decoder layer for T single-token decodes (see the source)");
  m.def("rope_", &rope_, "RoPE in place on the first heads of x [T, Hx, D] float32 (see the source)");
  m.def("prefill_attention_paged", &prefill_attention_paged,
        "(q [n, H, D], k_cache, v_cache, block_table, ctx_len, window, scale): the context's last n queries over "
        "its ctx_len cached keys (see the source)");
  m.def("prefill_attention", &prefill_attention,
        "(q [n, H, D], k / v [n, Hkv, D], window, scale): causal attention of a prompt over itself, float32");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence over its paged K/V read in place through the block table");
}
