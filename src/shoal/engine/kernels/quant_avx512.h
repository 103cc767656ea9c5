// The packed-weight matmul on AVX512-BF16 vectors, in AMX's summation order: per row and
// column, a sub-block's products are summed in two chains, even k and odd k, each in order,
// and then added (part = even + odd), exactly as an AMX tile op from a zeroed C sums them.
// Then acc = fma(part, S, acc) and acc = fma(sum(x), O', acc) per sub-block.
//
// The strip layout puts two consecutive elements of one chain in each 32-bit lane
// (quant_formats.h), so one vdpbf16ps advances a chain by two elements (it adds the high
// word's product, then the low word's); x is rearranged the same way once per call
// (chain_order). Every path here and on AMX tiles (quant_amx.h, strip_tiles) issues the
// same float operations for each row, so a row's result depends on nothing else in x.
//
// Generated rows: tiles decoded in registers and used at once, S strips side by side to
// hide vdpbf16ps's latency (strips_direct), up to 8 rows a pass; without AMX more rows run
// in such passes over blocks of strips that stay in L2.
//
// Prompt rows without AMX take an order of their own (strips_prompt): one chain per row,
// strip and sub-block, scaled into the row's sum as the sub-block ends, R rows times S
// strips at once so that each loaded weight vector and each x pair serves several products.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "quant_simd.h"

namespace shoal_quant {

// Row(s) of x [rows, k] rearranged like the weights: vector v of tile t takes the pair at
// t * 32 + 2v, x[4q + c] in its high half and x[4q + c + 2] in its low half (v = 2q + c).
// Each run of four elements (a, b, c, d) becomes (c, a, d, b): one vpermw per 32.
inline std::vector<bf16> chain_order(const bf16* x, int64_t rows, int64_t k) {
  std::vector<bf16> out(rows * k);
  constexpr int16_t kRun[4] = {2, 0, 3, 1};  // (a, b, c, d) -> (c, a, d, b)
  alignas(64) int16_t order[32];
  for (int i = 0; i < 32; ++i) order[i] = static_cast<int16_t>((i & ~3) + kRun[i & 3]);
  const __m512i index = _mm512_load_si512(order);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / k), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * k; i < end * k; i += 32)
      _mm512_storeu_si512(out.data() + i,
                          _mm512_permutexvar_epi16(index, _mm512_loadu_si512(x + i)));
  });
  return out;
}

// One sub-block's chains for S strips x V planes x R rows, summed into part as AMX does.
template <int S, int V, int R>
struct SubBlockChains {
  __m512 even[S * V][R], odd[S * V][R];

  SubBlockChains() {
    for (int j = 0; j < S * V; ++j)
      for (int r = 0; r < R; ++r) even[j][r] = odd[j][r] = _mm512_setzero_ps();
  }

  // A vector of strip s, plane i (of the odd chain or the even one), for each row's x pair
  // (at pair_of_row(r)).
  template <class PairOfRow>
  inline void add(int s, int i, bool odd_chain, __m512i w, const PairOfRow& pair_of_row) {
    __m512(&chain)[S * V][R] = odd_chain ? odd : even;
    for (int r = 0; r < R; ++r)
      chain[s * V + i][r] = dot_pair<S * V>(chain[s * V + i][r], w, pair_of_row(r));
  }

  // part = even + odd per plane, planes added in order (a float type's planes each sum like
  // a tile op of their own).
  inline void sum(int s, __m512 (&part)[R]) const {
    for (int r = 0; r < R; ++r) {
      part[r] = _mm512_add_ps(even[s * V][r], odd[s * V][r]);
      for (int i = 1; i < V; ++i)
        part[r] = _mm512_add_ps(part[r], _mm512_add_ps(even[s * V + i][r], odd[s * V + i][r]));
    }
  }
};

