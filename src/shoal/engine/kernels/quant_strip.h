// Reading and writing one strip of the layout in quant_formats.h, element by element: the
// packer, the dequantizer (tests, embedding rows) and the portable matmul use these; the
// vector kernels (quant_matmul.cpp) read whole registers instead.

#pragma once

#include <cmath>
#include <cstdint>

#include "quant_formats.h"

namespace shoal_quant {

// Where tile t's planes and super-block b's meta lie in a strip of k columns.
struct StripView {
  const Format& f;
  int64_t k;
  const uint8_t* base;

  const uint8_t* tile(int64_t t) const { return base + t * plane_bytes(f.planes); }
  const uint8_t* meta(int64_t b) const {
    return base + k / kTileK * plane_bytes(f.planes) + b * meta_bytes(f);
  }
};

// Byte and shift of pair p's field of `width` bits for word j, in a plane of fields packed
// `per_word` to a 16-bit word (chunks of 64 bytes, pair p = per_word * chunk + field).
struct FieldPos {
  int byte, shift;
};

inline FieldPos field_pos(int p, int j, int width) {
  const int per_word = 16 / width;
  const int chunk = p / per_word, field = p % per_word;
  const int bit = field * width;
  return {chunk * 64 + 2 * j + bit / 8, bit % 8};
}

// Vector (0..15) and 16-bit word (0..31) of a tile that hold weight (k_in_tile, col): each
// column's lane carries two consecutive elements of one of AMX's summation chains (even or
// odd k), vector 2q + c holding k = 4q + c in its high word and k = 4q + c + 2 in its low
// word, so one vdpbf16ps advances that chain by two elements in AMX's order.
inline int vector_of(int k_in_tile) { return 2 * (k_in_tile / 4) + (k_in_tile & 1); }
inline int word_of(int k_in_tile, int col) { return 2 * col + ((k_in_tile & 2) ? 0 : 1); }

inline int read_field(const uint8_t* plane, int p, int j, int width) {
  const FieldPos pos = field_pos(p, j, width);
  return (plane[pos.byte] >> pos.shift) & ((1 << width) - 1);
}

inline void write_field(uint8_t* plane, int p, int j, int width, int value) {
  const FieldPos pos = field_pos(p, j, width);
  plane[pos.byte] |= static_cast<uint8_t>((value & ((1 << width) - 1)) << pos.shift);
}

// The code u of weight (k_in_tile, col) in a quantized tile.
inline int read_code(const Format& f, const uint8_t* tile, int k_in_tile, int col) {
  const int p = vector_of(k_in_tile), j = word_of(k_in_tile, col);
  switch (f.planes) {
    case Planes::kNibbles: return read_field(tile, p, j, 4);
    case Planes::kNibblesBits:
      return read_field(tile, p, j, 4) | read_field(tile + 256, p, j, 1) << 4;
    case Planes::kNibblesCrumbs:
      return read_field(tile, p, j, 4) | read_field(tile + 256, p, j, 2) << 4;
    case Planes::kCrumbs: return read_field(tile, p, j, 2);
    case Planes::kCrumbsBits:
      return read_field(tile, p, j, 2) | read_field(tile + 128, p, j, 1) << 2;
    case Planes::kInt8: return static_cast<int>(static_cast<int8_t>(tile[32 * p + j])) + 128;
    default: return 0;
  }
}

inline void write_code(const Format& f, uint8_t* tile, int k_in_tile, int col, int u) {
  const int p = vector_of(k_in_tile), j = word_of(k_in_tile, col);
  switch (f.planes) {
    case Planes::kNibbles: write_field(tile, p, j, 4, u); break;
    case Planes::kNibblesBits:
      write_field(tile, p, j, 4, u);
      write_field(tile + 256, p, j, 1, u >> 4);
      break;
    case Planes::kNibblesCrumbs:
      write_field(tile, p, j, 4, u);
      write_field(tile + 256, p, j, 2, u >> 4);
      break;
    case Planes::kCrumbs: write_field(tile, p, j, 2, u); break;
    case Planes::kCrumbsBits:
      write_field(tile, p, j, 2, u);
      write_field(tile + 128, p, j, 1, u >> 2);
      break;
    case Planes::kInt8:
      tile[32 * p + j] = static_cast<uint8_t>(static_cast<int8_t>(u - 128));
      break;
    default: break;
  }
}

// A float tile's value of weight (k_in_tile, col).
inline float read_float(const Format& f, const uint8_t* tile, int k_in_tile, int col) {
  const int p = vector_of(k_in_tile), j = word_of(k_in_tile, col);
  if (f.planes == Planes::kF32) {
    float v;
    std::memcpy(&v, tile + 128 * p + 4 * j, 4);
    return v;
  }
  const uint16_t bits = read_u16(tile + 64 * p + 2 * j);
  if (f.planes == Planes::kF16) return half_to_float(bits);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, 4);
  return v;
}

// Meta of one super-block: offsets of d, e, sc, mc.
struct MetaPos {
  int d, e, sc, mc;
};

inline MetaPos meta_pos(const Format& f) {
  const int subs = f.super_k / f.sub_k;
  MetaPos pos{0, -1, -1, -1};
  int at = 2 * kCols;
  if (f.has_e) pos.e = at, at += 2 * kCols;
  if (f.has_sc) pos.sc = at, at += subs * kCols;
  if (f.has_mc) pos.mc = f.mc_in_sc ? pos.sc : at;
  return pos;
}

// The scale S and offset O (w = S * value + O, value = u + c, or the IQ4 table's entry) of
// column col in sub-block s of a super-block's meta. O is returned without c: the caller
// adds c * S where it needs it.
struct SubScale {
  float scale, minus_min;  // S, and -e * mc (0 when the type has no e)
};

inline SubScale sub_scale(const Format& f, const uint8_t* meta, int s, int col) {
  const MetaPos pos = meta_pos(f);
  const float d = half_to_float(read_u16(meta + pos.d + 2 * col));
  int sc = 1;
  if (f.has_sc) {
    const int8_t code = static_cast<int8_t>(meta[pos.sc + s * kCols + col]);
    sc = f.mc_in_sc ? (static_cast<uint8_t>(code) & 0xF) : code;
  }
  SubScale out{d * static_cast<float>(sc), 0.f};
  if (f.has_e) {
    const float e = half_to_float(read_u16(meta + pos.e + 2 * col));
    int mc = 1;
    if (f.has_mc) {
      const uint8_t code = meta[pos.mc + s * kCols + col];
      mc = f.mc_in_sc ? code >> 4 : code;
    }
    out.minus_min = -e * static_cast<float>(mc);
  }
  return out;
}

// Weight (k, col) of a strip, exactly as gguf's dequantization gives it.
inline float weight_at(const StripView& strip, int64_t k, int col) {
  const Format& f = strip.f;
  const uint8_t* tile = strip.tile(k / kTileK);
  const int in_tile = static_cast<int>(k % kTileK);
  if (is_float(f.planes)) return read_float(f, tile, in_tile, col);
  const int64_t block = k / f.super_k;
  const int sub = static_cast<int>(k % f.super_k) / f.sub_k;
  const SubScale s = sub_scale(f, strip.meta(block), sub, col);
  const int u = read_code(f, tile, in_tile, col);
  const float value = f.lut ? static_cast<float>(kIQ4Values[u]) : static_cast<float>(u + f.c);
  return std::fmaf(s.scale, value, s.minus_min);
}

}  // namespace shoal_quant
