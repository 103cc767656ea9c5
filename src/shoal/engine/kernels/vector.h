// 16-lane float vectors for the kernels. With AVX-512 (and on other CPUs: NEON, ...) they
// are the compiler's generic vector types, one AVX-512 register or four NEON ones. With
// AVX2 (and no AVX-512) they are a pair of AVX2 registers (vector_avx2.h): GCC lowers a
// 64-byte generic vector there through the stack (a splat as sixteen scalar stores, every
// tile's accumulators spilled), which ran the prompt attention at ~3 GFLOP/s.
// Loads and stores go through memcpy or unaligned loads, so pointers need only element
// alignment. Both forms offer the same operations: arithmetic with vectors and scalars,
// comparisons giving a mask, select(mask, a, b) and `&` of masks.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "vector_avx2.h"
#else

namespace shoal_vec {

using bf16 = at::BFloat16;

typedef float f32x16 __attribute__((vector_size(64)));
// What comparing two f32x16 gives: all ones where true.
typedef int32_t mask16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

constexpr int64_t kLanes = 16;

inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline f32x16 splat(float value) { return f32x16{} + value; }

// a where the mask is set, b elsewhere.
inline f32x16 select(mask16 mask, f32x16 a, f32x16 b) { return mask ? a : b; }

// Lanes 0, 1, .., 15 plus `first`.
inline f32x16 iota(float first) {
  return f32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + first;
}

// bf16 is the top half of a float32.
inline f32x16 load(const bf16* p) {
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// int8 values (an int8 KV cache row) as floats, exactly: widened to int32, then converted
// (one byte-to-float conversion compiles to sixteen scalar ones).
inline f32x16 load(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))));
  f32x16 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  i8x16 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(__builtin_convertvector(bytes, i32x16), f32x16);
#endif
}

// The bits of bf16(v) in the top half of each lane, the bottom half zero: round to nearest
// even, NaN to the quiet NaN, as c10::BFloat16(float) does per element.
inline u32x16 bf16_bits(f32x16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += ((bits >> 16) & 1u) + 0x7FFFu;
  bits = (v == v) ? bits : u32x16{} + 0x7FC00000u;
  return bits & 0xFFFF0000u;
}

// float(bf16(v)): the rounding a bf16 tensor between two ops applies.
inline f32x16 round_bf16(f32x16 v) {
  const u32x16 bits = bf16_bits(v);
  f32x16 rounded;
  std::memcpy(&rounded, &bits, sizeof rounded);
  return rounded;
}

inline void store(bf16* p, f32x16 v) {
  const u16x16 half = __builtin_convertvector(bf16_bits(v) >> 16, u16x16);
  std::memcpy(p, &half, sizeof half);
}

// a * b + c: one rounding where the CPU has FMA (AVX-512), a product and a sum elsewhere.
// Either way the same inputs give the same bits on one machine.
inline f32x16 fma(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float hmax(f32x16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float hsum(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(v));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// e^x to about 1 ulp (the Cephes expf scheme): x = n ln2 + r with |r| <= ln2 / 2, e^r by a
// degree-7 polynomial, 2^n written into the exponent bits. Inputs below -87 give e^-87
// (~1e-38), above 88 give e^88; softmax and SiLU never need more.
inline f32x16 exp(f32x16 x) {
  const f32x16 lo = splat(-87.f), hi = splat(88.f);
  x = select(x < lo, lo, x);
  x = select(x > hi, hi, x);
  const f32x16 magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504088896341f + magic) - magic;
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  return p * scale;
}

}  // namespace shoal_vec

#endif  // AVX2 without AVX-512
