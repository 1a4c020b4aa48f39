// pdserve CPU kernels: the one SIMD vocabulary of every op file. Every instruction-set choice of the kernels is made
// in this header (as ggml-cpu's simd-mappings.h): the op files name the types, operations and constants below, never
// an intrinsic or an instruction-set macro (the one exception: int_dots.cpp's choice of its scalar kernel).
//
// Built with -march=native (engine/kernels.py), so the first block picks, once:
//   PD_F_ISA   the float lanes:  3 AVX-512F, 2 AVX2 (16 floats then take two registers), 0 GCC vector code elsewhere
//   PD_Q_ISA   the integer dots: 3 AVX-512 VNNI (+BW), 2 AVX2, 0 scalar
//   PD_Q_VNNI  1 where dpbusd exists (AVX-512 VNNI, AVX-VNNI), 0 where AVX2 emulates it with maddubs + madd
// and the op files see them as constants: Q_ISA, Q_VNNI, V16_REGS (registers per v16f; the tiles follow from it).
//
// Types: GCC vector types (+ - * / and lane indexing work on them), except the AVX2 v16f (a pair with those operators):
//   v16f / v16i  16 float / int32 lanes: the float kernels' unit (their panel and KV-row formats count in 16s). One zmm
//                with AVX-512F; two vf32 / vi32 with AVX2 only (V16_REGS = 2); a 64-byte GCC vector elsewhere.
//   vf32 / vi32  one integer-dot register of VL = VB / 4 float / int32 lanes (VB = 64 bytes with AVX-512 VNNI, 32 with
//                AVX2): the integer kernels' unit (their step order and panel widths follow from VB). With AVX-512 VNNI
//                they are v16f / v16i. Defined where Q_ISA >= 2.
//   vi8 / vu8    the same register as VB int8 / uint8 bytes.
// Operations (templated or overloaded over the types):
//   memory       load<V>(p), store(p, v), splat<V>(x) (V{} is zero), bcast4(p) (4 bytes into every int32 lane of a
//                vi8), prefetch_line(p)
//   float        fmadd(a, b, c) (a * b + c rounded once: an instruction fast-math cannot reassociate), to_f (int32 ->
//                float lanes), vmax / vmin, hsum / hsum_tree (the sum of the lanes: see there), hmax, reduce16, exp16;
//                as_i / as_f (bits), opaque (a compiler barrier)
//   narrow data  widen_i8 / widen_u8 / widen_u16 (16 values -> v16i), load_b / load_bf16 (16 values -> v16f),
//                int4_level / int4_scaled (int4 nibbles -> their float levels)
//   int dots     dot_us (unsigned x signed bytes, 4 to an int32 lane, into acc), nibbles (VB bytes -> their low and
//                high nibbles), load_i8w / dot_i8 (int8 weights into the dot: q ^ 0x80 through dpbusd with VNNI, |q|
//                and sign(a, q) through maddubs without), I8_OFFSET / I4_OFFSET (what int8 / int4 weights are offset by
//                there), dot_bytes (the scalar build's dot)
#pragma once
#include <torch/extension.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

// ---- the instruction sets (every choice of the kernels is made here) -------------------------------------
#if defined(__AVX512F__)
#define PD_F_ISA 3
#elif defined(__AVX2__)
#define PD_F_ISA 2
#else
#define PD_F_ISA 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PD_Q_ISA 3
#elif defined(__AVX2__)
#define PD_Q_ISA 2
#else
#define PD_Q_ISA 0
#endif
#if PD_Q_ISA == 3 || (PD_Q_ISA == 2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))))
#define PD_Q_VNNI 1
#else
#define PD_Q_VNNI 0
#endif

