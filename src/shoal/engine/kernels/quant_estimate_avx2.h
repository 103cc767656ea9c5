// The int8 estimate of the head's 3- or 4-bit copy (quant_head_copy.h) on AVX2 without VNNI
// (AMD Zen 2 and 3, most Intel desktops): what quant_estimate.cpp's vpdpbusd does in one op,
// here vpmaddubsw (32 products of unsigned copy codes and signed x codes, summed in pairs to
// int16) and, every few planes, vpmaddwd with ones to int32. The int16 sums cannot saturate:
// a pair is at most 2 x 15 x 127 = 3810 for 4-bit codes (8 planes: 30480) and 2 x 7 x 127 =
// 1778 for 3-bit ones (16 planes, a whole block: 28448). So the int32 dots are the exact ones
// vpdpbusd gives, and each block is then scaled with the same float32 operations, in the same
// order: both paths give the same bits.
//
// Against a Q4_1 copy on QuantLinear's int16 path (5 bits a weight), a 3-bit copy is 30% fewer
// bytes and about a quarter of the operations: Qwen2.5-Coder-1.5B's head, 2 threads of a Zen 3
// host, one row 4.2 ms against 5.7-7.0, 4 rows 13 against 15.5.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_head_copy.h"
#include "quant_prefetch.h"

namespace shoal_quant {

// Plane P of a copy's block for columns [8 h, 8 h + 8): each 32-bit lane holds one column's
// codes for k = 4 P .. 4 P + 3 (quant_head_copy.h). The shifts move bits across bytes only
// into positions the masks clear.
template <int Bits, int P>
inline __m256i copy_plane_avx2(const uint8_t* block, int h) {
  constexpr CopyLayout layout = copy_layout(Bits);
  if constexpr (Bits == 4) {
    const __m256i chunk =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * (P / 2) + 32 * h));
    return _mm256_and_si256(P % 2 ? _mm256_srli_epi16(chunk, 4) : chunk,
                            _mm256_set1_epi8(0x0F));
  } else {
    constexpr int bit = P % 8;
    const __m256i low =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * (P / 4) + 32 * h));
    const __m256i high = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(block + layout.high_at + 64 * (P / 8) + 32 * h));
    __m256i shifted;  // the third bit of plane P's codes on bit 2
    if constexpr (bit < 2) shifted = _mm256_slli_epi16(high, 2 - bit);
    else if constexpr (bit == 2) shifted = high;
    else shifted = _mm256_srli_epi16(high, bit - 2);
    const __m256i two = _mm256_and_si256(_mm256_srli_epi16(low, 2 * (P % 4)),
                                         _mm256_set1_epi8(3));
    return _mm256_or_si256(_mm256_and_si256(shifted, _mm256_set1_epi8(4)), two);
  }
}

// R rows of x's int8 codes (codes_x[r], from k = at) times one block's planes, columns
// [8 h, 8 h + 8) -> the exact int32 dots [R] of 8 columns.
template <int Bits, int R>
inline void copy_block_dots_avx2(const uint8_t* block, int h, const int8_t* const* codes_x,
                                 int64_t at, __m256i (&dots)[R]) {
  constexpr int kPlanes = kCopyBlockK / 4;
  constexpr int kWiden = Bits == 4 ? 8 : 16;  // planes summed in int16 (header)
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
  __m256i pairs[R];
  static_for<kPlanes>([&](auto p) {
    if constexpr (p % kWiden == 0)
      for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
    const __m256i codes = copy_plane_avx2<Bits, p>(block, h);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, codes_x[r] + at + 4 * p, 4);
      pairs[r] = _mm256_add_epi16(pairs[r],
                                  _mm256_maddubs_epi16(codes, _mm256_set1_epi32(four)));
    }
    if constexpr (p % kWiden == kWiden - 1)
      for (int r = 0; r < R; ++r)
        dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs[r], ones));
  });
}

// R rows (from row0) times one strip of a copy -> out [R][16] float32: per block of 64,
// d dx sum u q + m dx sum q, as quant_estimate.cpp's estimate_copy_strip computes it.
// scales_x / offsets_x: [rows][k / 64] (Int8Rows).
template <int Bits, int R>
void estimate_copy_strip_avx2(const uint8_t* strip, int64_t k, const int8_t* codes,
                              const float* scales_x, const float* offsets_x, int64_t row0,
                              float* out) {
  constexpr CopyLayout layout = copy_layout(Bits);
  const int64_t blocks = k / kCopyBlockK;
  const int8_t* codes_x[R];
  for (int r = 0; r < R; ++r) codes_x[r] = codes + (row0 + r) * k;
  // The sums live in out (L1) between blocks: in registers beside the int16 and int32 sums
  // of 4 rows they would spill in the planes' loop.
  for (int i = 0; i < R * kCols; ++i) out[i] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = strip + b * layout.block_bytes;
    prefetch_ahead<layout.block_bytes>(block + prefetch_bytes(R));
    for (int h = 0; h < 2; ++h) {
      __m256i dots[R];
      copy_block_dots_avx2<Bits, R>(block, h, codes_x, b * kCopyBlockK, dots);
      const __m256 scale = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + layout.scale_at + 16 * h)));
      const __m256 minimum = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + layout.min_at + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * blocks + b;
        float* total = out + r * kCols + 8 * h;
        const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(dots[r]),
                                         _mm256_set1_ps(scales_x[at]));
        __m256 sum = _mm256_fmadd_ps(dot, scale, _mm256_loadu_ps(total));
        sum = _mm256_fmadd_ps(minimum, _mm256_set1_ps(offsets_x[at]), sum);
        _mm256_storeu_ps(total, sum);
      }
    }
  }
}

}  // namespace shoal_quant
