// pdserve CPU kernels: the SIMD vocabulary every op file uses, one place for the instruction-set choices.
//
// Built with -march=native (engine/kernels.py), so the types below map to what the machine offers:
//   float lanes:   v16f / v16i, 16 floats / int32s: one AVX-512 register, or (PD_V16_PAIR) two AVX2
//                  registers, or GCC vector code elsewhere; load_f / store_f / splat / vmax / vmin / hsum / hmax /
//                  reduce16 / exp16, and widening loads of narrow integers (widen_i8 / widen_u8 / widen_u16).
//   integer dots:  qiv / qfv, one native vector of bytes / floats for the w8a8 / w4a8 kernels (PD_Q_ISA: 3 AVX-512
//                  VNNI, 2 AVX2, 0 scalar; VB bytes per vector, QS values per step, PD_Q_VNNI where dpbusd exists);
//                  qload / qloadf / qzero / qsplat / qmul / qfma / qsum / dot_us / qxor80 / nibbles / qbcast /
//                  qset1 / qstoref, and the int8-weight dot (qload_i8w, dot_i8, I8_OFFSET).
// The op files (linear_rows.cpp, panels.cpp, int_dots.cpp, ...) hold no instruction-set #if of their own
// beyond the tile shapes that follow from these.
#pragma once
#include <torch/extension.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace pdserve {

// ---- float lanes ---------------------------------------------------------------------------------------
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

inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 3); }

// ---- integer dots (w8a8 / w4a8): see int_dots.cpp for the arithmetic ------------------------------------
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


// broadcasts, stores, and the int8-weight dot: the instructions differ by build, the kernels do not
#if PD_Q_ISA == 3
inline qiv qbcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline qiv qset1(int32_t v) { return _mm512_set1_epi32(v); }
inline void qstoref(float* p, qfv v) { _mm512_storeu_ps(p, v); }
#elif PD_Q_ISA == 2
inline qiv qbcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline qiv qset1(int32_t v) { return _mm256_set1_epi32(v); }
inline void qstoref(float* p, qfv v) { _mm256_storeu_ps(p, v); }
#endif
#if PD_Q_ISA >= 2
// VB int8 weights as they enter dot_i8: q ^ 0x80 with VNNI (dpbusd takes them unsigned), q without
inline qiv qload_i8w(const void* p) {
#ifdef PD_Q_VNNI
  return qxor80(qload(p));
#else
  return qload(p);
#endif
}
// acc + int8 weights (as qload_i8w gives them) times int8 activations a, 4 to an int32 lane
inline qiv dot_i8(qiv acc, qiv wv, qiv a) {
#ifdef PD_Q_VNNI
  return dot_us(acc, wv, a);
#else
  // |q| <= 127 and |a| <= 127: pair sums stay within int16
  __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(a, wv));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}
#endif
// what int8 weights are offset by where they enter the dot product (each lane starts at -offset * sum a)
#ifdef PD_Q_VNNI
constexpr int I8_OFFSET = 128;  // int8 weights enter dpbusd as q ^ 0x80
#else
constexpr int I8_OFFSET = 0;    // plain AVX2: |q| and sign(a, q) through maddubs; scalar: signed products
#endif

}  // namespace pdserve