// Tile t's planes and its super-block's meta in each of S strips (of `tiles` tiles), the
// planes a little ahead (for a pass of R rows) asked for. A strip's meta follows its tiles,
// so the tiles' stream of requests reaches it only late in the strip, while the first
// super-blocks' scales are needed at once: one strip at a time (passes of 3 rows and more),
// at a strip's first tile the next strip's meta is asked for too. Measured on a 1.5B
// model's layers, 2 threads: 4 and 8 rows ~18% faster, 16 rows ~8%; passes of one or two
// rows over strips side by side, which stream at memory speed, gained nothing.
template <QType T, int S, int R>
inline void tiles_at(const uint8_t* const* strips, int64_t t, int64_t tiles,
                     const uint8_t* (&tile)[S], const uint8_t* (&meta)[S]) {
  using Tr = Traits<T>;
  constexpr int tiles_per_block = Tr::f.super_k / kTileK;
  for (int s = 0; s < S; ++s) {
    tile[s] = strips[s] + t * Tr::kTileBytes;
    meta[s] = strips[s] + tiles * Tr::kTileBytes + t / tiles_per_block * Tr::kMetaBytes;
    prefetch_ahead<Tr::kTileBytes>(tile[s] + prefetch_bytes(R));
    if (S == 1 && t == 0)  // the next strip's meta
      prefetch_span(meta[s] + strip_bytes(Tr::f, tiles * kTileK),
                    tiles / tiles_per_block * Tr::kMetaBytes);
  }
}

// R rows of x (chain order, stride ldx) times S strips of one segment, tiles decoded in
// registers -> out [S][R][16].
template <QType T, int R, int S>
void strips_direct(const uint8_t* const* strips, int64_t k, const bf16* xc, int64_t ldx,
                   const float* sums, int64_t sum_stride, float* out) {
  using Tr = Traits<T>;
  constexpr int V = Tr::kVectors;
  static_assert(V == 1 || S == 1, "float types run one strip at a time");
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
    tiles_at<T, S, R>(strips, t, tiles, tile, meta);
    static_for<subs_per_tile>([&](auto sub) {
      SubBlockChains<S, V, R> chains;
      static_for<Tr::kSubPairs>([&](auto index) {
        constexpr int v = sub * Tr::kSubPairs + index;
        for (int s = 0; s < S; ++s) {
          __m512i w[V];
          decode_vector<T, v>(tile[s], c, w);
          for (int i = 0; i < V; ++i)
            chains.add(s, i, v % 2 == 1, w[i],
                       [&](int r) { return xc + r * ldx + k0 + 2 * v; });
        }
      });
      const int in_block = static_cast<int>(t % tiles_per_block) * subs_per_tile + sub;
      for (int s = 0; s < S; ++s) {
        __m512 scale = _mm512_setzero_ps(), offset = _mm512_setzero_ps();
        if constexpr (!Tr::kFloat) sub_scales<T>(meta[s], in_block, scale, offset);
        __m512 part[R];
        chains.sum(s, part);
        add_sub<T, R>(acc[s], part, scale, offset, sums + (k0 / Tr::f.sub_k + sub), sum_stride);
      }
    });
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (s * R + r) * kCols, acc[s][r]);
}

// Prompt rows without AMX: R rows of x (chain order, stride ldx) times S strips decoded in
// chain layout (decode_strip<T, false, kPromptCentred<T>>), over sub-blocks [g0, g1),
// into acc [R][S][16]
// (read and written: k may be cut into chunks). Per sub-block, each (row, strip) sums its
// products in one chain (every plane of a float type in the same chain), then
// acc = fma(chain, S, acc) and acc = fma(sum(x), O', acc). The sums stay in registers
// beside the R * S chains while the pass runs (loaded and stored once per chunk, not once
// per sub-block): each weight vector loaded serves R products and each x pair S. The
// operations for one row are the same for any R, S, chunking and rows beside it; they
// differ from the generated rows' order (prompt and generated tokens each have their own
// arithmetic, as on AMX).
template <QType T, int R, int S>
void strips_prompt(const __m512i* const* vectors, const float* const* scales,
                   const float* const* offsets, int64_t g0, int64_t g1, const bf16* xc,
                   int64_t ldx, const float* sums, int64_t sum_stride, float* acc) {
  using Tr = Traits<T>;
  constexpr int V = Tr::kVectors;
  __m512 total[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) total[r][s] = _mm512_loadu_ps(acc + (r * S + s) * kCols);
  for (int64_t g = g0; g < g1; ++g) {
    __m512 chain[R][S];
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < S; ++s) chain[r][s] = _mm512_setzero_ps();
    const bf16* xg = xc + g * Tr::f.sub_k;
    static_for<Tr::kSubPairs>([&](auto index) {
      __m512i w[S][V];
      for (int s = 0; s < S; ++s)
        for (int i = 0; i < V; ++i)
          w[s][i] = _mm512_load_si512(vectors[s] + (g * Tr::kSubPairs + index) * V + i);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = pair_of(xg + r * ldx + 2 * index);
        for (int s = 0; s < S; ++s)
          for (int i = 0; i < V; ++i)
            chain[r][s] = _mm512_dpbf16_ps(chain[r][s], as_bh(w[s][i]), x);
      }
    });
    for (int s = 0; s < S; ++s) {
      __m512 scale = _mm512_setzero_ps(), offset = _mm512_setzero_ps();
      if constexpr (!Tr::kFloat) {
        scale = _mm512_loadu_ps(scales[s] + g * kCols);
        offset = _mm512_loadu_ps(offsets[s] + g * kCols);
      }
      for (int r = 0; r < R; ++r) {
        __m512& sum = total[r][s];
        if constexpr (Tr::kFloat) {
          sum = _mm512_add_ps(sum, chain[r][s]);
        } else {
          sum = _mm512_fmadd_ps(chain[r][s], scale, sum);
          if constexpr (kPromptCentred<T> ? Tr::f.has_e : Tr::kOffset)
            sum = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * sum_stride + g]), offset, sum);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(acc + (r * S + s) * kCols, total[r][s]);
}

