// The decode kernel's per-row passes (decode.cpp): norms, residual adds, gated activations
// and RoPE over a few hundred floats, on 16-lane vectors (vector.h). Rounding follows the
// Python path: what it keeps in a bf16 tensor is rounded to bf16 here.

#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "vector.h"

namespace shoal_decode {

using bf16 = at::BFloat16;
using shoal_vec::f32x16;
using shoal_vec::kLanes;

// The per-row passes run on several threads from this many rows.
constexpr int64_t kParallelRows = 8;

// body(b) for every row b; on torch's intra-op threads once a batch has kParallelRows rows
// (below that a parallel region costs more than the rows' few microseconds of work).
template <typename Body>
void for_rows(int64_t rows, const Body& body) {
  at::parallel_for(0, rows, rows >= kParallelRows ? 1 : rows, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) body(b);
  });
}

// out[i] = bf16(x[i] * rsqrt(mean(x^2) + eps) * w[i]), accumulated in float32 and rounded
// once, as the Python path's layer-norm form of RMSNorm for a few rows does (its rms_norm
// for more rows rounds twice; bf16 paths are judged by quality, not identity).
inline void rms_norm(const bf16* x, const bf16* w, bf16* out, int64_t n, float eps) {
  f32x16 squares{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f32x16 v = shoal_vec::load(x + i);
    squares += v * v;
  }
  float sum = shoal_vec::hsum(squares);
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * x[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i + kLanes <= n; i += kLanes)
    shoal_vec::store(out + i, shoal_vec::load(x + i) * scale * shoal_vec::load(w + i));
  for (; i < n; ++i) out[i] = bf16(x[i] * scale * w[i]);
}

// RMSNorm of a float32 head in place (Gemma's q / k norms, float32 as in the Python path).
inline void rms_norm_f32(float* x, const float* w, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * scale * w[i];
}

// h[i] = bf16(h[i] + delta[i]): the residual stream stays bf16, as in the Python path.
inline void residual_add(bf16* h, const bf16* delta, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    shoal_vec::store(h + i, shoal_vec::load(h + i) + shoal_vec::load(delta + i));
  for (; i < n; ++i) h[i] = bf16(static_cast<float>(h[i]) + delta[i]);
}

// out[i] = bf16(bf16(act(gate[i])) * up[i]): torch's activation on a bf16 tensor, then the
// product, each rounded to bf16. act: silu, or gelu with the tanh approximation (Gemma).
template <bool kGelu>
inline f32x16 activation(f32x16 g) {
  if constexpr (kGelu) {
    // 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (e^2y + 1)
    const f32x16 y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const f32x16 tanh = 1.f - 2.f / (shoal_vec::exp(2.f * y) + 1.f);
    return 0.5f * g * (1.f + tanh);
  } else {
    return g / (1.f + shoal_vec::exp(-g));
  }
}

template <bool kGelu>
inline float activation(float g) {
  if constexpr (kGelu) {
    return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  } else {
    return g / (1.f + std::exp(-g));
  }
}

template <bool kGelu>
inline void gated(const bf16* gate, const bf16* up, bf16* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f32x16 act = shoal_vec::round_bf16(activation<kGelu>(shoal_vec::load(gate + i)));
    shoal_vec::store(out + i, act * shoal_vec::load(up + i));
  }
  for (; i < n; ++i)
    out[i] = bf16(static_cast<float>(bf16(activation<kGelu>(static_cast<float>(gate[i])))) * up[i]);
}

// Rotary embedding in the half-split layout, float32:
// out = x * cos + roll(x, D/2) * signed_sin, with signed_sin = (-sin, sin).
inline void rotate(const float* x, const float* cos, const float* sin, float* out,
                   int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const float swapped = x[i < half ? i + half : i - half];
    out[i] = x[i] * cos[i] + swapped * sin[i];
  }
}

}  // namespace shoal_decode