namespace pdserve {

constexpr int Q_ISA = PD_Q_ISA;
constexpr bool Q_VNNI = PD_Q_VNNI;
constexpr int V16_REGS = PD_F_ISA == 2 ? 2 : 1;  // registers a v16f takes (AVX2: the tiles hold half as many)
// bytes per integer-dot register (the scalar build: half a step)
constexpr int VB = PD_Q_ISA == 3 ? 64 : PD_Q_ISA == 2 ? 32 : 16;
constexpr int VL = VB / 4;  // int32 / float lanes per integer-dot register
constexpr int QS = 2 * VB;  // values per step of the integer dot kernels (int_dots.cpp)

// ---- types --------------------------------------------------------------------------------------------------
#if PD_Q_ISA >= 2
typedef float vf32 __attribute__((vector_size(VB)));
typedef int32_t vi32 __attribute__((vector_size(VB)));
typedef int8_t vi8 __attribute__((vector_size(VB)));
typedef uint8_t vu8 __attribute__((vector_size(VB)));
#endif
#if PD_F_ISA == 2
// AVX2: a 64-byte GCC vector has no machine mode here, so GCC keeps it in memory and every operation
// goes through loads and stores (measured: the linears 5-20x slower than this). A pair of native 8-float
// vectors with the few operators the kernels use compiles to register-resident ymm code instead.
struct v16f { vf32 lo, hi; };
struct v16i { vi32 lo, hi; };
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
#else
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#endif

// ---- memory -------------------------------------------------------------------------------------------------
template <class V> inline V load(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <class V> inline void store(void* p, V v) { std::memcpy(p, &v, sizeof v); }
template <class V, class T> inline V splat(T x) { return V{} + x; }
#if PD_F_ISA == 2
template <> inline v16f load<v16f>(const void* p) {
  vf32 a, b; std::memcpy(&a, p, 32); std::memcpy(&b, static_cast<const char*>(p) + 32, 32); return {a, b};
}
inline void store(void* p, v16f v) { std::memcpy(p, &v.lo, 32); std::memcpy(static_cast<char*>(p) + 32, &v.hi, 32); }
#endif
inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 3); }

// ---- float lanes --------------------------------------------------------------------------------------------
#if PD_F_ISA == 2
inline v16f vmax(v16f a, v16f b) { return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi}; }
inline v16f vmin(v16f a, v16f b) { return {a.lo < b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi}; }
#else
inline v16f vmax(v16f a, v16f b) { return a > b ? a : b; }
inline v16f vmin(v16f a, v16f b) { return a < b ? a : b; }
#endif
inline v16i as_i(v16f v) { v16i r; std::memcpy(&r, &v, sizeof r); return r; }
inline v16f as_f(v16i v) { v16f r; std::memcpy(&r, &v, sizeof r); return r; }
#if PD_Q_ISA == 3
inline vf32 fmadd(vf32 a, vf32 b, vf32 c) { return (vf32)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif PD_Q_ISA == 2
inline vf32 fmadd(vf32 a, vf32 b, vf32 c) { return (vf32)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
inline vf32 to_f(vi32 v) { return __builtin_convertvector(v, vf32); }  // (with AVX-512 VNNI vi32 is v16i)
#endif
#if PD_F_ISA == 2
inline v16f to_f(v16i v) { return {to_f(v.lo), to_f(v.hi)}; }
#else
inline v16f to_f(v16i v) { return __builtin_convertvector(v, v16f); }
#endif

// hsum: the sum of 16 lanes, in the order the compiler picks for the lane loop in each kernel (the float kernels'
// results were fixed with it: a fixed tree here gives other bits in some tiles). hsum_tree: the sum of one integer-dot
// register's lanes by one fixed tree (halves added down to 4 lanes, then (0 + 2) + (1 + 3)), the integer kernels'.
#if PD_F_ISA == 2
inline float hsum(v16f v) {
  vf32 a = v.lo + v.hi;
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a[i];
  return s;
}
#else
inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
#endif
#if PD_Q_ISA == 3
inline float hsum_tree(vf32 v) { return _mm512_reduce_add_ps((__m512)v); }
#elif PD_Q_ISA == 2
inline float hsum_tree(vf32 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
// the largest of the 16 lanes, by a log2 tree of shuffles (no 16-step scalar chain)
#if PD_F_ISA == 2
inline float hmax(v16f v) {
  vf32 a = v.lo > v.hi ? v.lo : v.hi, b;
  b = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3); a = a > b ? a : b;
  b = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5); a = a > b ? a : b;
  b = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6); a = a > b ? a : b;
  return a[0];
}
#else
inline float hmax(v16f v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}
#endif

