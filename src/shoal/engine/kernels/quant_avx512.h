// The packed-weight matmul on AVX512-BF16 vectors (machines without AMX): lanes are the 16
// columns of a strip, vdpbf16ps sums one pair of k per instruction for one row.
//
// Few rows (decode): each tile is decoded in registers and used at once (strip_direct).
// More rows: a strip is decoded once into a buffer (decode_strip) and rows run over it in
// groups of up to 4 (strip_buffered). Both issue the same float operations in the same order for every
// row, so a row's result does not depend on the row count.

#pragma once

#include "quant_simd.h"

namespace shoal_quant {

// A sub-block's sums for R rows in four chains (pairs p = 0, 1, 2, 3 mod 4), added as
// (c0 + c1) + (c2 + c3): one chain would wait on vdpbf16ps's latency at every pair.
template <int R>
struct Chains {
  __m512 c[4][R];

  Chains() {
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r) c[j][r] = _mm512_setzero_ps();
  }

  // Pair p's weights v times each row's x pair (pair_of_row(r)).
  template <class PairOfRow>
  inline void add(int p, __m512i v, const PairOfRow& pair_of_row) {
    for (int r = 0; r < R; ++r)
      c[p % 4][r] = _mm512_dpbf16_ps(c[p % 4][r], as_bh(v), pair_of_row(r));
  }

  inline void sum(__m512 (&part)[R]) const {
    for (int r = 0; r < R; ++r)
      part[r] = _mm512_add_ps(_mm512_add_ps(c[0][r], c[1][r]), _mm512_add_ps(c[2][r], c[3][r]));
  }
};

// R rows of x (stride ldx) times one strip, tiles decoded in registers -> out [R][16].
template <QType T, int R>
void strip_direct(const uint8_t* strip, int64_t k, const bf16* x, int64_t ldx,
                  const float* sums, int64_t sum_stride, float* out) {
  using Tr = Traits<T>;
  constexpr int tiles_per_block = Tr::f.super_k / kTileK;
  constexpr int subs_per_tile = kTileK / Tr::f.sub_k;
  const Constants c = constants();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t tiles = k / kTileK;
  const uint8_t* meta_base = strip + tiles * Tr::kTileBytes;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = strip + t * Tr::kTileBytes;
    const uint8_t* meta = meta_base + t / tiles_per_block * Tr::kMetaBytes;
    prefetch_ahead<Tr::kTileBytes>(tile + kPrefetchBytes);
    const int64_t k0 = t * kTileK;
    static_for<subs_per_tile>([&](auto sub) {
      Chains<R> chains;
      static_for<Tr::kSubPairs>([&](auto pair) {
        constexpr int p = sub * Tr::kSubPairs + pair;
        __m512i v[Tr::kVectors];
        decode_pair<T, p>(tile, c, v);
        for (int i = 0; i < Tr::kVectors; ++i)
          chains.add(pair, v[i], [&](int r) { return pair_of(x + r * ldx + k0 + 2 * p); });
      });
      __m512 part[R];
      chains.sum(part);
      __m512 scale, offset;
      const int s = static_cast<int>(t % tiles_per_block) * subs_per_tile + sub;
      if constexpr (!Tr::kFloat) sub_scales<T>(meta, s, scale, offset);
      add_sub<T, R>(acc, part, scale, offset, sums + (k0 / Tr::f.sub_k + sub), sum_stride);
    });
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kCols, acc[r]);
}

// R rows over a decoded strip: the same operations as strip_direct, weights from memory.
template <QType T, int R>
void strip_buffered(const __m512i* pairs, const float* scales, const float* offsets, int64_t k,
                    const bf16* x, int64_t ldx, const float* sums, int64_t sum_stride,
                    float* out) {
  using Tr = Traits<T>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t subs = k / Tr::f.sub_k;
  for (int64_t g = 0; g < subs; ++g) {
    Chains<R> chains;
    const __m512i* w = pairs + g * Tr::kSubPairs * Tr::kVectors;
    const bf16* xg = x + g * Tr::f.sub_k;
    static_for<Tr::kSubPairs>([&](auto p) {
      for (int i = 0; i < Tr::kVectors; ++i)
        chains.add(p, _mm512_load_si512(w + p * Tr::kVectors + i),
                   [&](int r) { return pair_of(xg + r * ldx + 2 * p); });
    });
    __m512 part[R];
    chains.sum(part);
    __m512 scale = _mm512_setzero_ps(), offset = _mm512_setzero_ps();
    if constexpr (!Tr::kFloat) {
      scale = _mm512_loadu_ps(scales + g * kCols);
      offset = _mm512_loadu_ps(offsets + g * kCols);
    }
    add_sub<T, R>(acc, part, scale, offset, sums + g, sum_stride);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kCols, acc[r]);
}

