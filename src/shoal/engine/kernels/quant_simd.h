// AVX512-BF16 building blocks of the packed-weight matmul (quant_matmul.cpp): a tile's
// codes as bf16 vectors (lane c: two of column c's weights, see quant_formats.h), and each
// sub-block's scale S and offset O' for the 16 columns of a strip.
//
// Codes of 2-6 bits become bf16 128 + u with one OR (0x4300 | u); Q8_0's int8 becomes bf16
// q; IQ4's and MXFP4's nibble indexes its table. O' = O - 128 * S takes the 128 back out
// through the sums of x, so S, O' and the values are exact and only the float32 sums round.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "quant_formats.h"
#include "quant_prefetch.h"

namespace shoal_quant {

using bf16 = at::BFloat16;

template <QType T>
struct Traits {
  static constexpr Format f = kFormats[static_cast<int>(T)];
  static constexpr bool kFloat = is_float(f.planes);
  static constexpr int kVectors = f.planes == Planes::kF16 ? 2 : f.planes == Planes::kF32 ? 3 : 1;
  // The decoded value is u + kBase (or the table's entry).
  static constexpr int kBase = f.planes == Planes::kInt8 ? -128 : (f.lut || kFloat) ? 0 : 128;
  static constexpr int kC = f.lut ? 0 : f.c - kBase;
  static constexpr bool kOffset = !kFloat && (kC != 0 || f.has_e);
  static constexpr int kSubPairs = f.sub_k / 2;
  static constexpr int kTileBytes = plane_bytes(f.planes);
  static constexpr int kMetaBytes = meta_bytes(f);
  static constexpr int kSubs = f.super_k / f.sub_k;
  static constexpr int kE = 2 * kCols;
  static constexpr int kSc = kE + (f.has_e ? 2 * kCols : 0);
  static constexpr int kMc = f.mc_in_sc ? kSc : kSc + (f.has_sc ? kSubs * kCols : 0);
};

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
inline __m512i load(const uint8_t* p) { return _mm512_loadu_si512(p); }

// x[k], x[k + 1] in every lane.
inline __m512bh pair_of(const bf16* x) {
  int32_t bits;
  std::memcpy(&bits, x, 4);
  return as_bh(_mm512_set1_epi32(bits));
}

// A bf16 pair read as one 32-bit word (x's buffers are bf16).
typedef int32_t __attribute__((may_alias)) pair_bits;

// _mm512_dpbf16_ps(chain, w, pair_of(x)) for a pair that serves `Uses` products of a pass.
// The compiler emits a vpbroadcastd for pair_of; where a pair serves one product, that extra
// instruction per product limits the rate, so the pair is read by the instruction's own
// broadcast operand ({1to16}) instead: the same instruction on the same values, so the
// same bits. Passes of 8 generated rows ran ~12% faster this way on an AVX512-BF16 core;
// where a pair serves several products (strips side by side), one broadcast shared by them
// is cheaper than a load each.
template <int Uses>
inline __m512 dot_pair(__m512 chain, __m512i w, const bf16* x) {
  if constexpr (Uses > 1) {
    return _mm512_dpbf16_ps(chain, as_bh(w), pair_of(x));
  } else {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0"
            : "+v"(chain)
            : "v"(w), "m"(*reinterpret_cast<const pair_bits*>(x)));
    return chain;
  }
}

template <int S>
inline __m512i shift16(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
  else return v;
}

// (a & mask) | b per 32-bit lane (one vpternlogd).
inline __m512i and_or(__m512i a, __m512i mask, __m512i b) {
  return _mm512_ternarylogic_epi32(a, mask, b, 0xEA);
}

struct Constants {
  __m512i low4, bf16_128, bit4, bits45, low2, bit2, iq4_table, mxfp4_table;
};

// A lut type's 16 values as bf16 (exact: small integers) in the low words of a register.
inline __m512i bf16_table(const int8_t* values) {
  alignas(64) int16_t table[32] = {};
  for (int i = 0; i < 16; ++i) table[i] = static_cast<int16_t>(bf16(values[i]).x);
  return _mm512_load_si512(table);
}

inline Constants constants() {
  return {_mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), _mm512_set1_epi16(0x0010),
          _mm512_set1_epi16(0x0030), _mm512_set1_epi16(0x0003), _mm512_set1_epi16(0x0004),
          bf16_table(kIQ4Values), bf16_table(kMXFP4Values)};
}

