// The packed-weight matmul on AVX2 with FMA and F16C, for x86 CPUs without AVX512-BF16
// (AMD Zen 2 and 3, most Intel laptops and desktops), on the strip layout of
// quant_formats.h: a GGUF file's weights stay as packed there as on AVX-512.
//
// Rows of the plane types (every GGUF quantisation but IQ4): each tile vector's codes (two
// k per column, quant_formats.h) come out of their planes as int16 pairs, one shift and one
// AND per plane, and vpmaddwd multiplies them with x's matching pair: 16 products an
// instruction, summed exactly in int32 per sub-block. For that, x is rounded per tile of 32
// to int16 with a power-of-two scale (X16): a value within 2^7 of the tile's largest stays
// exact, a smaller one moves by at most 2^-15 of the largest (a bf16 rounding of the largest
// moves it by up to 2^-9). A type without a min (Q4_0, Q5_0, Q3_K, Q6_K: w = S (u + c)) has
// c added to its codes as they come out, so its products are exact whole weights. Per
// sub-block: acc = fma(float(sum), S * scale, acc), and for a type with a min (w = S u - e mc)
// then acc = fma(sum(x), -e mc, acc). On these CPUs float32 conversions and FMAs cost
// as much as the reading: the float32 form of this loop (one AND, one conversion and one FMA
// per 8 weights) ran at two thirds of this one's speed, and Q6_K's at a quarter.
//
// A few rows (batch-1 decode) decode the codes in registers as the strip streams in. More
// rows (prompts, batches) unpack a group of strips' codes a chunk of k at a time and run
// passes of 6 rows over them from cache: a vpmaddwd with its vpaddd issues ~1.5 times a
// cycle here, 24 products against the 16 of two float32 FMAs. Both take the same steps per
// (row, sub-block).
//
// Float and IQ4 types: a strip's weights dequantized to float32 exactly as gguf does, a
// chunk of k at a time, then rows sum x[k] w[k] in k order, one chain per row and column
// (avx2_rows): exact up to float32 summation.
//
// Either way a row's result is the same operations whatever rows share its call.

#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "quant_formats.h"
#include "quant_prefetch.h"
#include "quant_strip.h"

namespace shoal_quant {

// One type's planes as the AVX2 kernels read them.
template <QType T>
struct Avx2 {
  static constexpr Format f = kFormats[static_cast<int>(T)];
  // Float and table (IQ4, MXFP4) types take the dequantizing path for every row.
  static constexpr bool kBuffered = is_float(f.planes) || f.lut;
  static constexpr int kTileBytes = plane_bytes(f.planes);
  static constexpr int kMetaBytes = meta_bytes(f);
  static constexpr int kMainWidth = f.planes == Planes::kInt8 ? 8
                                    : (f.planes == Planes::kCrumbs ||
                                       f.planes == Planes::kCrumbsBits) ? 2 : 4;
  static constexpr bool kHigh = f.planes == Planes::kNibblesBits ||
                                f.planes == Planes::kNibblesCrumbs ||
                                f.planes == Planes::kCrumbsBits;
  static constexpr int kHighWidth = f.planes == Planes::kNibblesCrumbs ? 2 : 1;
  static constexpr int kHighOffset = kMainWidth == 4 ? 256 : 128;
  // Added to the codes as they come out (int8 codes are read signed, q = u - 128, already):
  // c is not 0 only for types without a min, whose weights are then S times the code.
  static constexpr int kCodeOffset = f.planes == Planes::kInt8 ? 0 : f.c;
  static constexpr int kSubs = kTileK / f.sub_k;  // sub-blocks per tile
  // An unpacked tile (avx2_unpack): its code vectors [kPairs][2 halves], then per sub-block
  // and half the scale S and, for a type with a min, -e mc (8 floats each).
  static constexpr int kMetaVectors = f.has_e ? 2 : 1;
  static constexpr int kUnpackedTile = kPairs * 2 + kSubs * 2 * kMetaVectors;
  // Meta offsets (quant_strip.h, meta_pos): d [16] fp16, e [16] fp16, sc and mc [subs][16].
  static constexpr int kE = 2 * kCols;
  static constexpr int kSc = 2 * kCols + (f.has_e ? 2 * kCols : 0);
  static constexpr int kMc = kSc + (f.has_sc ? f.super_k / f.sub_k * kCols : 0);

