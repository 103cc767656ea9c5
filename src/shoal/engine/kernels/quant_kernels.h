// The packed-weight kernels of one weight type, as function pointers QuantLinear picks from
// at run time (quant_matmul.cpp). Built for AVX512-BF16 machines only.

#pragma once

#include "quant_amx.h"
#include "quant_avx512.h"

namespace shoal_quant {

// Rows decoded tile by tile; more use a decoded strip.
constexpr int kDirectRows = 4;
// Rows per pass over a decoded strip in the vector order (its chains stay in registers).
constexpr int kBlockRows = 4;

using DirectFn = void (*)(const uint8_t*, int64_t, const bf16*, int64_t, const float*, int64_t,
                          float*);
using DecodeFn = void (*)(const uint8_t*, int64_t, __m512i*, float*, float*);
using BufferedFn = void (*)(const __m512i*, const float*, const float*, int64_t, const bf16*,
                            int64_t, const float*, int64_t, float*);
using TileOrderFn = void (*)(const uint8_t* const*, int64_t, const bf16*, const bf16*, int64_t,
                             const float*, int64_t, float*);
using TilesFn = void (*)(const __m512i*, const float*, const float*, int64_t, const bf16*,
                         int64_t, int, const float*, int64_t, float*);
using SplitFn = void (*)(const uint8_t*, int64_t, __m512i*);

// Strips run side by side in the tile order for R rows: enough chains to hide latency.
constexpr int strips_side_by_side(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

struct Kernels {
  // Vector order (machines without AMX): tiles decoded in registers, or a decoded strip.
  DirectFn direct[kDirectRows];
  DecodeFn decode;
  BufferedFn buffered[kBlockRows];
  // AMX order (machines with AMX): on vectors for few rows, on tiles for more, the same bits.
  TileOrderFn tile_order[kDirectRows];         // strips_side_by_side(rows) strips at once
  TileOrderFn tile_order_single[kDirectRows];  // one strip
  TilesFn tiles;
  // Prompt rows on AMX: the strip as hi / lo bf16 B tiles.
  SplitFn split;
  int vectors, sub_k;
};

template <QType T>
Kernels kernels_of() {
  Kernels out{};
  static_for<kDirectRows>([&](auto r) {
    out.direct[r] = &strip_direct<T, r + 1>;
    constexpr int side = Traits<T>::kVectors == 1 ? strips_side_by_side(r + 1) : 1;
    out.tile_order[r] = &strips_tile_order<T, r + 1, side>;
    out.tile_order_single[r] = &strips_tile_order<T, r + 1, 1>;
  });
  out.decode = &decode_strip<T>;
  static_for<kBlockRows>([&](auto r) { out.buffered[r] = &strip_buffered<T, r + 1>; });
#if SHOAL_QUANT_AMX
  out.tiles = &strip_tiles<T>;
  out.split = &decode_strip_split<T>;
#endif
  out.vectors = Traits<T>::kVectors;
  out.sub_k = Traits<T>::f.sub_k;
  return out;
}

inline const Kernels& kernels(QType type) {
  static const Kernels table[kNumTypes] = {
      kernels_of<QType::kF32>(),   kernels_of<QType::kF16>(),   kernels_of<QType::kBF16>(),
      kernels_of<QType::kQ4_0>(),  kernels_of<QType::kQ4_1>(),  kernels_of<QType::kQ5_0>(),
      kernels_of<QType::kQ5_1>(),  kernels_of<QType::kQ8_0>(),  kernels_of<QType::kQ2_K>(),
      kernels_of<QType::kQ3_K>(),  kernels_of<QType::kQ4_K>(),  kernels_of<QType::kQ5_K>(),
      kernels_of<QType::kQ6_K>(),  kernels_of<QType::kIQ4_NL>(), kernels_of<QType::kIQ4_XS>(),
  };
  return table[static_cast<int>(type)];
}

}  // namespace shoal_quant