// AMX's order on vectors, for machines with AMX: a tile op sums each row's even-k products
// in one chain and its odd-k products in another, then adds the two. Two accumulators per
// row reproduce it bit for bit, with x masked to its even (xe) or odd (xo) bf16 of each
// pair (vdpbf16ps then adds an exact zero for the other), so few rows here and many rows
// on tiles (quant_amx.h, strip_tiles) give identical results. A chain waits on
// vdpbf16ps's latency at every pair, so S strips run side by side.
template <QType T, int R, int S>
void strips_tile_order(const uint8_t* const* strips, int64_t k, const bf16* xe, const bf16* xo,
                       int64_t ldx, const float* sums, int64_t sum_stride, float* out) {
  using Tr = Traits<T>;
  static_assert(Tr::kVectors == 1 || S == 1, "float types run one strip at a time");
  constexpr int tiles_per_block = Tr::f.super_k / kTileK;
  constexpr int subs_per_tile = kTileK / Tr::f.sub_k;
  const Constants c = constants();
  __m512 acc[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  const int64_t tiles = k / kTileK;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t k0 = t * kTileK;
    const uint8_t* tile[S];
    const uint8_t* meta[S];
    for (int s = 0; s < S; ++s) {
      tile[s] = strips[s] + t * Tr::kTileBytes;
      meta[s] = strips[s] + tiles * Tr::kTileBytes + t / tiles_per_block * Tr::kMetaBytes;
      prefetch_ahead<Tr::kTileBytes>(tile[s] + kPrefetchBytes);
    }
    static_for<subs_per_tile>([&](auto sub) {
      // Chains per (strip, plane) and row; a float type's planes each sum like a tile op
      // of their own (strip_tiles does the same).
      constexpr int V = Tr::kVectors;
      __m512 even[S * V][R], odd[S * V][R];
      for (int j = 0; j < S * V; ++j)
        for (int r = 0; r < R; ++r) even[j][r] = odd[j][r] = _mm512_setzero_ps();
      static_for<Tr::kSubPairs>([&](auto pair) {
        constexpr int p = sub * Tr::kSubPairs + pair;
        for (int s = 0; s < S; ++s) {
          __m512i v[V];
          decode_pair<T, p>(tile[s], c, v);
          for (int i = 0; i < V; ++i)
            for (int r = 0; r < R; ++r) {
              const int64_t at = r * ldx + k0 + 2 * p;
              const int j = s * V + i;
              even[j][r] = _mm512_dpbf16_ps(even[j][r], as_bh(v[i]), pair_of(xe + at));
              odd[j][r] = _mm512_dpbf16_ps(odd[j][r], as_bh(v[i]), pair_of(xo + at));
            }
        }
      });
      const int in_block = static_cast<int>(t % tiles_per_block) * subs_per_tile + sub;
      for (int s = 0; s < S; ++s) {
        __m512 scale = _mm512_setzero_ps(), offset = _mm512_setzero_ps();
        if constexpr (!Tr::kFloat) sub_scales<T>(meta[s], in_block, scale, offset);
        __m512 part[R];
        for (int r = 0; r < R; ++r) {
          part[r] = _mm512_add_ps(even[s * V][r], odd[s * V][r]);
          for (int i = 1; i < V; ++i)
            part[r] = _mm512_add_ps(part[r], _mm512_add_ps(even[s * V + i][r], odd[s * V + i][r]));
        }
        add_sub<T, R>(acc[s], part, scale, offset, sums + (k0 / Tr::f.sub_k + sub), sum_stride);
      }
    });
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (s * R + r) * kCols, acc[s][r]);
}

}  // namespace shoal_quant
