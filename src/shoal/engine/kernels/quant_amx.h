// Prompt rows on AMX tiles (Intel AMX-BF16): the packed-weight matmul for prefill.
//
// A strip (16 columns) is decoded once into its exact float32 weights, as gguf dequantizes
// them, each split into two bf16 parts hi + lo (hi = bf16(w), lo = bf16(w - hi); together
// within 2^-18 of w, far below the rounding of the bf16 activations). The parts are laid
// out as AMX B tiles (16 pair rows of 64 bytes per 32 k), so a tile op multiplies 16 rows
// of x by a 32-wide slice of the strip and C sums over all of k in the tile registers: no
// per-sub-block rescaling, ~14x vdpbf16ps's rate here.
//
// Each row's result depends only on its own x, never on the row count: AMX sums a tile
// op's products in fixed chains per row. The vector path (quant_avx512.h) sums in another
// order, so a token always takes the same path: prompt tokens this one, generated tokens
// the vector one (QuantLinear::forward's `prompt`).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_simd.h"

namespace shoal_quant {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SHOAL_QUANT_AMX 1

// Rows of x per AMX tile.
constexpr int kTileRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers: C 0-3 (two row tiles x two strips), A 4-5 (x rows, 32 k), B 6-7 (a
// strip's 16 pair rows). rows: rows of x per tile (1..16).
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = static_cast<uint8_t>(tile >= 6 ? kPairs : rows);
    config.colsb[tile] = 64;
  }
  _tile_loadconfig(&config);
}

// The tile instructions with the register number as a template argument (GCC's intrinsics
// want a literal).
template <int N>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(N));
}

template <int N>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(N) : "memory");
}

template <int N>
inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(N) : "memory");
}

template <int C, int A, int B>
inline void tile_dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// A vector of a strip's tile (chain layout: lane c holds column c's k = 4q + c' in its high
// word and k = 4q + c' + 2 in its low word, for vector 2q + c') as float32, a lane per
// column: `high` the high words, `low` the low words. Float types add their bf16 parts
// (they sum back to the weight exactly).
template <QType T, int P>
inline void chain_lanes(const uint8_t* tile, const Constants& c, __m512& high, __m512& low) {
  const __m512i high_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512i v[Traits<T>::kVectors];
  decode_vector<T, P>(tile, c, v);
  high = _mm512_castsi512_ps(_mm512_and_si512(v[0], high_mask));
  low = _mm512_castsi512_ps(_mm512_slli_epi32(v[0], 16));
  for (int i = 1; i < Traits<T>::kVectors; ++i) {
    high = _mm512_add_ps(high, _mm512_castsi512_ps(_mm512_and_si512(v[i], high_mask)));
    low = _mm512_add_ps(low, _mm512_castsi512_ps(_mm512_slli_epi32(v[i], 16)));
  }
}