#if PD_F_ISA == 2
// 16 vectors -> one vector of their 16 horizontal sums, in order
inline v16f reduce16(v16f* s) {
  float r[16];
  for (int j = 0; j < 16; ++j) r[j] = hsum(s[j]);
  return load<v16f>(r);
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

// A compiler barrier: v is computed here, as written, before any later use (no instruction is emitted);
// -ffast-math may not fold or reassociate across it.
__attribute__((always_inline)) inline void opaque(v16f& v) {
#if PD_F_ISA == 2
  asm("" : "+x"(v.lo), "+x"(v.hi));
#elif PD_F_ISA == 3
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
  x = vmin(vmax(x, splat<v16f>(-87.3f)), splat<v16f>(88.3f));
  const float magic = 12582912.f;  // 1.5 * 2^23: x * log2(e) + magic holds round(x * log2(e)) in its low bits
  v16f t = x * 1.44269504088896341f + magic;
  opaque(t);  // fast-math would fold (t - magic) back into x * log2(e)
  const v16f n = t - magic;
  v16f r = x - n * 0.693359375f;  // ln 2 in two parts (Cody-Waite), kept apart
  opaque(r);
  r = r - n * -2.12194440e-4f;
  v16f p = splat<v16f>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
#if PD_F_ISA == 3
  return (v16f)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
  return p * as_f(((as_i(t) - as_i(splat<v16f>(magic))) + 127) << 23);
#endif
}

// ---- narrow data into 16 lanes ------------------------------------------------------------------------------
// Widening loads of 16 narrow integers into 16 int32 lanes. GCC lowers __builtin_convertvector of
// 8- and 16-bit vectors lane by lane, so these use the one-instruction widening moves directly.
#if PD_F_ISA == 3
inline v16i widen_i8(const void* p) { return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline v16i widen_u8(const void* p) { return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline v16i widen_u16(const void* p) { return (v16i)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
#elif PD_F_ISA == 2
inline v16i join(__m256i lo, __m256i hi) { return {(vi32)lo, (vi32)hi}; }
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
template <class T>
inline v16i widen_scalar(const void* p) {
  T t[16]; std::memcpy(t, p, sizeof t);
  v16i r;
  for (int i = 0; i < 16; ++i) r[i] = t[i];
  return r;
}
inline v16i widen_i8(const void* p) { return widen_scalar<int8_t>(p); }
inline v16i widen_u8(const void* p) { return widen_scalar<uint8_t>(p); }
inline v16i widen_u16(const void* p) { return widen_scalar<uint16_t>(p); }
#endif
// 16 bfloat16 values (their bits) as floats
inline v16f load_bf16(const uint16_t* p) {
  const v16i w = widen_u16(p) << 16;
#if PD_F_ISA == 2
  return {(vf32)w.lo, (vf32)w.hi};
#else
  return as_f(w);
#endif
}
// 16 int8 values as floats
inline v16f load_b(const int8_t* p) { return to_f(widen_i8(p)); }

// The int4 level n - 8 (exact) of the nibble n of each lane of q: its low 4 bits, or (high) bits 4-7.
__attribute__((always_inline)) inline v16f int4_level(v16i q, bool high) {
#if PD_F_ISA == 3
  // vpermps reads the low 4 bits of each index: the low nibble as is, the high one shifted down
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return (v16f)_mm512_permutexvar_ps((__m512i)(high ? q >> 4 : q), table);
#else
  return to_f((high ? q >> 4 : q & 15) - 8);
#endif
}
// (n - 8) * s for the nibbles n (0..15) in the lanes of nib
inline v16f int4_scaled(v16i nib, float s) {
#if PD_F_ISA == 3
  // one permute looks the 16 nibbles up in the table of (i - 8) * s
  const v16f base{-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
  return (v16f)_mm512_permutexvar_ps((__m512i)nib, (__m512)(base * splat<v16f>(s)));
#else
  return to_f(nib - 8) * splat<v16f>(s);
#endif
}

// ---- integer dots (w8a8 / w4a8): see int_dots.cpp for the arithmetic ----------------------------------------
#if PD_Q_ISA >= 2
// VB bytes -> their low and high nibbles (0..15)
inline void nibbles(const uint8_t* p, vu8& lo, vu8& hi) {
#if PD_Q_ISA == 3
  const __m512i v = _mm512_loadu_si512(p), m = _mm512_set1_epi8(0x0F);
  lo = (vu8)_mm512_and_si512(v, m);
  hi = (vu8)_mm512_and_si512(_mm512_srli_epi16(v, 4), m);
#else
  const __m256i v = _mm256_loadu_si256((const __m256i*)p), m = _mm256_set1_epi8(0x0F);
  lo = (vu8)_mm256_and_si256(v, m);
  hi = (vu8)_mm256_and_si256(_mm256_srli_epi16(v, 4), m);
#endif
}
// the 4 bytes at p in every int32 lane
inline vi8 bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return (vi8)splat<vi32>(v); }

// acc + unsigned bytes u times signed bytes a, 4 to an int32 lane
inline vi32 dot_us(vi32 acc, vu8 u, vi8 a) {
#if PD_Q_ISA == 3
  return (vi32)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)a);
#elif defined(__AVXVNNI__)
  return (vi32)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)a);
#elif PD_Q_VNNI
  return (vi32)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)u, (__m256i)a);
