// GGUF weight types as shoal keeps them: each type's block layout in the file, and the strip
// layout the matmul kernels read (quant_matmul.h).
//
// Every quantized GGUF type is an affine map of small unsigned codes per sub-block of 16 or
// 32 weights along the input dimension k:
//     w = S * u + O,   S = d * sc,   O = c * S - e * mc
// with u the weight's unsigned code (2 to 8 bits; Q8_0's is q + 128), d (and e) fp16 per
// block, sc / mc small integer codes per sub-block (K-quants) and c a constant of the type.
// IQ4 types and MXFP4 map a 4-bit code through a table instead (w = S * table[u]); MXFP4's
// S is a power of two (an E8M0 byte in the file), kept as bf16, which holds every one of
// them exactly (fp16 does not). These products
// are exact in float32, so dequantizing with fmaf(S, u + c, -e * mc) rounds once, as the
// gguf package does.
//
// The strip layout: output rows (columns of the matmul) in strips of 16; per strip, per
// 32-weight tile along k, the codes of the 16 x 32 weights in bit planes ordered for one
// 512-bit register per "vector" of a tile: lane c (32 bits) holds two of column c's weights,
// two consecutive elements of one of the chains AMX sums a tile op in (even k, odd k):
// vector v = 2q + c holds k = 4q + c in its high word and k = 4q + c + 2 in its low word
// (quant_strip.h, vector_of / word_of), so one vdpbf16ps advances a chain by two elements
// in AMX's order. AMX's B tiles want pairs (k, k + 1) instead; the AMX paths
// rearrange decoded vectors into those (quant_simd.h, to_pairs). Planes of a tile, for
// vector v and word j of a 64-byte chunk:
//   nibbles (4 bits, 256 bytes): v = 4 * chunk + n, bits 4n .. 4n + 3;
//   crumbs (2 bits, 128 bytes):  v = 8 * chunk + f, bits 2f .. 2f + 1;
//   bits (1 bit, 64 bytes):      bit v;
//   int8 (512 bytes):            vector v in bytes 32v .. 32v + 31, byte j;
//   bf16 / f16 (1024 bytes):     vector v in bytes 64v .. 64v + 63, word j;
//   f32 (2048 bytes):            vector v in bytes 128v .. 128v + 127, dword j.
// 5-bit codes are nibbles plus a bit plane (bit 4), 6-bit nibbles plus crumbs (bits 4-5),
// 3-bit crumbs plus bits (bit 2), 2-bit crumbs alone.

#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace shoal_quant {

// Numbering is shoal's own (Python passes it); names match gguf.GGMLQuantizationType.
enum class QType : int {
  kF32 = 0, kF16 = 1, kBF16 = 2,
  kQ4_0 = 3, kQ4_1 = 4, kQ5_0 = 5, kQ5_1 = 6, kQ8_0 = 7,
  kQ2_K = 8, kQ3_K = 9, kQ4_K = 10, kQ5_K = 11, kQ6_K = 12,
  kIQ4_NL = 13, kIQ4_XS = 14, kMXFP4 = 15,
};
constexpr int kNumTypes = 16;

constexpr int kCols = 16;   // output columns per strip: one fp32 lane each
constexpr int kTileK = 32;  // k per tile
constexpr int kPairs = kTileK / 2;

// How codes sit in a tile's planes.
enum class Planes { kNibbles, kNibblesBits, kNibblesCrumbs, kCrumbs, kCrumbsBits, kInt8,
                    kBF16, kF16, kF32 };

// One type's shapes. gguf_*: the file's block; super_k: k per super-block (a block of the
// file); sub_k: k per scale (16 or 32); has_e: a second fp16 per block (Q4_1 / Q5_1's m,
// K-quants' dmin); has_sc / has_mc: integer scale / min codes per sub-block; c: the type's
// code offset; lut: a table (lut_values) instead of an offset; bf16_d: d is kept as bf16
// bits, not fp16 (MXFP4's power-of-two scales).
struct Format {
  QType type;
  const char* name;
  int gguf_block_k, gguf_block_bytes;
  int super_k, sub_k;
  Planes planes;
  bool has_e, has_sc, has_mc, mc_in_sc, lut;
  int c;
  bool bf16_d = false;
};

