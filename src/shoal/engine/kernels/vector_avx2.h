// shoal_vec's 16-lane vectors on a CPU with AVX2 and FMA but no AVX-512: each f32x16 is two
// AVX2 registers (lanes 0-7 in lo, 8-15 in hi), every operation two instructions. Included by
// vector.h only; the arithmetic is the generic form's, lane by lane (the same roundings, so
// results equal the generic vectors' on this CPU), except fma, which fuses here as it does
// on AVX-512.

#pragma once

#include <immintrin.h>

namespace shoal_vec {

using bf16 = at::BFloat16;

constexpr int64_t kLanes = 16;

struct f32x16 {
  __m256 lo, hi;
};

// What comparing two f32x16 gives: all ones where true.
struct mask16 {
  __m256 lo, hi;
};

inline f32x16 splat(float value) {
  const __m256 v = _mm256_set1_ps(value);
  return {v, v};
}

#define SHOAL_VEC_BINARY(op, intrinsic)                                                     \
  inline f32x16 operator op(f32x16 a, f32x16 b) {                                          \
    return {intrinsic(a.lo, b.lo), intrinsic(a.hi, b.hi)};                                 \
  }                                                                                        \
  inline f32x16 operator op(f32x16 a, float b) { return a op splat(b); }                   \
  inline f32x16 operator op(float a, f32x16 b) { return splat(a) op b; }                   \
  inline f32x16& operator op##=(f32x16 & a, f32x16 b) { return a = a op b; }               \
  inline f32x16& operator op##=(f32x16 & a, float b) { return a = a op splat(b); }
SHOAL_VEC_BINARY(+, _mm256_add_ps)
SHOAL_VEC_BINARY(-, _mm256_sub_ps)
SHOAL_VEC_BINARY(*, _mm256_mul_ps)
SHOAL_VEC_BINARY(/, _mm256_div_ps)
#undef SHOAL_VEC_BINARY

inline f32x16 operator-(f32x16 a) {  // flips the sign bit, as the generic form's negation
  const __m256 sign = _mm256_set1_ps(-0.f);
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}

// Ordered comparisons (false where either side is NaN), as the generic vectors compare.
#define SHOAL_VEC_COMPARE(op, predicate)                                                    \
  inline mask16 operator op(f32x16 a, f32x16 b) {                                          \
    return {_mm256_cmp_ps(a.lo, b.lo, predicate), _mm256_cmp_ps(a.hi, b.hi, predicate)};   \
  }                                                                                        \
  inline mask16 operator op(f32x16 a, float b) { return a op splat(b); }
SHOAL_VEC_COMPARE(<, _CMP_LT_OQ)
SHOAL_VEC_COMPARE(<=, _CMP_LE_OQ)
SHOAL_VEC_COMPARE(>, _CMP_GT_OQ)
SHOAL_VEC_COMPARE(>=, _CMP_GE_OQ)
SHOAL_VEC_COMPARE(==, _CMP_EQ_OQ)
#undef SHOAL_VEC_COMPARE

inline mask16 operator&(mask16 a, mask16 b) {
  return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)};
}

// a where the mask is set, b elsewhere.
inline f32x16 select(mask16 mask, f32x16 a, f32x16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, mask.lo), _mm256_blendv_ps(b.hi, a.hi, mask.hi)};
}

// Lanes 0, 1, .., 15 plus `first`.
inline f32x16 iota(float first) {
  return f32x16{_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)} + first;
}

inline f32x16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

inline void store(float* p, f32x16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}

// bf16 is the top half of a float32: eight halves widened and shifted up.
inline __m256 widen_bf16(const bf16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline f32x16 load(const bf16* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }

// int8 values (an int8 KV cache row) as floats, exactly.
inline __m256 widen_int8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

inline f32x16 load(const int8_t* p) { return {widen_int8(p), widen_int8(p + 8)}; }

// The bits of bf16(v) in the top half of each lane, the bottom half zero: round to nearest
// even, NaN to the quiet NaN, as c10::BFloat16(float) does per element.
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i number = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_EQ_OQ));
  const __m256i chosen = _mm256_blendv_epi8(_mm256_set1_epi32(0x7FC00000), rounded, number);
  return _mm256_and_si256(chosen, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// float(bf16(v)): the rounding a bf16 tensor between two ops applies.
inline f32x16 round_bf16(f32x16 v) {
  return {_mm256_castsi256_ps(bf16_bits(v.lo)), _mm256_castsi256_ps(bf16_bits(v.hi))};
}

inline void store(bf16* p, f32x16 v) {
  // Each lane's top half moved down, then packed to 16 halves: packus interleaves the two
  // registers by 128-bit half, the permute puts the quarters back in order.
  const __m256i lo = _mm256_srli_epi32(bf16_bits(v.lo), 16);
  const __m256i hi = _mm256_srli_epi32(bf16_bits(v.hi), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

// a * b + c with one rounding.
inline f32x16 fma(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

inline float hmax(f32x16 v) {
  __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// The lanes' sum in lane order, as the generic form adds them (a tree would be quicker, but
// this sum feeds RMSNorm's scale, which the Python path's float32 sum should stay near).
inline float hsum(f32x16 v) {
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, v.lo);
  _mm256_store_ps(lanes + 8, v.hi);
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) sum += lanes[i];
  return sum;
}

// e^x as the generic form computes it (vector.h: the Cephes expf scheme), half a vector.
inline __m256 exp8(__m256 x) {
  // max / min return their second operand when either is NaN: NaN stays NaN, as in select.
  x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
  const __m256 r =
      _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                    _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  auto step = [&](__m256 p, float c) {
    return _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  };
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = step(p, 1.3981999507e-3f);
  p = step(p, 8.3334519073e-3f);
  p = step(p, 4.1665795894e-2f);
  p = step(p, 1.6666665459e-1f);
  p = step(p, 5.0000001201e-1f);
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
                    _mm256_set1_ps(1.f));
  const __m256i exponent =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

inline f32x16 exp(f32x16 x) { return {exp8(x.lo), exp8(x.hi)}; }

}  // namespace shoal_vec