  // The metadata of tile t's super-block: it follows all `tiles` tiles of the strip.
  static const uint8_t* meta_of(const uint8_t* strip, int64_t tiles, int64_t t) {
    return strip + tiles * kTileBytes + t / (f.super_k / kTileK) * kMetaBytes;
  }
};

// Vector v of a tile (quant_formats.h) holds, per column, the codes of k = kb(v) + 2 and
// kb(v): in every plane's 16-bit words, the first word (or byte) the former.
constexpr int pair_k(int v) { return 4 * (v / 2) + v % 2; }

// Field `field` of width W of each 16-bit word, moved to bit `to` (others cleared).
template <int W, int Field, int To>
inline __m256i word_field(__m256i words) {
  constexpr int from = W * Field;
  constexpr uint16_t mask = ((1 << W) - 1) << To;
  __m256i moved = words;
  if constexpr (from > To) moved = _mm256_srli_epi16(words, from - To);
  if constexpr (from < To) moved = _mm256_slli_epi16(words, To - from);
  if constexpr (To == 0 && from + W == 16) return moved;  // the shift cleared the rest
  return _mm256_and_si256(moved, _mm256_set1_epi16(static_cast<short>(mask)));
}

// Vector V's codes u + c of 8 columns (half h of the strip's 16) as int16 pairs, one column
// per 32-bit lane: (at kb(V) + 2, at kb(V)). Q8_0's are its signed q.
template <QType T, int V>
inline __m256i codes16(const uint8_t* tile, int h) {
  using A = Avx2<T>;
  constexpr int W = A::kMainWidth;
  if constexpr (W == 8) {
    return _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 32 * V + 16 * h)));
  } else {
    constexpr int per_word = 16 / W;
    const __m256i words = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(tile + 64 * (V / per_word) + 32 * h));
    __m256i codes = word_field<W, V % per_word, 0>(words);
    if constexpr (A::kHigh) {
      constexpr int HW = A::kHighWidth, high_per_word = 16 / HW;
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          tile + A::kHighOffset + 64 * (V / high_per_word) + 32 * h));
      codes = _mm256_or_si256(codes, word_field<HW, V % high_per_word, W>(high));
    }
    if constexpr (A::kCodeOffset != 0)
      codes = _mm256_add_epi16(codes, _mm256_set1_epi16(static_cast<short>(A::kCodeOffset)));
    return codes;
  }
}

// S and -e mc of sub-block s (within its super-block) for columns [8 h, 8 h + 8): w = S (u +
// c) - e mc, c in the codes (codes16).
template <QType T>
inline void avx2_scales_half(const uint8_t* meta, int s, int h, __m256& scale,
                             __m256& minus_min) {
  using A = Avx2<T>;
  constexpr Format f = A::f;
  const __m256 d = _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * h)));
  __m128i codes = _mm_setzero_si128();
  scale = d;
  if constexpr (f.has_sc) {
    codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + A::kSc + s * kCols + 8 * h));
    __m256i sc;
    if constexpr (f.mc_in_sc) {
      sc = _mm256_and_si256(_mm256_cvtepu8_epi32(codes), _mm256_set1_epi32(0xF));
    } else {
      sc = _mm256_cvtepi8_epi32(codes);
    }
    scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
  }
  minus_min = _mm256_setzero_ps();
  if constexpr (f.has_e) {
    const __m256 e = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + A::kE + 16 * h)));
    __m256 mc = _mm256_set1_ps(1.f);
    if constexpr (f.mc_in_sc) {
      mc = _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(codes), 4));
    } else if constexpr (f.has_mc) {
      mc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(meta + A::kMc + s * kCols + 8 * h))));
    }
    minus_min = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(e, mc));
  }
}

// x of the int16 path (plane types' rows): per row and tile, 16 int32 words each holding the
// pair (q at kb(v) + 2, q at kb(v)) of vector v, and the tile's scale 2^(e - 14), e the
// largest exponent among its 32 values, so that x = scale * q with |q| < 2^15 (avx2_x16).
struct X16 {
  const int32_t* pairs;  // [rows][k / 2]
  const float* scales;   // [rows][k / 32]
  int64_t pair_stride, scale_stride;
};

// Sub-block g of one half (8 columns) of a row after its int32 sum of (u + c) q: acc =
// fma(float(sum), S * scale, acc), then for a type with a min acc = fma(x_sum, -e mc, acc),
// x_sum being x summed over the sub-block (the other types' codes carry their offset, so
// their callers need not compute x's sums at all). Every path of a plane type's rows ends a
// sub-block so, which makes a row's result the same whether its codes came from the packed
// tile or an unpacked strip, and whatever rows share its pass.
template <QType T>
inline __m256 avx2_fold(__m256i sum, __m256 scale, __m256 minus_min, float tile_scale,
                        float x_sum, __m256 acc) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(tile_scale)),
                        acc);
  if constexpr (Avx2<T>::f.has_e) acc = _mm256_fmadd_ps(_mm256_set1_ps(x_sum), minus_min, acc);
  return acc;
}