// Q2_K packs its 4-bit scale and min codes into one byte (low nibble scale), as the file does.
inline constexpr Format kFormats[kNumTypes] = {
    {QType::kF32, "F32", 1, 4, 32, 32, Planes::kF32, false, false, false, false, false, 0},
    {QType::kF16, "F16", 1, 2, 32, 32, Planes::kF16, false, false, false, false, false, 0},
    {QType::kBF16, "BF16", 1, 2, 32, 32, Planes::kBF16, false, false, false, false, false, 0},
    {QType::kQ4_0, "Q4_0", 32, 18, 32, 32, Planes::kNibbles, false, false, false, false, false, -8},
    {QType::kQ4_1, "Q4_1", 32, 20, 32, 32, Planes::kNibbles, true, false, false, false, false, 0},
    {QType::kQ5_0, "Q5_0", 32, 22, 32, 32, Planes::kNibblesBits, false, false, false, false, false,
     -16},
    {QType::kQ5_1, "Q5_1", 32, 24, 32, 32, Planes::kNibblesBits, true, false, false, false, false,
     0},
    {QType::kQ8_0, "Q8_0", 32, 34, 32, 32, Planes::kInt8, false, false, false, false, false,
     -128},
    {QType::kQ2_K, "Q2_K", 256, 84, 256, 16, Planes::kCrumbs, true, true, true, true, false, 0},
    {QType::kQ3_K, "Q3_K", 256, 110, 256, 16, Planes::kCrumbsBits, false, true, false, false,
     false, -4},
    {QType::kQ4_K, "Q4_K", 256, 144, 256, 32, Planes::kNibbles, true, true, true, false, false, 0},
    {QType::kQ5_K, "Q5_K", 256, 176, 256, 32, Planes::kNibblesBits, true, true, true, false, false,
     0},
    {QType::kQ6_K, "Q6_K", 256, 210, 256, 16, Planes::kNibblesCrumbs, false, true, false, false,
     false, -32},
    {QType::kIQ4_NL, "IQ4_NL", 32, 18, 32, 32, Planes::kNibbles, false, false, false, false, true,
     0},
    {QType::kIQ4_XS, "IQ4_XS", 256, 136, 256, 32, Planes::kNibbles, false, true, false, false, true,
     0},
    {QType::kMXFP4, "MXFP4", 32, 17, 32, 32, Planes::kNibbles, false, false, false, false, true, 0,
     true},
};

inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};
// MXFP4's E2M1 values doubled, as ggml keeps them (its scale is halved to match).
inline constexpr int8_t kMXFP4Values[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                            0, -1, -2, -3, -4, -6, -8, -12};

// The table a lut type's codes index.
constexpr const int8_t* lut_values(const Format& f) {
  return f.type == QType::kMXFP4 ? kMXFP4Values : kIQ4Values;
}

constexpr const Format& format_of(QType type) { return kFormats[static_cast<int>(type)]; }

constexpr int plane_bytes(Planes planes) {
  switch (planes) {
    case Planes::kNibbles: return 256;
    case Planes::kNibblesBits: return 256 + 64;
    case Planes::kNibblesCrumbs: return 256 + 128;
    case Planes::kCrumbs: return 128;
    case Planes::kCrumbsBits: return 128 + 64;
    case Planes::kInt8: return 512;
    case Planes::kBF16: return 1024;
    case Planes::kF16: return 1024;
    case Planes::kF32: return 2048;
  }
  return 0;
}

constexpr bool is_float(Planes planes) {
  return planes == Planes::kBF16 || planes == Planes::kF16 || planes == Planes::kF32;
}

// Meta bytes per super-block of a strip: d [16] fp16, e [16] fp16, sc [subs][16] int8,
// mc [subs][16] uint8 (absent when a type lacks them).
constexpr int meta_bytes(const Format& f) {
  if (is_float(f.planes)) return 0;
  const int subs = f.super_k / f.sub_k;
  return 2 * kCols + (f.has_e ? 2 * kCols : 0) + (f.has_sc ? subs * kCols : 0) +
         (f.has_mc && !f.mc_in_sc ? subs * kCols : 0);
}

// Bytes of one strip: its tiles' planes, then its super-blocks' meta, padded to 64 bytes.
inline int64_t strip_bytes(const Format& f, int64_t k) {
  const int64_t planes = k / kTileK * plane_bytes(f.planes);
  const int64_t meta = k / f.super_k * meta_bytes(f);
  return (planes + meta + 63) / 64 * 64;
}

inline int64_t strip_count(int64_t n) { return (n + kCols - 1) / kCols; }

// One super-block of one row, as codes.
struct Codes {
  uint8_t u[256];
  int8_t sc[16];   // scale code per sub-block (signed: Q3_K and IQ4_XS subtract 32)
  uint8_t mc[16];  // min code per sub-block
  uint16_t d, e;   // fp16 bits (e already negated where the file adds it); d bf16 if bf16_d
  float raw[256];  // float types: the values themselves
};

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, 4);
  return v;
}

// A block's d as float: fp16 bits, or bf16 bits for bf16_d types.
inline float d_to_float(const Format& f, uint16_t bits) {
  return f.bf16_d ? bf16_to_float(bits) : half_to_float(bits);
}

// The K-quants' 6-bit scale and min of sub-block j from their 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The codes of one file block (the GGML layouts; gguf.quants.dequantize is the reference).
void read_block(QType type, const uint8_t* block, Codes& out);

}  // namespace shoal_quant
