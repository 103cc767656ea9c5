// Rows of the paged KV cache as the kernels read and write them. A row is one token's key
// or value of one KV head: D elements of float32 or bf16, or, in an int8 cache, D int8
// values followed by one bf16 scale per group of 16 channels (one group when D is not a
// multiple of 16), value = q * scale. The layout and the quantization are kv/quant.py's;
// both use the same float32 operations, so a row written here has the bits the Python path
// writes, and a value read here is the float the Python path reads.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace shoal_kv {

template <typename E>
constexpr bool kQuantized = std::is_same_v<E, int8_t>;

constexpr int64_t kGroup = 16;
constexpr int64_t kScaleBytes = 2;  // a bf16 scale

// Channels per scale.
constexpr int64_t group_size(int64_t dim) { return dim % kGroup == 0 ? kGroup : dim; }

// Elements of E from one row to the next.
template <typename E>
constexpr int64_t row_width(int64_t dim) {
  return kQuantized<E> ? dim + kScaleBytes * (dim / group_size(dim)) : dim;
}

// The scale of channels [group * group_size, ...) of an int8 row.
inline float group_scale(const int8_t* row, int64_t dim, int64_t group) {
  c10::BFloat16 scale;
  std::memcpy(&scale, row + dim + kScaleBytes * group, sizeof scale);
  return static_cast<float>(scale);
}

// All G scales of an int8 row as floats (bf16 is the top half of a float32).
template <int G>
inline void group_scales(const int8_t* row, int64_t dim, float (&out)[G]) {
  uint16_t bits[G];
  std::memcpy(bits, row + dim, sizeof bits);
  for (int g = 0; g < G; ++g) {
    const uint32_t wide = static_cast<uint32_t>(bits[g]) << 16;
    std::memcpy(&out[g], &wide, sizeof wide);
  }
}

// Channel i of a row as a float.
template <typename E>
inline float element(const E* row, int64_t dim, int64_t i) {
  if constexpr (kQuantized<E>) {
    return static_cast<float>(row[i]) * group_scale(row, dim, i / group_size(dim));
  } else {
    return static_cast<float>(row[i]);
  }
}

// x ([dim] float32) into a row: rounded to E, or quantized (symmetric absmax over each
// group, the scale rounded to bf16, values rounded half to even and clamped to +-127, a
// group of zeros keeps scale 0).
template <typename E>
inline void write_row(const float* x, int64_t dim, E* out) {
  if constexpr (kQuantized<E>) {
    const int64_t group = group_size(dim);
    for (int64_t first = 0; first < dim; first += group) {
      float peak = 0.f;
      for (int64_t i = first; i < first + group; ++i) peak = std::max(peak, std::fabs(x[i]));
      const c10::BFloat16 scale(peak / 127.f);
      const float divisor = static_cast<float>(scale) > 0.f ? static_cast<float>(scale) : 1.f;
      for (int64_t i = first; i < first + group; ++i) {
        const float q = std::nearbyint(x[i] / divisor);
        out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
      }
      std::memcpy(out + dim + kScaleBytes * (first / group), &scale, sizeof scale);
    }
  } else {
    for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<E>(x[i]);
  }
}

}  // namespace shoal_kv
