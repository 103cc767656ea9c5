// The output head's estimate copy (models/layers/head.py, quant_estimate.cpp): the head
// requantized to 3- or 4-bit codes with an fp16 scale and minimum per 64 weights (3.5 or 4.5
// bits a weight). Only the int8 estimate reads it, so its layout is the one that estimate
// wants, not the matmul's strip layout (quant_formats.h): a block's scales follow its codes,
// so a copy is read as one stream (~75 GB/s on a host where a strip layout's separate run of
// scales held a Q4_1 copy to ~50).
//
// Per strip of 16 rows (columns c of the matmul), per block of 64 along k, "plane" p = 0 ..
// 15 holds k = 4 p .. 4 p + 3, as byte i (k = 4 p + i) of column c's 32-bit lane: vpdpbusd's
// unsigned operand, after a shift and a mask or two.
//   4 bits (576 bytes): [0, 512) 64-byte chunk j, byte 4 c + i: plane 2 j in the low nibble,
//     plane 2 j + 1 in the high one;
//   3 bits (448 bytes): [0, 256) the low two bits, 64-byte chunk j, byte 4 c + i, bits
//     2 f .. 2 f + 1 for plane 4 j + f; [256, 384) the third bit, chunk h, byte 4 c + i,
//     bit b for plane 8 h + b;
//   then d [16] fp16 and m [16] fp16:  w = d u + m.

#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace shoal_quant {

constexpr int kCopyBlockK = 64;

struct CopyLayout {
  int bits, high_at, scale_at, min_at, block_bytes;
};

constexpr CopyLayout copy_layout(int bits) {
  return bits == 3 ? CopyLayout{3, 256, 384, 416, 448} : CopyLayout{4, -1, 512, 544, 576};
}

inline int64_t copy_strip_bytes(int bits, int64_t k) {
  return k / kCopyBlockK * copy_layout(bits).block_bytes;
}

// float32 [n, k] (k a multiple of 64) -> the copy's bytes: per 64 weights d = (max - min) /
// (2^bits - 1) and m = min in fp16, codes round((w - m) / d).
at::Tensor head_copy_pack(const at::Tensor& values, int64_t bits);
// The copy's weights d u + m as float32 [n, k] (tests).
at::Tensor head_copy_values(const at::Tensor& packed, int64_t n, int64_t k, int64_t bits);

}  // namespace shoal_quant