// Weights w of two k (a: even k, b: the odd k after it; a lane per column) -> one pair row
// of the hi tile and of the lo tile: hi = bf16(w), lo = bf16(w - hi), column c's two k in
// words 2c, 2c + 1 (AMX's pair layout). cvtne2ps puts a in words 0-15 and b in 16-31; one
// word permute interleaves them.
inline void split_pair(__m512 a, __m512 b, __m512i* hi_out, __m512i* lo_out) {
  alignas(64) static constexpr int16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512i hi = _mm512_permutexvar_epi16(interleave, to_bf16(b, a));
  const __m512 hi_a = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
  const __m512 hi_b = _mm512_castsi512_ps(
      _mm512_and_si512(hi, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __m512i lo = to_bf16(_mm512_sub_ps(b, hi_b), _mm512_sub_ps(a, hi_a));
  _mm512_store_si512(hi_out, hi);
  _mm512_store_si512(lo_out, _mm512_permutexvar_epi16(interleave, lo));
}

// Half `Half` (pair rows 8 Half .. 8 Half + 7) of a strip's k-tile t decoded for the tiles
// into out: its exact float32 weights, as gguf dequantizes them, split into the hi B tile
// (out[0 .. 15]) and the lo B tile (out[16 .. 31]). Half a tile at a time so the decoding
// can be spread thinly between tile ops (QuantLinear::run_amx_prompt).
template <QType T, int Half>
inline void decode_split_half(const uint8_t* strip, int64_t k, int64_t t, __m512i* out) {
  using Tr = Traits<T>;
  constexpr int tiles_per_block = Tr::f.super_k / kTileK;
  constexpr int subs_per_tile = kTileK / Tr::f.sub_k;
  constexpr int kHalfPairs = kPairs / 2;
  static const Constants c = constants();
  const uint8_t* tile = strip + t * Tr::kTileBytes;
  // w = S * (u + c) - e * mc: S and -e * mc a lane per column (one sub-block: sub_k >= 16).
  __m512 scale = _mm512_setzero_ps(), minus_min = _mm512_setzero_ps();
  if constexpr (!Tr::kFloat) {
    const uint8_t* meta =
        strip + k / kTileK * Tr::kTileBytes + t / tiles_per_block * Tr::kMetaBytes;
    sub_scale_min<T>(meta, static_cast<int>(t % tiles_per_block) * subs_per_tile +
                               Half * kHalfPairs / Tr::kSubPairs,
                     scale, minus_min);
  }
  // The decoded value is u + base (or the table's entry, c = base = 0): u + c is an exact
  // small integer, so the fma rounds once, as gguf's dequantization does.
  const __m512 shift = _mm512_set1_ps(static_cast<float>(Tr::kC));
  auto weights = [&](__m512 v) {
    if constexpr (Tr::kFloat) return v;
    else return _mm512_fmadd_ps(scale, _mm512_add_ps(v, shift), minus_min);
  };
  // Pair rows 2q (k = 4q, 4q + 1: the high words of chain vectors 2q, 2q + 1) and 2q + 1
  // (k = 4q + 2, 4q + 3: their low words).
  static_for<kHalfPairs / 2>([&](auto i) {
    constexpr int q = Half * kHalfPairs / 2 + i;
    __m512 even_high, even_low, odd_high, odd_low;
    chain_lanes<T, 2 * q>(tile, c, even_high, even_low);
    chain_lanes<T, 2 * q + 1>(tile, c, odd_high, odd_low);
    split_pair(weights(even_high), weights(odd_high), out + 2 * q, out + kPairs + 2 * q);
    split_pair(weights(even_low), weights(odd_low), out + 2 * q + 1, out + kPairs + 2 * q + 1);
  });
}

// decode_split_half for a run-time half.
template <QType T>
void decode_split(const uint8_t* strip, int64_t k, int64_t t, int half, __m512i* out) {
  if (half == 0) {
    decode_split_half<T, 0>(strip, k, t, out);
  } else {
    decode_split_half<T, 1>(strip, k, t, out);
  }
}

// x rows as A tiles: rows [row0, row0 + 16 * row_tiles) and k [k0, k0 + kc) of x [m, k]
// copied to out as [row tile][k-tile][16 rows][32 k], each A tile one contiguous 1 KiB
// (rows past m are zeros). Loaded with a 64-byte stride, a tile is 16 consecutive cache
// lines, which the prefetchers stream; from x itself its rows lie 2k bytes apart.
inline void tile_rows(const bf16* x, int64_t m, int64_t k, int64_t row0, int64_t row_tiles,
                      int64_t k0, int64_t kc, bf16* out) {
  for (int64_t i = 0; i < row_tiles * kTileRows; ++i) {
    const int64_t row = row0 + i;
    bf16* to = out + (i / kTileRows) * kTileRows * kc + (i % kTileRows) * kTileK;
    for (int64_t t = 0; t < kc / kTileK; ++t, to += kTileRows * kTileK) {
      if (row < m) {
        std::memcpy(to, x + row * k + k0 + t * kTileK, kTileK * sizeof(bf16));
      } else {
        std::memset(to, 0, kTileK * sizeof(bf16));
      }
    }
  }
}

// C0 += x0 . strip's k-tile t and C1 += x1 . it (x0, x1 in tiles 4, 5), hi part then lo
// part: each C sums in the same order whatever else is computed beside it.
template <int RowTiles, int C0, int C1>
inline void split_dots(const __m512i* strip, int64_t t) {
  tile_load<6>(strip + 2 * t * kPairs, 64);
  tile_load<7>(strip + (2 * t + 1) * kPairs, 64);
  tile_dot<C0, 4, 6>();
  if constexpr (RowTiles == 2) tile_dot<C1, 5, 6>();
  tile_dot<C0, 4, 7>();
  if constexpr (RowTiles == 2) tile_dot<C1, 5, 7>();
}

// RowTiles (1 or 2) row tiles of 16 rows times two decoded strips (strip1 nullptr: one
// strip) over `tiles` k-tiles: x0, x1 the row tiles' first A tiles (tile_rows' layout,
// consecutive k-tiles 1 KiB apart), strips as decode_strip_split leaves them. C as
// c [2 strips][2 row tiles][16][16] (C0 strip 0 x0, C1 strip 0 x1, C2 strip 1 x0, C3 strip 1
// x1): loaded from c where `resume` (a chunk of k after the first), else zeroed; stored
// back to c. A float32 C stored and loaded again is the same C, so a row's sum runs
// through the k-tiles in one order however k is cut into chunks.
// between() runs after each k-tile's ops are issued: vector work placed there (decoding the
// next strips) runs while the tile unit multiplies.
template <int RowTiles, class Between>
inline void strips_amx_split(const __m512i* strip0, const __m512i* strip1, int64_t tiles,
                             const bf16* x0, const bf16* x1, float* c, bool resume,
                             Between&& between) {
  constexpr int64_t kTileFloats = kTileRows * kCols, kTileBf16 = kTileRows * kTileK;
  constexpr bool two = RowTiles == 2;
  if (resume) {
    tile_load<0>(c, 64);
    if constexpr (two) tile_load<1>(c + kTileFloats, 64);
    if (strip1 != nullptr) {
      tile_load<2>(c + 2 * kTileFloats, 64);
      if constexpr (two) tile_load<3>(c + 3 * kTileFloats, 64);
    }
  } else {
    tile_zero<0>();
    tile_zero<1>();
    tile_zero<2>();
    tile_zero<3>();
  }
  for (int64_t t = 0; t < tiles; ++t) {
    tile_load<4>(x0 + t * kTileBf16, 64);
    if constexpr (two) tile_load<5>(x1 + t * kTileBf16, 64);
    split_dots<RowTiles, 0, 1>(strip0, t);
    if (strip1 != nullptr) split_dots<RowTiles, 2, 3>(strip1, t);
    between();
  }
  tile_store<0>(c, 64);
  if constexpr (two) tile_store<1>(c + kTileFloats, 64);
  if (strip1 != nullptr) {
    tile_store<2>(c + 2 * kTileFloats, 64);
    if constexpr (two) tile_store<3>(c + 3 * kTileFloats, 64);
  }
}

// Generated tokens (decode) in batches on tiles, in the order strips_tile_order follows on
// vectors: per sub-block of sub_k, C = A . B from a zeroed C (one op per plane of a float
// type, each from its own zeroed C), then acc += C * S and acc += sum(x) * O'. rows (1..16)
// of x times a strip decoded in pair layout (decode_strip<T, true>); tiles configured by
// configure_decode_tiles.
// Four C tiles take consecutive sub-blocks, so one's results are scaled while the next
// ops run.
inline void configure_decode_tiles(int rows, int sub_k) {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    const bool a = tile == 4 || tile == 5, b = tile >= 6;
    config.rows[tile] = static_cast<uint8_t>(b ? sub_k / 2 : rows);
    config.colsb[tile] = static_cast<uint16_t>(a ? 2 * sub_k : 64);
  }
  _tile_loadconfig(&config);
}

// acc[r] += c[r] * S (+ sum_r * O') for rows r, 16 floats each; float types add c.
template <QType T>
inline void accumulate(float* acc, const float* c, int rows, __m512 scale, __m512 offset,
                       const float* sums, int64_t sum_stride) {
  for (int r = 0; r < rows; ++r) {
    __m512 a = _mm512_load_ps(acc + r * kCols);
    const __m512 part = _mm512_load_ps(c + r * kCols);
    if constexpr (Traits<T>::kFloat) {
      a = _mm512_add_ps(a, part);
    } else {
      a = _mm512_fmadd_ps(part, scale, a);
      if constexpr (Traits<T>::kOffset)
        a = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * sum_stride]), offset, a);
    }
    _mm512_store_ps(acc + r * kCols, a);
  }
}

