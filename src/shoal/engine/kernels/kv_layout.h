// Rows of the paged KV cache as the kernels read and write them. A row is one token's key
// or value of one KV head: D elements of float32 or bf16, or, in an int8 cache, D int8
// values followed by their float32 scale (4 bytes), value = q * scale. The layout and the
// quantization are kv/quant.py's; both use the same float32 operations, so a row written
// here has the bits the Python path writes.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace shoal_kv {

template <typename E>
constexpr bool kQuantized = std::is_same_v<E, int8_t>;

constexpr int64_t kScaleBytes = 4;

// Elements of E from one row to the next.
template <typename E>
constexpr int64_t row_width(int64_t dim) {
  return kQuantized<E> ? dim + kScaleBytes : dim;
}

// The factor a row's elements take to become its values: its scale, or 1 (never used).
template <typename E>
inline float row_scale(const E* row, int64_t dim) {
  if constexpr (kQuantized<E>) {
    float scale;
    std::memcpy(&scale, row + dim, sizeof scale);
    return scale;
  } else {
    return 1.f;
  }
}

// x ([dim] float32) into a row: rounded to E, or quantized (symmetric absmax over the row,
// round half to even, a zero row keeps scale 0).
template <typename E>
inline void write_row(const float* x, int64_t dim, E* out) {
  if constexpr (kQuantized<E>) {
    float peak = 0.f;
    for (int64_t i = 0; i < dim; ++i) peak = std::max(peak, std::fabs(x[i]));
    const float scale = peak / 127.f;
    const float divisor = scale > 0.f ? scale : 1.f;
    for (int64_t i = 0; i < dim; ++i) {
      const float q = std::nearbyint(x[i] / divisor);
      out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
    }
    std::memcpy(out + dim, &scale, sizeof scale);
  } else {
    for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<E>(x[i]);
  }
}

}  // namespace shoal_kv
