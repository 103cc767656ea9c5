// A Q8_0 output head split into its codes' two nibbles (models/layers/head.py): the head's
// estimate where no copy fits, in no memory of its own. Gemma 3's tied 262144 x 640 table
// (178 MB) leaves no room for a 4-bit copy (94 MB) inside the 1.2x file-size rule; its codes'
// high nibbles are one, and half the table to read. With u = q + 128 (0 .. 255, q Q8_0's
// signed code) and w = d q:
//   high nibble h = u >> 4 (0 .. 15): w ~ 16 d h - 120.5 d (the low nibble taken as 7.5);
//   low nibble l = u & 15:            w = d (16 h + l - 128), exactly gguf's value.
// The estimate reads the high part alone (288 of the table's 544 bytes per 16 x 32 weights,
// as many as Q8_0's strip layout holds) and the exact rows (the rescored candidates, the
// embedding's lookups) read both.
//
// Layout, blocks of 32 along k, strips of 16 rows (columns c of the matmul): first every
// strip's high blocks (288 bytes: the codes, then d [16] fp16), then every strip's low
// blocks (256 bytes: the codes), each part strip after strip, block after block. Codes as in
// a 4-bit head copy (quant_head_copy.h) of 8 "planes": plane p holds k = 4 p .. 4 p + 3 in
// byte 4 c + i (k = 4 p + i) of 64-byte chunk p / 2, the low nibble for even p.

#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace shoal_quant {

constexpr int kSplitBlockK = 32;
constexpr int kSplitHighBytes = 288;  // codes 256, d [16] fp16
constexpr int kSplitLowBytes = 256;
constexpr int kSplitScaleAt = 256;
// The estimate's minimum per unit of d: -128 d for the code offset, 7.5 d for the low
// nibble's mean.
constexpr float kSplitMinimum = -120.5f;

inline int64_t split_high_bytes(int64_t strips, int64_t k) {
  return strips * (k / kSplitBlockK) * kSplitHighBytes;
}
inline int64_t split_total_bytes(int64_t strips, int64_t k) {
  return strips * (k / kSplitBlockK) * (kSplitHighBytes + kSplitLowBytes);
}

// The file's bytes of a Q8_0 [n, k] weight (ggml's blocks, [n, k / 32 * 34]) -> its split
// table (a head that splits its table never holds the packed form beside it).
at::Tensor head_split_from_file(const at::Tensor& data, int64_t n, int64_t k);
// Rows `rows` [T] of a split table: float32 [T, k], gguf's values exactly.
at::Tensor head_split_rows(const at::Tensor& split, int64_t n, int64_t k, const at::Tensor& rows);
// out [S, C] = x [S, k] (bf16) times the split table's rows columns[s] [S, C]: each dot in
// float32, a block's 32 products in 16 lanes scaled into 16 lane sums, those summed last.
at::Tensor head_split_columns(const at::Tensor& split, int64_t n, int64_t k, const at::Tensor& x,
                              const at::Tensor& columns);

}  // namespace shoal_quant
