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
// Prompt rows over decoded strips without AMX: rows and strips per pass, and k per chunk (a
// chunk's decoded strips stay in L2 while every row pass runs over them). 7 x 2 holds 14
// chains and their 14 sums in registers: a Zen 5 core issues two vdpbf16ps a cycle at a
// latency of ~6, so it needs 12 chains in flight. Measured there, one thread, the pass
// alone (k 1536-2048, 120 rows): Q4_K 92% of the vdpbf16ps peak, Q6_K 94%, against 85% and
// 73% for 4 x 4 with its sums in L1 (a load, fma and store per sub-block: Q6_K's 16-wide
// sub-blocks paid that every 8 products); 4 x 3 and 6 x 2 with sums in registers 87-91%.
constexpr int kGroupRows = 7;
constexpr int kGroupStrips = 2;
// Strips decoded together (a panel, run_groups): each pass's x rows serve all of them while
// in L1, so x comes from memory once per panel. Measured as above, 504 rows (x 1.5 MB, more
// than L2): panels of 2 strips 80%, 4 86%, 8 88-92%.
constexpr int kPanelStrips = 8;
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
      kernels_of<QType::kMXFP4>(),
  };
  return table[static_cast<int>(type)];
}

}  // namespace shoal_quant