#else
  // only for int4 nibbles here (|u| <= 15), so the 16-bit pair sums of maddubs cannot saturate
  const __m256i p = _mm256_maddubs_epi16((__m256i)u, (__m256i)a);
  return (vi32)_mm256_add_epi32((__m256i)acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}
// VB int8 weights as they enter dot_i8: q ^ 0x80 with VNNI (dpbusd takes them unsigned), q without
inline vi8 load_i8w(const void* p) {
#if PD_Q_VNNI
  return load<vi8>(p) ^ static_cast<int8_t>(0x80);
#else
  return load<vi8>(p);
#endif
}
// acc + int8 weights (as load_i8w gives them, or as the w8a8 panels store them) times int8 activations a, 4 to an
// int32 lane
inline vi32 dot_i8(vi32 acc, vi8 w, vi8 a) {
#if PD_Q_VNNI
  return dot_us(acc, (vu8)w, a);
#else
  // |q| <= 127 and |a| <= 127: pair sums stay within int16
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8((__m256i)w), _mm256_sign_epi8((__m256i)a, (__m256i)w));
  return (vi32)_mm256_add_epi32((__m256i)acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}
#endif
// the scalar build's dot: sum of a[t] * w[t] over n values, exact in int32
inline int32_t dot_bytes(const int8_t* a, const int8_t* w, int n) {
  int32_t d = 0;
  for (int t = 0; t < n; ++t) d += static_cast<int32_t>(a[t]) * w[t];
  return d;
}
// what weights are offset by where they enter the dot (each lane then starts at -offset * the sum of its activations):
// int8 q ^ 0x80 = q + 128 into dpbusd, 0 where plain AVX2 takes |q| and sign(a, q) through maddubs and where the scalar
// build multiplies signed values; int4 nibbles are stored q + 8, multiplied as they are by the vector builds (8) and
// decoded to q by the scalar one (0)
constexpr int I8_OFFSET = PD_Q_VNNI ? 128 : 0;
constexpr int I4_OFFSET = PD_Q_ISA >= 2 ? 8 : 0;

}  // namespace pdserve