inline __m512 bf16_half(__m512i v, int upper) {
  const __m256i half = upper ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline __m512i to_bf16(__m512 upper, __m512 lower) {
  return (__m512i)_mm512_cvtne2ps_pbh(upper, lower);
}

// Vector P of a tile as bf16 (kVectors of them: float types split exactly into bf16
// parts that sum to the weight).
template <QType T, int P>
inline void decode_vector(const uint8_t* tile, const Constants& c,
                          __m512i (&v)[Traits<T>::kVectors]) {
  constexpr Format f = Traits<T>::f;
  if constexpr (f.planes == Planes::kNibbles || f.planes == Planes::kNibblesBits ||
                f.planes == Planes::kNibblesCrumbs) {
    const __m512i nibbles = shift16<-4 * (P % 4)>(load(tile + 64 * (P / 4)));
    __m512i value;
    if constexpr (f.lut) {
      const __m512i table = T == QType::kMXFP4 ? c.mxfp4_table : c.iq4_table;
      value = _mm512_permutexvar_epi16(_mm512_and_si512(nibbles, c.low4), table);
    } else {
      value = and_or(nibbles, c.low4, c.bf16_128);
    }
    if constexpr (f.planes == Planes::kNibblesBits)
      value = and_or(shift16<4 - P>(load(tile + 256)), c.bit4, value);
    if constexpr (f.planes == Planes::kNibblesCrumbs)
      value = and_or(shift16<4 - 2 * (P % 8)>(load(tile + 256 + 64 * (P / 8))), c.bits45, value);
    v[0] = value;
  } else if constexpr (f.planes == Planes::kCrumbs || f.planes == Planes::kCrumbsBits) {
    __m512i value = and_or(shift16<-2 * (P % 8)>(load(tile + 64 * (P / 8))), c.low2, c.bf16_128);
    if constexpr (f.planes == Planes::kCrumbsBits)
      value = and_or(shift16<2 - P>(load(tile + 128)), c.bit2, value);
    v[0] = value;
  } else if constexpr (f.planes == Planes::kInt8) {
    const uint8_t* bytes = tile + 32 * P;
    const __m512i low =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m512i high =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
    v[0] = to_bf16(_mm512_cvtepi32_ps(high), _mm512_cvtepi32_ps(low));
  } else if constexpr (f.planes == Planes::kBF16) {
    v[0] = load(tile + 64 * P);
  } else {
    __m512 lower, upper;  // words 0..15 and 16..31 as float32
    if constexpr (f.planes == Planes::kF16) {
      lower = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * P)));
      upper = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * P + 32)));
    } else {
      lower = _mm512_loadu_ps(tile + 128 * P);
      upper = _mm512_loadu_ps(tile + 128 * P + 64);
    }
    static_for<Traits<T>::kVectors>([&](auto i) {
      v[i] = to_bf16(upper, lower);
      upper = _mm512_sub_ps(upper, bf16_half(v[i], 1));
      lower = _mm512_sub_ps(lower, bf16_half(v[i], 0));
    });
  }
}

// S and -e * mc of sub-block s (within its super-block) for the 16 columns: w = S * (u + c)
// + minus_min, exactly as gguf dequantizes.
template <QType T>
inline void sub_scale_min(const uint8_t* meta, int s, __m512& scale, __m512& minus_min) {
  using Tr = Traits<T>;
  constexpr Format f = Tr::f;
  const __m256i d_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta));
  __m512 d;
  if constexpr (f.bf16_d) {  // MXFP4: bf16 bits, widened exactly
    d = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(d_bits), 16));
  } else {
    d = _mm512_cvtph_ps(d_bits);
  }
  __m128i codes = _mm_setzero_si128();
  scale = d;
  if constexpr (f.has_sc) {
    codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + Tr::kSc + s * kCols));
    __m512i sc;
    if constexpr (f.mc_in_sc) {
      sc = _mm512_and_si512(_mm512_cvtepu8_epi32(codes), _mm512_set1_epi32(0xF));
    } else {
      sc = _mm512_cvtepi8_epi32(codes);
    }
    scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
  }
  minus_min = _mm512_setzero_ps();
  if constexpr (f.has_e) {
    const __m512 e =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + Tr::kE)));
    __m512 mc = _mm512_set1_ps(1.f);
    if constexpr (f.mc_in_sc) {
      mc = _mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(codes), 4));
    } else if constexpr (f.has_mc) {
      mc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + Tr::kMc + s * kCols))));
    }
    minus_min = _mm512_sub_ps(minus_min, _mm512_mul_ps(e, mc));
  }
}

// S and O' = (c - base) * S - e * mc of sub-block s: the vector path's scale and the
// offset it adds through the sums of x (decoded values are u + base).
template <QType T>
inline void sub_scales(const uint8_t* meta, int s, __m512& scale, __m512& offset) {
  __m512 minus_min;
  sub_scale_min<T>(meta, s, scale, minus_min);
  if constexpr (Traits<T>::kOffset)
    offset = _mm512_fmadd_ps(scale, _mm512_set1_ps(static_cast<float>(Traits<T>::kC)), minus_min);
}