// Generated rows: R rows of x (X16, from row 0) times one strip of a plane type, tiles
// decoded in registers as int16 codes -> out [R][16]. Per sub-block each (row, half) sums
// (u + c) q exactly in int32 (vpmaddwd: at most 32 products of |u + c| <= 128 and |q| <
// 2^15), then folds the sum into its accumulators (avx2_fold).
template <QType T, int R>
void avx2_generated(const uint8_t* strip, int64_t k, const X16& x, const float* sums,
                    int64_t sum_stride, float* out) {
  using A = Avx2<T>;
  static_assert(!A::kBuffered, "float and IQ4 types run on dequantized strips");
  constexpr Format f = A::f;
  constexpr int tiles_per_block = f.super_k / kTileK;
  constexpr int vectors_per_sub = kPairs / A::kSubs;
  const int64_t tiles = k / kTileK;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = strip + t * A::kTileBytes;
    const uint8_t* meta = A::meta_of(strip, tiles, t);
    prefetch_ahead<A::kTileBytes>(tile + prefetch_bytes(R));
    static_for<A::kSubs>([&](auto sub) {
      const int s = static_cast<int>(t % tiles_per_block) * A::kSubs + sub;
      const int64_t g = t * A::kSubs + sub;  // sub-block index along k
      // One half of the columns at a time: R int32 sums, a code vector and x's pair in
      // registers beside the accumulators (both halves at once spilled from 4 rows on).
      static_for<2>([&](auto h) {
        __m256i sum16[R];
        for (int r = 0; r < R; ++r) sum16[r] = _mm256_setzero_si256();
        static_for<vectors_per_sub>([&](auto j) {
          constexpr int V = sub * vectors_per_sub + j;
          const __m256i codes = codes16<T, V>(tile, h);
          for (int r = 0; r < R; ++r) {
            const __m256i q = _mm256_set1_epi32(x.pairs[r * x.pair_stride + t * kPairs + V]);
            sum16[r] = _mm256_add_epi32(sum16[r], _mm256_madd_epi16(codes, q));
            // Kept in its register as it goes: left free, GCC reassociates the integer sums
            // into a tree of products held on the stack (hundreds of spills a strip).
            asm("" : "+x"(sum16[r]));
          }
        });
        __m256 scale, minus_min;
        avx2_scales_half<T>(meta, s, h, scale, minus_min);
        for (int r = 0; r < R; ++r)
          acc[r][h] = avx2_fold<T>(sum16[r], scale, minus_min, x.scales[r * x.scale_stride + t],
                                   A::f.has_e ? sums[r * sum_stride + g] : 0.f,  // see fold
                                   acc[r][h]);
      });
    });
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kCols + 8 * h, acc[r][h]);
}

// Tiles [t0, t1) of a k-long strip as int16 codes (codes16) and their sub-blocks' scales
// (avx2_scales_half), written once for many rows to read: out [t1 - t0][kUnpackedTile].
template <QType T>
void avx2_unpack(const uint8_t* strip, int64_t k, int64_t t0, int64_t t1, __m256i* out) {
  using A = Avx2<T>;
  constexpr int tiles_per_block = A::f.super_k / kTileK;
  const int64_t tiles = k / kTileK;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = strip + t * A::kTileBytes;
    const uint8_t* meta = A::meta_of(strip, tiles, t);
    __m256i* to = out + (t - t0) * A::kUnpackedTile;
    static_for<kPairs>([&](auto v) {
      for (int h = 0; h < 2; ++h) _mm256_store_si256(to + 2 * v + h, codes16<T, v>(tile, h));
    });
    __m256* scales = reinterpret_cast<__m256*>(to + kPairs * 2);
    for (int sub = 0; sub < A::kSubs; ++sub) {
      const int s = static_cast<int>(t % tiles_per_block) * A::kSubs + sub;
      for (int h = 0; h < 2; ++h) {
        __m256 scale, minus_min;
        avx2_scales_half<T>(meta, s, h, scale, minus_min);
        __m256* at = scales + (sub * 2 + h) * A::kMetaVectors;
        _mm256_store_ps(reinterpret_cast<float*>(at), scale);
        if constexpr (A::f.has_e) _mm256_store_ps(reinterpret_cast<float*>(at + 1), minus_min);
      }
    }
  }
}

