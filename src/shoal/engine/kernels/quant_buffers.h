// Per-thread buffers for whole decoded strips: the paths that decode a strip once and run
// many rows over it (quant_paths.cpp, quant_prompt.cpp). AVX512-BF16 builds only.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "quant_formats.h"

namespace shoal_quant {

// x rows per block while a decoded strip is reused: about this many bytes of x stay cached
// (AMX prompt rows read x again for every pair of strips; other paths for every strip).
constexpr int64_t kRowBlockBytes = 512 * 1024;

// A thread's buffers for decoded strips.
struct StripBuffer {
  std::vector<__m512i> pairs, second;
  std::vector<float> scales, offsets;

  void reserve(int64_t k, int vectors, int sub_k) {
    const size_t n = static_cast<size_t>(k / 2 * vectors);
    if (pairs.size() < n) pairs.resize(n);
    const size_t s = static_cast<size_t>(k / sub_k * kCols);
    if (scales.size() < s) scales.resize(s), offsets.resize(s);
  }
};

}  // namespace shoal_quant
