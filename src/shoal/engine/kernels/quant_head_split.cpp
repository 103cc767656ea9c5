// Packing and reading a Q8_0 head's split table (layout: quant_head_split.h). Its estimate
// is quant_estimate.cpp's.

#include "quant_head_split.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "quant_formats.h"

namespace shoal_quant {

namespace {

void check_split(const at::Tensor& split, int64_t n, int64_t k, const char* who) {
  TORCH_CHECK(k > 0 && k % kSplitBlockK == 0, who, ": k must be a multiple of ", kSplitBlockK);
  TORCH_CHECK(split.scalar_type() == at::kByte && split.is_contiguous() &&
                  split.numel() == split_total_bytes(strip_count(n), k),
              who, ": not a split [", n, ", ", k, "] Q8_0 table");
}

// Row `row` of the table into out [k]: d (16 h + l - 128) per weight, gguf's d q.
void split_row(const uint8_t* table, int64_t strips, int64_t k, int64_t row, float* out) {
  const int64_t blocks = k / kSplitBlockK, strip = row / kCols;
  const int c = static_cast<int>(row % kCols);
  const uint8_t* high = table + strip * blocks * kSplitHighBytes;
  const uint8_t* low = table + split_high_bytes(strips, k) + strip * blocks * kSplitLowBytes;
  for (int64_t b = 0; b < blocks; ++b, high += kSplitHighBytes, low += kSplitLowBytes) {
    const float d = half_to_float(read_u16(high + kSplitScaleAt + 2 * c));
    uint8_t u[kSplitBlockK];  // q + 128 = 16 h + l
    for (int j = 0; j < 4; ++j) {  // chunk j: planes 2 j (k = 8 j + i) and 2 j + 1 (8 j + 4 + i)
      uint32_t h4, l4;
      std::memcpy(&h4, high + 64 * j + 4 * c, 4);
      std::memcpy(&l4, low + 64 * j + 4 * c, 4);
      const uint32_t first = (h4 & 0x0F0F0F0Fu) << 4 | (l4 & 0x0F0F0F0Fu);
      const uint32_t second = (h4 & 0xF0F0F0F0u) | (l4 >> 4 & 0x0F0F0F0Fu);
      std::memcpy(u + 8 * j, &first, 4);  // little-endian: byte i is k = 8 j + i
      std::memcpy(u + 8 * j + 4, &second, 4);
    }
    float* w = out + b * kSplitBlockK;
    for (int kk = 0; kk < kSplitBlockK; ++kk) w[kk] = d * static_cast<float>(u[kk] - 128);
  }
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
  constexpr int kLanes = 8;  // independent sums, so that the dot vectorizes
  at::parallel_for(0, rows * per_row, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(k);
    for (int64_t i = begin; i < end; ++i) {
      split_row(table, strip_count(n), k, col[i], w.data());
      const float* xr = xs + i / per_row * k;
      float lanes[kLanes] = {};
      for (int64_t kk = 0; kk < k; kk += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += xr[kk + l] * w[kk + l];
      float sum = 0.f;
      for (int l = 0; l < kLanes; ++l) sum += lanes[l];
      dst[i] = sum;
    }
  });
  return out;
}

}  // namespace shoal_quant