// Many rows: R rows of x times tiles [t0, t1) of one strip, which avx2_unpack wrote
// (codes), added to out [R][16]. Both halves at once, so that one broadcast of x's pair
// serves two products: 2 R int32 sums, two code vectors and the pair in registers. Each
// (row, half) takes avx2_generated's steps in the same order, chunk after chunk, so its
// result is the same.
template <QType T, int R>
void avx2_unpacked(const __m256i* codes, int64_t t0, int64_t t1, const X16& x,
                   const float* sums, int64_t sum_stride, float* out) {
  using A = Avx2<T>;
  static_assert(!A::kBuffered, "float and IQ4 types run on dequantized strips");
  constexpr int vectors_per_sub = kPairs / A::kSubs;
  for (int64_t t = t0; t < t1; ++t) {
    const __m256i* tile = codes + (t - t0) * A::kUnpackedTile;
    const float* scales = reinterpret_cast<const float*>(tile + kPairs * 2);
    static_for<A::kSubs>([&](auto sub) {
      const int64_t g = t * A::kSubs + sub;
      __m256i sum16[R][2];
      for (int r = 0; r < R; ++r) sum16[r][0] = sum16[r][1] = _mm256_setzero_si256();
      static_for<vectors_per_sub>([&](auto j) {
        constexpr int V = sub * vectors_per_sub + j;
        const __m256i u0 = _mm256_load_si256(tile + 2 * V);
        const __m256i u1 = _mm256_load_si256(tile + 2 * V + 1);
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_set1_epi32(x.pairs[r * x.pair_stride + t * kPairs + V]);
          sum16[r][0] = _mm256_add_epi32(sum16[r][0], _mm256_madd_epi16(u0, q));
          sum16[r][1] = _mm256_add_epi32(sum16[r][1], _mm256_madd_epi16(u1, q));
          asm("" : "+x"(sum16[r][0]), "+x"(sum16[r][1]));  // as in avx2_generated
        }
      });
      for (int h = 0; h < 2; ++h) {
        const float* meta = scales + (sub * 2 + h) * A::kMetaVectors * 8;
        const __m256 scale = _mm256_load_ps(meta);
        const __m256 minus_min = A::f.has_e ? _mm256_load_ps(meta + 8) : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r) {
          float* at = out + r * kCols + 8 * h;
          _mm256_storeu_ps(at, avx2_fold<T>(sum16[r][h], scale, minus_min,
                                            x.scales[r * x.scale_stride + t],
                                            A::f.has_e ? sums[r * sum_stride + g] : 0.f,
                                            _mm256_loadu_ps(at)));
        }
      }
    });
  }
}

// Weights of tiles [t0, t1) of a float or IQ4 strip as float32 [(t1 - t0) * 32][16], k
// order, exactly gguf's values.
template <QType T>
void avx2_dequantize(const uint8_t* strip, int64_t k, int64_t t0, int64_t t1, float* w) {
  static_assert(Avx2<T>::kBuffered, "plane types run on int16 codes");
  const StripView view{Avx2<T>::f, k, strip};
  float column[kTileK];
  for (int64_t t = t0; t < t1; ++t)
    for (int c = 0; c < kCols; ++c) {
      tile_column(view, t, c, column);
      for (int k_in = 0; k_in < kTileK; ++k_in)
        w[((t - t0) * kTileK + k_in) * kCols + c] = column[k_in];
    }
}

// Rows [0, R) of x (float32, stride ldx, from k0) times a strip's dequantized weights w
// [kc][16] (kc a multiple of 32): acc [R][16] += sum over the chunk of x[k] w[k], k in
// order. A tile's 32 k run unrolled with the sums in registers (a loop of run-time length
// kept them on the stack, a store per multiply-add).
template <int R>
inline void avx2_rows(const float* x, int64_t ldx, const float* w, int64_t kc, float* acc) {
  for (int64_t i0 = 0; i0 < kc; i0 += kTileK) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm256_loadu_ps(acc + r * kCols);
      a[r][1] = _mm256_loadu_ps(acc + r * kCols + 8);
    }
    static_for<kTileK>([&](auto i) {
      const float* wi = w + (i0 + i) * kCols;
      const __m256 w0 = _mm256_loadu_ps(wi), w1 = _mm256_loadu_ps(wi + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i0 + i);
        a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
      }
    });
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * kCols, a[r][0]);
      _mm256_storeu_ps(acc + r * kCols + 8, a[r][1]);
    }
  }
}

}  // namespace shoal_quant