// Prompt rows without AMX, a few of them: strips_prompt's operations with each tile decoded
// in registers (centred as decode_strip<T, false, kPromptCentred<T>> centres it, S and O'
// as it computes them) instead of from a decoded strip: a short prompt chunk reads each
// weight once, like a decode step, and every row gets the same bits as on the long path.
template <QType T, int R, int S>
void strips_prompt_direct(const uint8_t* const* strips, int64_t k, const bf16* xc, int64_t ldx,
                          const float* sums, int64_t sum_stride, float* out) {
  using Tr = Traits<T>;
  constexpr int V = Tr::kVectors;
  static_assert(V == 1 || S == 1, "float types run one strip at a time");
  constexpr bool kCentred = kPromptCentred<T>;
  constexpr int tiles_per_block = Tr::f.super_k / kTileK;
  constexpr int subs_per_tile = kTileK / Tr::f.sub_k;
  const Constants c = constants();
  const __m512 centre = _mm512_set1_ps(static_cast<float>(Tr::kC));
  __m512 acc[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  const int64_t tiles = k / kTileK;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tile[S];
    const uint8_t* meta[S];
    tiles_at<T, S, R>(strips, t, tiles, tile, meta);
    static_for<subs_per_tile>([&](auto sub) {
      __m512 chain[S][R];
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) chain[s][r] = _mm512_setzero_ps();
      const int64_t g = t * subs_per_tile + sub;
      static_for<Tr::kSubPairs>([&](auto index) {
        constexpr int v = sub * Tr::kSubPairs + index;
        for (int s = 0; s < S; ++s) {
          __m512i w[V];
          decode_vector<T, v>(tile[s], c, w);
          if constexpr (kCentred)
            w[0] = to_bf16(_mm512_add_ps(bf16_half(w[0], 1), centre),
                           _mm512_add_ps(bf16_half(w[0], 0), centre));
          for (int r = 0; r < R; ++r) {
            const bf16* x = xc + r * ldx + g * Tr::f.sub_k + 2 * index;
            for (int i = 0; i < V; ++i) chain[s][r] = dot_pair<S * V>(chain[s][r], w[i], x);
          }
        }
      });
      const int in_block = static_cast<int>(t % tiles_per_block) * subs_per_tile + sub;
      for (int s = 0; s < S; ++s) {
        __m512 scale = _mm512_setzero_ps(), offset = _mm512_setzero_ps();
        if constexpr (!Tr::kFloat) {
          if constexpr (kCentred) {
            sub_scale_min<T>(meta[s], in_block, scale, offset);
          } else {
            sub_scales<T>(meta[s], in_block, scale, offset);
          }
        }
        for (int r = 0; r < R; ++r) {
          if constexpr (Tr::kFloat) {
            acc[s][r] = _mm512_add_ps(acc[s][r], chain[s][r]);
          } else {
            acc[s][r] = _mm512_fmadd_ps(chain[s][r], scale, acc[s][r]);
            if constexpr (kCentred ? Tr::f.has_e : Tr::kOffset)
              acc[s][r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * sum_stride + g]), offset,
                                          acc[s][r]);
          }
        }
      }
    });
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (s * R + r) * kCols, acc[s][r]);
}

}  // namespace shoal_quant