// C[slot] = A . B: x at xs (row stride in bytes), B's pair rows at b (b_stride bytes apart).
template <int Slot>
inline void issue_sub(const bf16* xs, int64_t x_stride, const __m512i* b, int64_t b_stride) {
  tile_zero<Slot>();
  tile_load<4 + Slot % 2>(xs, x_stride);
  tile_load<6 + Slot % 2>(b, b_stride);
  tile_dot<Slot, 4 + Slot % 2, 6 + Slot % 2>();
}

inline void issue_in_slot(int slot, const bf16* xs, int64_t x_stride, const __m512i* b,
                          int64_t b_stride) {
  switch (slot) {
    case 0: issue_sub<0>(xs, x_stride, b, b_stride); break;
    case 1: issue_sub<1>(xs, x_stride, b, b_stride); break;
    case 2: issue_sub<2>(xs, x_stride, b, b_stride); break;
    default: issue_sub<3>(xs, x_stride, b, b_stride); break;
  }
}

inline void store_slot(int slot, float* c) {
  switch (slot) {
    case 0: tile_store<0>(c, 64); break;
    case 1: tile_store<1>(c, 64); break;
    case 2: tile_store<2>(c, 64); break;
    default: tile_store<3>(c, 64); break;
  }
}

template <QType T>
void strip_tiles(const __m512i* decoded, const float* scales, const float* offsets, int64_t k,
                 const bf16* x, int64_t ldx, int rows, const float* sums, int64_t sum_stride,
                 float* out) {
  using Tr = Traits<T>;
  constexpr int V = Tr::kVectors, sub_k = Tr::f.sub_k, sub_pairs = sub_k / 2;
  constexpr int kSlots = 4, kAhead = 3;  // sub-block ops issued ahead of the one scaled
  alignas(64) float c[kSlots][kTileRows * kCols];
  alignas(64) float acc[kTileRows * kCols] = {};
  const int64_t subs = k / sub_k;
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(bf16));
  // Op j of the sub-block stream: sub-block j / V, plane j % V.
  const int64_t ops = subs * V;
  auto issue = [&](int64_t j) {
    const int64_t g = j / V;
    issue_in_slot(static_cast<int>(j % kSlots), x + g * sub_k, x_stride,
                  decoded + (g * sub_pairs) * V + j % V, 64 * V);
  };
  alignas(64) float part[kTileRows * kCols];
  for (int64_t j = 0; j < std::min<int64_t>(kAhead, ops); ++j) issue(j);
  for (int64_t j = 0; j < ops; ++j) {
    if (j + kAhead < ops) issue(j + kAhead);
    const int slot = static_cast<int>(j % kSlots);
    store_slot(slot, c[slot]);
    const int64_t g = j / V;
    if constexpr (V == 1) {
      accumulate<T>(acc, c[slot], rows, _mm512_loadu_ps(scales + g * kCols),
                    _mm512_loadu_ps(offsets + g * kCols), sums + g, sum_stride);
    } else {
      // A float type's planes: their sums add up first, then into acc.
      if (j % V == 0) {
        std::memcpy(part, c[slot], sizeof(float) * kCols * rows);
      } else {
        for (int r = 0; r < rows * kCols; r += kCols)
          _mm512_store_ps(part + r, _mm512_add_ps(_mm512_load_ps(part + r),
                                                  _mm512_load_ps(c[slot] + r)));
      }
      if (j % V == V - 1)
        accumulate<T>(acc, part, rows, _mm512_setzero_ps(), _mm512_setzero_ps(), sums + g,
                      sum_stride);
    }
  }
  std::memcpy(out, acc, sizeof(float) * kCols * rows);
}

#else
#define SHOAL_QUANT_AMX 0
#endif

}  // namespace shoal_quant