// acc += the sub-block's part (scaled) and its offset term.
template <QType T, int R>
inline void add_sub(__m512 (&acc)[R], const __m512 (&part)[R], __m512 scale, __m512 offset,
                    const float* sums, int64_t sum_stride) {
  for (int r = 0; r < R; ++r) {
    if constexpr (Traits<T>::kFloat) {
      acc[r] = _mm512_add_ps(acc[r], part[r]);
    } else {
      acc[r] = _mm512_fmadd_ps(part[r], scale, acc[r]);
      if constexpr (Traits<T>::kOffset)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * sum_stride]), offset, acc[r]);
    }
  }
}

// The pair layout AMX's B tiles want (lane c: column c's k, k + 1) from the chain layout:
// vectors 2q (k = 4q high, 4q + 2 low) and 2q + 1 (k = 4q + 1 high, 4q + 3 low) become
// pairs 2q (4q low, 4q + 1 high) and 2q + 1 (4q + 2 low, 4q + 3 high).
inline void to_pairs(__m512i even, __m512i odd, __m512i& first, __m512i& second) {
  constexpr __mmask32 kHighWords = 0xAAAAAAAA;
  first = _mm512_mask_blend_epi16(kHighWords, _mm512_srli_epi32(even, 16), odd);
  second = _mm512_mask_blend_epi16(kHighWords, even, _mm512_slli_epi32(odd, 16));
}

// Quantized types whose codes prompt rows take centred (u + c, not 128 + u: small
// integers, exact in bf16) with the min alone as the offset (kCentred below): the sums
// then carry no 128 * S term to cancel again through the sums of x.
template <QType T>
constexpr bool kPromptCentred = Traits<T>::kC != 0 && !Traits<T>::f.lut && !Traits<T>::kFloat;

// A whole strip decoded: k / 2 * kVectors vectors (chain layout, or with kPairLayout AMX's
// pair layout), and S and O' per sub-block [16]. kCentred: values u + c and, for O', the
// min term alone (-e * mc; zero for types without a min).
template <QType T, bool kPairLayout, bool kCentred = false>
void decode_strip(const uint8_t* strip, int64_t k, __m512i* vectors, float* scales,
                  float* offsets) {
  static_assert(!kCentred || (kPromptCentred<T> && !kPairLayout), "centred: chain layout");
  const __m512 centre = _mm512_set1_ps(static_cast<float>(Traits<T>::kC));
  using Tr = Traits<T>;
  constexpr int V = Tr::kVectors;
  constexpr int tiles_per_block = Tr::f.super_k / kTileK;
  constexpr int subs_per_tile = kTileK / Tr::f.sub_k;
  const Constants c = constants();
  const int64_t tiles = k / kTileK;
  const uint8_t* meta_base = strip + tiles * Tr::kTileBytes;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = strip + t * Tr::kTileBytes;
    __m512i* out = vectors + t * kPairs * V;
    static_for<kPairs / 2>([&](auto q) {
      __m512i even[V], odd[V];
      decode_vector<T, 2 * q>(tile, c, even);
      decode_vector<T, 2 * q + 1>(tile, c, odd);
      for (int i = 0; i < V; ++i) {
        __m512i first = even[i], second = odd[i];
        if constexpr (kPairLayout) to_pairs(even[i], odd[i], first, second);
        if constexpr (kCentred) {  // 128 + u -> u + c, through float32 (exact)
          first = to_bf16(_mm512_add_ps(bf16_half(first, 1), centre),
                          _mm512_add_ps(bf16_half(first, 0), centre));
          second = to_bf16(_mm512_add_ps(bf16_half(second, 1), centre),
                           _mm512_add_ps(bf16_half(second, 0), centre));
        }
        _mm512_store_si512(out + (2 * q) * V + i, first);
        _mm512_store_si512(out + (2 * q + 1) * V + i, second);
      }
    });
    if constexpr (!Tr::kFloat) {
      const uint8_t* meta = meta_base + t / tiles_per_block * Tr::kMetaBytes;
      for (int sub = 0; sub < subs_per_tile; ++sub) {
        __m512 scale, offset = _mm512_setzero_ps();
        const int in_block = static_cast<int>(t % tiles_per_block) * subs_per_tile + sub;
        if constexpr (kCentred) {
          sub_scale_min<T>(meta, in_block, scale, offset);
        } else {
          sub_scales<T>(meta, in_block, scale, offset);
        }
        const int64_t g = t * subs_per_tile + sub;
        _mm512_storeu_ps(scales + g * kCols, scale);
        _mm512_storeu_ps(offsets + g * kCols, offset);
      }
    }
  }
}

}  // namespace shoal_quant
