// The packed-weight kernels of one weight type, as function pointers QuantLinear picks from
// at run time (quant_paths.cpp). Built for AVX512-BF16 machines only.

#pragma once

#include <algorithm>

#include "quant_amx.h"
#include "quant_avx512.h"

namespace shoal_quant {

// Rows per pass with tiles decoded in registers: prompt rows kDirectRows, generated rows
// kGeneratedRows (two chains a row: 16 in registers at 8 rows). Without AMX, more generated
// rows run in such passes over blocks of about kDirectBlockBytes of packed weights
// (QuantLinear::run_direct). Measured on an AVX512-BF16 core without AMX (a 1.5B model's
// 17920 x 1536 Q4_K matmul): passes of 4 rows took 0.67 ms at 8 rows and 5.2 ms at 64,
// against 1.35 and 5.8 ms decoding strips into buffers once and running the rows over those;
// passes of 8 rows 0.58 and 4.6 ms.
constexpr int kDirectRows = 4;
constexpr int kGeneratedRows = 8;
constexpr int64_t kDirectBlockBytes = 256 * 1024;
// Prompt rows over decoded strips without AMX: rows and strips per pass (16 chains in
// registers; measured best of 4x3 with sums in registers, 6x2, 8x2, 6x3 and 4x4 on an
// AVX512-BF16 core), and k per chunk (a chunk's decoded strips stay in L2 while every row
// pass runs over them).
constexpr int kGroupRows = 4;
constexpr int kGroupStrips = 4;
constexpr int64_t kGroupChunkK = 2048;

using DirectFn = void (*)(const uint8_t* const*, int64_t, const bf16*, int64_t, const float*,
                          int64_t, float*);
using DecodeFn = void (*)(const uint8_t*, int64_t, __m512i*, float*, float*);
using TilesFn = void (*)(const __m512i*, const float*, const float*, int64_t, const bf16*,
                         int64_t, int, const float*, int64_t, float*);
using SplitFn = void (*)(const uint8_t*, int64_t, int64_t, int, __m512i*);
using GroupFn = void (*)(const __m512i* const*, const float* const*, const float* const*,
                         int64_t, int64_t, const bf16*, int64_t, const float*, int64_t,
                         float*);

// Prompt rows over groups of decoded strips (QuantLinear::run_groups).
struct GroupKernels {
  DecodeFn decode;
  GroupFn run[kGroupStrips][kGroupRows];  // [strips - 1][rows - 1]
  int strips;                             // the most strips per group
};

// Strips run side by side for R rows: enough chains to hide vdpbf16ps's latency.
constexpr int strips_side_by_side(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

struct Kernels {
  // Vectors: tiles decoded in registers, several strips at once or one.
  DirectFn direct[kGeneratedRows];
  DirectFn direct_single[kGeneratedRows];
  // The same for prompt rows (strips_prompt_direct: strips_prompt's bits, few rows).
  DirectFn prompt_direct[kDirectRows];
  DirectFn prompt_direct_single[kDirectRows];
  // Without AMX, more prompt rows than direct takes: strips_prompt over strips decoded
  // centred where kPromptCentred.
  GroupKernels prompt;
  // AMX: a strip decoded in pair layout with rows over it on tiles (the same bits as the
  // vector paths), and prompt rows on split weights.
  DecodeFn decode_pairs;
  TilesFn tiles;
  SplitFn split;
  int vectors, sub_k;
};

template <QType T>
Kernels kernels_of() {
  Kernels out{};
  static_for<kGeneratedRows>([&](auto r) {
    constexpr int side = Traits<T>::kVectors == 1 ? strips_side_by_side(r + 1) : 1;
    out.direct[r] = &strips_direct<T, r + 1, side>;
    out.direct_single[r] = &strips_direct<T, r + 1, 1>;
  });
  static_for<kDirectRows>([&](auto r) {
    constexpr int side = Traits<T>::kVectors == 1 ? strips_side_by_side(r + 1) : 1;
    out.prompt_direct[r] = &strips_prompt_direct<T, r + 1, side>;
    out.prompt_direct_single[r] = &strips_prompt_direct<T, r + 1, 1>;
  });
  constexpr bool wide = Traits<T>::kVectors == 1;
  static_for<kGroupStrips>([&](auto s) {
    static_for<kGroupRows>([&](auto r) {
      out.prompt.run[s][r] = &strips_prompt<T, r + 1, wide ? s + 1 : 1>;
    });
  });
  out.prompt.strips = wide ? kGroupStrips : 1;
  out.prompt.decode = &decode_strip<T, false, kPromptCentred<T>>;
  out.decode_pairs = &decode_strip<T, true>;
#if SHOAL_QUANT_AMX
  out.tiles = &strip_tiles<T>;
  out.split = &decode_split<T>;
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
