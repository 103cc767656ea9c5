// Packing and reading a Q8_0 head's split table (layout: quant_head_split.h). Its estimate
// is quant_estimate.cpp's.

#include "quant_head_split.h"

#include <ATen/Parallel.h>

#include <cstring>

#include "quant_formats.h"
#include "vector.h"

namespace shoal_quant {

namespace {

void check_split(const at::Tensor& split, int64_t n, int64_t k, const char* who) {
  TORCH_CHECK(k > 0 && k % kSplitBlockK == 0, who, ": k must be a multiple of ", kSplitBlockK);
  TORCH_CHECK(split.scalar_type() == at::kByte && split.is_contiguous() &&
                  split.numel() == split_total_bytes(strip_count(n), k),
              who, ": not a split [", n, ", ", k, "] Q8_0 table");
}

// Where row `row`'s blocks lie: its strip's first high and low block, and its column there.
struct RowBlocks {
  const uint8_t* high;
  const uint8_t* low;
  int c;

  RowBlocks(const uint8_t* table, int64_t strips, int64_t k, int64_t row) {
    const int64_t blocks = k / kSplitBlockK, strip = row / kCols;
    c = static_cast<int>(row % kCols);
    high = table + strip * blocks * kSplitHighBytes;
    low = table + split_high_bytes(strips, k) + strip * blocks * kSplitLowBytes;
  }

  float scale(int64_t b) const {
    return half_to_float(read_u16(high + b * kSplitHighBytes + kSplitScaleAt + 2 * c));
  }

  // Block b's codes q = 16 h + l - 128 (gguf's int8 codes), in k order, into q [32].
  void codes(int64_t b, int8_t* q) const {
    const uint8_t* h = high + b * kSplitHighBytes;
    const uint8_t* l = low + b * kSplitLowBytes;
    for (int j = 0; j < 4; ++j) {  // chunk j: planes 2 j (k = 8 j + i) and 2 j + 1 (8 j + 4 + i)
      uint32_t h4, l4;
      std::memcpy(&h4, h + 64 * j + 4 * c, 4);
      std::memcpy(&l4, l + 64 * j + 4 * c, 4);
      // u = 16 h + l per byte, then q = u - 128 as a flip of the top bit.
      const uint32_t first = ((h4 & 0x0F0F0F0Fu) << 4 | (l4 & 0x0F0F0F0Fu)) ^ 0x80808080u;
      const uint32_t second = ((h4 & 0xF0F0F0F0u) | (l4 >> 4 & 0x0F0F0F0Fu)) ^ 0x80808080u;
      std::memcpy(q + 8 * j, &first, 4);  // little-endian: byte i is k = 8 j + i
      std::memcpy(q + 8 * j + 4, &second, 4);
    }
  }
};

// Row `row` of the table into out [k]: d q per weight, gguf's values.
void split_row(const uint8_t* table, int64_t strips, int64_t k, int64_t row, float* out) {
  const RowBlocks row_blocks(table, strips, k, row);
  int8_t q[kSplitBlockK];
  for (int64_t b = 0; b < k / kSplitBlockK; ++b) {
    row_blocks.codes(b, q);
    const float d = row_blocks.scale(b);
    for (int i = 0; i < kSplitBlockK; ++i) out[b * kSplitBlockK + i] = d * q[i];
  }
}

// Row `row` of the table times x [k] (float32): per block d * (q . x), 16 lanes, the lanes
// summed at the end.
float split_dot(const uint8_t* table, int64_t strips, int64_t k, int64_t row, const float* x) {
  using shoal_vec::f32x16;
  const RowBlocks row_blocks(table, strips, k, row);
  alignas(16) int8_t q[kSplitBlockK];
  f32x16 total = shoal_vec::splat(0.f);
  for (int64_t b = 0; b < k / kSplitBlockK; ++b) {
    row_blocks.codes(b, q);
    const float* xb = x + b * kSplitBlockK;
    const f32x16 block = shoal_vec::fma(shoal_vec::load(q + 16), shoal_vec::load(xb + 16),
                                        shoal_vec::load(q) * shoal_vec::load(xb));
    total = shoal_vec::fma(block, shoal_vec::splat(row_blocks.scale(b)), total);
  }
  return shoal_vec::hsum(total);
}

void check_rows(const at::Tensor& rows, int64_t n, const char* who) {
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n, who, ": row ", ids[i], " outside [0, ", n, ")");
}

}  // namespace

