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

// Rows of x per AMX tile, and row tiles sharing each loaded weight tile.
constexpr int kTileRows = 16;
constexpr int kRowTiles = 2;

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

// Float32 lanes of a strip's 32 bf16 words (pair layout): low half words 0-15, high 16-31.
inline void widen(__m512i v, __m512& low, __m512& high) {
  low = bf16_half(v, 0);
  high = bf16_half(v, 1);
}

// Per-column S (or O) as float32 lanes of the pair layout: lane i of the low half is word
// i, column i / 2; of the high half, column 8 + i / 2.
inline void spread(__m512 per_column, __m512& low, __m512& high) {
  const __m512i low_index = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i high_index =
      _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  low = _mm512_permutexvar_ps(low_index, per_column);
  high = _mm512_permutexvar_ps(high_index, per_column);
}

// w -> (hi, lo) bf16 words: hi = bf16(w), lo = bf16(w - hi).
inline void split(__m512 low, __m512 high, __m512i& hi, __m512i& lo) {
  hi = to_bf16(high, low);
  lo = to_bf16(_mm512_sub_ps(high, bf16_half(hi, 1)), _mm512_sub_ps(low, bf16_half(hi, 0)));
}

// A strip decoded for the tiles: per 32-k tile t, B tiles hi then lo (16 vectors each, in
// AMX's pair layout) at split + t * 2 * kPairs.
template <QType T>
void decode_strip_split(const uint8_t* strip, int64_t k, __m512i* split_tiles) {
  using Tr = Traits<T>;
  constexpr int tiles_per_block = Tr::f.super_k / kTileK;
  constexpr int subs_per_tile = kTileK / Tr::f.sub_k;
  const Constants c = constants();
  const int64_t tiles = k / kTileK;
  const uint8_t* meta_base = strip + tiles * Tr::kTileBytes;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = strip + t * Tr::kTileBytes;
    const uint8_t* meta = meta_base + t / tiles_per_block * Tr::kMetaBytes;
    __m512i* hi_out = split_tiles + t * 2 * kPairs;
    __m512i* lo_out = hi_out + kPairs;
    __m512 scale_low, scale_high, min_low, min_high;  // w = S * (u + c) - e * mc
    static_for<kPairs>([&](auto p) {
      if constexpr (!Tr::kFloat) {
        if (p % Tr::kSubPairs == 0) {
          __m512 scale, minus_min;
          sub_scale_min<T>(meta, static_cast<int>(t % tiles_per_block) * subs_per_tile +
                                     p / Tr::kSubPairs, scale, minus_min);
          spread(scale, scale_low, scale_high);
          spread(minus_min, min_low, min_high);
        }
      }
      __m512i v[Tr::kVectors];
      decode_vector<T, p>(tile, c, v);
      __m512 low, high;
      if constexpr (Tr::kFloat) {
        // The bf16 parts of a float weight sum back to it: add them in float32 first.
        low = _mm512_setzero_ps(), high = _mm512_setzero_ps();
        for (int i = 0; i < Tr::kVectors; ++i) {
          __m512 part_low, part_high;
          widen(v[i], part_low, part_high);
          low = _mm512_add_ps(low, part_low);
          high = _mm512_add_ps(high, part_high);
        }
      } else {
        // The decoded value is u + base (or the table's entry, c = base = 0): u + c is an
        // exact small integer, so the fma rounds once, as gguf's dequantization does.
        widen(v[0], low, high);
        const __m512 shift = _mm512_set1_ps(static_cast<float>(Tr::kC));
        low = _mm512_fmadd_ps(scale_low, _mm512_add_ps(low, shift), min_low);
        high = _mm512_fmadd_ps(scale_high, _mm512_add_ps(high, shift), min_high);
      }
      split(low, high, hi_out[p], lo_out[p]);
      // Chain layout to AMX's pairs, a pair of vectors at a time.
      if constexpr (p % 2 == 1) {
        to_pairs(hi_out[p - 1], hi_out[p], hi_out[p - 1], hi_out[p]);
        to_pairs(lo_out[p - 1], lo_out[p], lo_out[p - 1], lo_out[p]);
      }
    });
  }
}

// C0 += x0 . strip's k-tile t and C1 += x1 . it (x0, x1 in tiles 4, 5), hi part then lo
// part: each C sums in the same order whatever else is computed beside it.
template <int C0, int C1>
inline void split_dots(const __m512i* strip, int64_t t) {
  tile_load<6>(strip + 2 * t * kPairs, 64);
  tile_load<7>(strip + (2 * t + 1) * kPairs, 64);
  tile_dot<C0, 4, 6>();
  tile_dot<C1, 5, 6>();
  tile_dot<C0, 4, 7>();
  tile_dot<C1, 5, 7>();
}

// Two row tiles (kRowTiles x rows) times two decoded strips (nullptr: one strip), C summed
// over all of k: out [2 strips][2 row tiles][rows][16]. Tiles configured for `rows`.
inline void strips_amx_split(const __m512i* strip0, const __m512i* strip1, int64_t k,
                             const bf16* x0, const bf16* x1, int64_t ldx, float* out) {
  const int64_t stride = ldx * static_cast<int64_t>(sizeof(bf16));
  constexpr int64_t kTileFloats = kTileRows * kCols;
  tile_zero<0>();
  tile_zero<1>();
  tile_zero<2>();
  tile_zero<3>();
  for (int64_t t = 0; t < k / kTileK; ++t) {
    tile_load<4>(x0 + t * kTileK, stride);
    tile_load<5>(x1 + t * kTileK, stride);
    split_dots<0, 1>(strip0, t);
    if (strip1 != nullptr) split_dots<2, 3>(strip1, t);
  }
  tile_store<0>(out, 64);
  tile_store<1>(out + kTileFloats, 64);
  if (strip1 != nullptr) {
    tile_store<2>(out + 2 * kTileFloats, 64);
    tile_store<3>(out + 3 * kTileFloats, 64);
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
