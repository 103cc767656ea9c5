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
#include "quant_head_split.h"
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

// R rows of x's int8 codes (codes_x[r], from k = at) times one block's Planes planes (4 k
// each), columns [8 h, 8 h + 8) -> the exact int32 dots [R] of 8 columns.
template <int Bits, int R, int Planes = kCopyBlockK / 4>
inline void copy_block_dots_avx2(const uint8_t* block, int h, const int8_t* const* codes_x,
                                 int64_t at, __m256i (&dots)[R]) {
  constexpr int kWiden = Bits == 4 ? 8 : 16;  // planes summed in int16 (header)
  static_assert(Planes % kWiden == 0, "whole int16 runs per block");
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
  __m256i pairs[R];
  static_for<Planes>([&](auto p) {
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

// The blocks an estimate strip reads: a copy's (quant_head_copy.h), or a split Q8_0 table's
// high part (quant_head_split.h). Each gives k per block, bytes per block and, per half of
// the columns, the scale and minimum of w = scale u + minimum (quant_estimate.cpp's VNNI
// twins read all 16 columns at once).
template <int Bits>
struct CopyBlocks {
  static constexpr int kBits = Bits, kK = kCopyBlockK;
  static constexpr CopyLayout kLayout = copy_layout(Bits);
  static constexpr int kBytes = kLayout.block_bytes;
  static void scales(const uint8_t* block, int h, __m256& scale, __m256& minimum) {
    scale = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kLayout.scale_at + 16 * h)));
    minimum = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kLayout.min_at + 16 * h)));
  }
};

struct SplitBlocks {
  static constexpr int kBits = 4, kK = kSplitBlockK, kBytes = kSplitHighBytes;
  static void scales(const uint8_t* block, int h, __m256& scale, __m256& minimum) {
    const __m256 d = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kSplitScaleAt + 16 * h)));
    scale = _mm256_mul_ps(d, _mm256_set1_ps(16.f));
    minimum = _mm256_mul_ps(d, _mm256_set1_ps(kSplitMinimum));
  }
};

// R rows (from row0) times one strip of Blocks -> out [R][16] float32: per block, scale dx
// sum u q + minimum dx sum q, as quant_estimate.cpp's estimate_strip computes it.
// scales_x / offsets_x: [rows][k / Blocks::kK] (Int8Rows).
template <class Blocks, int R>
void estimate_strip_avx2(const uint8_t* strip, int64_t k, const int8_t* codes,
                         const float* scales_x, const float* offsets_x, int64_t row0,
                         float* out) {
  const int64_t blocks = k / Blocks::kK;
  const int8_t* codes_x[R];
  for (int r = 0; r < R; ++r) codes_x[r] = codes + (row0 + r) * k;
  // The sums live in out (L1) between blocks: in registers beside the int16 and int32 sums
  // of 4 rows they would spill in the planes' loop.
  for (int i = 0; i < R * kCols; ++i) out[i] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = strip + b * Blocks::kBytes;
    prefetch_ahead<Blocks::kBytes>(block + prefetch_bytes(R));
    for (int h = 0; h < 2; ++h) {
      __m256i dots[R];
      copy_block_dots_avx2<Blocks::kBits, R, Blocks::kK / 4>(block, h, codes_x, b * Blocks::kK,
                                                             dots);
      __m256 scale, minimum;
      Blocks::scales(block, h, scale, minimum);
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