at::Tensor head_split_from_file(const at::Tensor& data, int64_t n, int64_t k) {
  TORCH_CHECK(k > 0 && k % kSplitBlockK == 0, "head split: k must be a multiple of ",
              kSplitBlockK);
  constexpr int kBlockBytes = 2 + kSplitBlockK;  // ggml's block_q8_0: fp16 d, 32 int8 q
  const int64_t row_bytes = k / kSplitBlockK * kBlockBytes;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() &&
                  data.numel() == n * row_bytes,
              "head split: not the file bytes of a [", n, ", ", k, "] Q8_0 weight");
  const int64_t strips = strip_count(n), blocks = k / kSplitBlockK;
  at::Tensor out = at::zeros({split_total_bytes(strips, k)}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* high0 = out.data_ptr<uint8_t>();
  uint8_t* low0 = high0 + split_high_bytes(strips, k);
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* high = high0 + (s * blocks + b) * kSplitHighBytes;
        uint8_t* low = low0 + (s * blocks + b) * kSplitLowBytes;
        for (int c = 0; c < kCols && s * kCols + c < n; ++c) {  // padding rows stay 0
          const uint8_t* block = src + (s * kCols + c) * row_bytes + b * kBlockBytes;
          std::memcpy(high + kSplitScaleAt + 2 * c, block, 2);  // d
          for (int kk = 0; kk < kSplitBlockK; ++kk) {
            const unsigned u = block[2 + kk] ^ 0x80u;  // q + 128
            const int p = kk / 4, at = 64 * (p / 2) + 4 * c + kk % 4, shift = 4 * (p % 2);
            high[at] |= static_cast<uint8_t>((u >> 4) << shift);
            low[at] |= static_cast<uint8_t>((u & 15) << shift);
          }
        }
      }
  });
  return out;
}

at::Tensor head_split_rows(const at::Tensor& split, int64_t n, int64_t k, const at::Tensor& rows) {
  check_split(split, n, k, "head split rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1,
              "head split rows: rows must be int64 [T]");
  const at::Tensor ids = rows.contiguous();
  check_rows(ids, n, "head split rows");
  at::Tensor out = at::empty({ids.numel(), k}, split.options().dtype(at::kFloat));
  const uint8_t* table = split.data_ptr<uint8_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, ids.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) split_row(table, strip_count(n), k, id[i], dst + i * k);
  });
  return out;
}

at::Tensor head_split_columns(const at::Tensor& split, int64_t n, int64_t k, const at::Tensor& input,
                              const at::Tensor& columns) {
  check_split(split, n, k, "head split columns");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2 && input.size(1) == k,
              "head split columns: x must be [S, ", k, "] bfloat16");
  TORCH_CHECK(columns.scalar_type() == at::kLong && columns.dim() == 2 &&
                  columns.size(0) == input.size(0),
              "head split columns: columns must be int64 [S, C]");
  const at::Tensor cols = columns.contiguous();
  check_rows(cols, n, "head split columns");
  const int64_t rows = input.size(0), per_row = cols.size(1);
  const at::Tensor x = input.contiguous().to(at::kFloat);
  at::Tensor out = at::empty({rows, per_row}, x.options());
  const uint8_t* table = split.data_ptr<uint8_t>();
  const float* xs = x.data_ptr<float>();
  const int64_t* col = cols.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows * per_row, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dst[i] = split_dot(table, strip_count(n), k, col[i], xs + i / per_row * k);
  });
  return out;
}

}  // namespace shoal_quant
