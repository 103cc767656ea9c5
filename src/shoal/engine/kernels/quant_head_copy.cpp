// Packing and reading the head's estimate copy (layout: quant_head_copy.h).

#include "quant_head_copy.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant_formats.h"

namespace shoal_quant {

namespace {

// Where column c's code at k_in_block lies in a block: byte and shift of its low bits (all
// four for 4 bits, two for 3), and for 3 bits byte and bit of its third.
struct CodePos {
  int low_byte, low_shift, high_byte, high_bit;
};

CodePos code_pos(const CopyLayout& layout, int c, int k_in_block) {
  const int p = k_in_block / 4, i = k_in_block % 4;
  if (layout.bits == 4) return {64 * (p / 2) + 4 * c + i, 4 * (p % 2), -1, 0};
  return {64 * (p / 4) + 4 * c + i, 2 * (p % 4), layout.high_at + 64 * (p / 8) + 4 * c + i, p % 8};
}

CopyLayout checked_layout(int64_t bits, int64_t k) {
  TORCH_CHECK(bits == 3 || bits == 4, "head copy: bits must be 3 or 4, not ", bits);
  TORCH_CHECK(k > 0 && k % kCopyBlockK == 0, "head copy: k must be a multiple of ",
              kCopyBlockK, ", not ", k);
  return copy_layout(static_cast<int>(bits));
}

void pack_row_block(const CopyLayout& layout, const float* v, int c, uint8_t* block) {
  const int top = (1 << layout.bits) - 1, low_mask = layout.bits == 4 ? 15 : 3;
  const auto [low, high] = std::minmax_element(v, v + kCopyBlockK);
  const c10::Half d((*high - *low) / static_cast<float>(top)), m(*low);
  TORCH_CHECK(std::isfinite(static_cast<float>(d)) && std::isfinite(static_cast<float>(m)),
              "head copy: weights beyond fp16's range");
  const float step = static_cast<float>(d), base = static_cast<float>(m);
  for (int kk = 0; kk < kCopyBlockK; ++kk) {
    const float q = step > 0.f ? std::nearbyint((v[kk] - base) / step) : 0.f;
    const int u = static_cast<int>(std::clamp(q, 0.f, static_cast<float>(top)));
    const CodePos pos = code_pos(layout, c, kk);
    block[pos.low_byte] |= static_cast<uint8_t>((u & low_mask) << pos.low_shift);
    if (layout.bits == 3) block[pos.high_byte] |= static_cast<uint8_t>((u >> 2) << pos.high_bit);
  }
  std::memcpy(block + layout.scale_at + 2 * c, &d.x, 2);
  std::memcpy(block + layout.min_at + 2 * c, &m.x, 2);
}

}  // namespace

at::Tensor head_copy_pack(const at::Tensor& input, int64_t bits) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() == 2,
              "head copy: values must be [n, k] float32");
  const at::Tensor values = input.contiguous();
  const int64_t n = values.size(0), k = values.size(1);
  const CopyLayout layout = checked_layout(bits, k);
  const int64_t strips = strip_count(n), bytes = copy_strip_bytes(layout.bits, k);
  at::Tensor out = at::zeros({strips * bytes}, values.options().dtype(at::kByte));
  const float* src = values.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int c = 0; c < kCols && s * kCols + c < n; ++c)  // padding rows stay 0
        for (int64_t b = 0; b < k / kCopyBlockK; ++b)
          pack_row_block(layout, src + (s * kCols + c) * k + b * kCopyBlockK, c,
                         dst + s * bytes + b * layout.block_bytes);
  });
  return out;
}

at::Tensor head_copy_values(const at::Tensor& packed, int64_t n, int64_t k, int64_t bits) {
  const CopyLayout layout = checked_layout(bits, k);
  const int64_t bytes = copy_strip_bytes(layout.bits, k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == strip_count(n) * bytes,
              "head copy: not a packed [", n, ", ", k, "] ", bits, "-bit copy");
  const int low_mask = layout.bits == 4 ? 15 : 3;
  at::Tensor out = at::empty({n, k}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int c = static_cast<int>(row % kCols);
      for (int64_t b = 0; b < k / kCopyBlockK; ++b) {
        const uint8_t* block = src + row / kCols * bytes + b * layout.block_bytes;
        const float d = half_to_float(read_u16(block + layout.scale_at + 2 * c));
        const float m = half_to_float(read_u16(block + layout.min_at + 2 * c));
        for (int kk = 0; kk < kCopyBlockK; ++kk) {
          const CodePos pos = code_pos(layout, c, kk);
          int u = block[pos.low_byte] >> pos.low_shift & low_mask;
          if (layout.bits == 3) u |= (block[pos.high_byte] >> pos.high_bit & 1) << 2;
          dst[row * k + b * kCopyBlockK + kk] = std::fmaf(d, static_cast<float>(u), m);
        }
      }
    }
  });
  return out;
}

}  // namespace shoal_quant
