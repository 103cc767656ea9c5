// Reading and writing one strip of the layout in quant_formats.h a tile column at a time:
// the packer, the dequantizer (float32 loads, embedding rows, the head's copies), the float
// and IQ4 types' AVX2 path and the portable matmul use these; the vector kernels of the
// plane types read whole registers instead.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// Vector (0..15) and 16-bit word (0..31) of a tile that hold weight (k_in_tile, col): each
// column's lane carries two consecutive elements of one of AMX's summation chains (even or
// odd k), vector 2q + c holding k = 4q + c in its high word and k = 4q + c + 2 in its low
// word, so one vdpbf16ps advances that chain by two elements in AMX's order.
inline int vector_of(int k_in_tile) { return 2 * (k_in_tile / 4) + (k_in_tile & 1); }
inline int word_of(int k_in_tile, int col) { return 2 * col + ((k_in_tile & 2) ? 0 : 1); }

// A plane of W-bit fields packs per_word = 16 / W of them to a 16-bit word: vector p's field
// of word j lies in chunk p / per_word (64 bytes each), word j, bits (p % per_word) * W.
// Widths are template arguments and whole tiles go at once, so that the loops below compile
// to shifts and masks on words held in registers.

// Or-s bits [shift, shift + W) of column col's 32 codes in a tile (u[k], k in tile order)
// from a plane of W-bit fields.
template <int W>
inline void read_plane(const uint8_t* plane, int col, int shift, uint8_t* u) {
  constexpr int per_word = 16 / W, chunks = 16 / per_word;  // 16 vectors p per tile
  for (int half = 0; half < 2; ++half) {
    const int j = 2 * col + half;  // the even word holds k = kb(p) + 2, the odd one kb(p)
    uint8_t* out = u + (half ? 0 : 2);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      uint16_t bits;
      std::memcpy(&bits, plane + chunk * 64 + 2 * j, 2);
      for (int field = 0; field < per_word; ++field) {
        const int p = chunk * per_word + field;
        out[4 * (p / 2) + (p & 1)] |=
            static_cast<uint8_t>(((bits >> (field * W)) & ((1u << W) - 1)) << shift);
      }
    }
  }
}

// Column col's 32 codes u of a quantized tile of planes P.
template <Planes P>
inline void read_tile_codes(const uint8_t* tile, int col, uint8_t* u) {
  std::memset(u, 0, kTileK);
  if constexpr (P == Planes::kNibbles) read_plane<4>(tile, col, 0, u);
  if constexpr (P == Planes::kNibblesBits) {
    read_plane<4>(tile, col, 0, u);
    read_plane<1>(tile + 256, col, 4, u);
  }
  if constexpr (P == Planes::kNibblesCrumbs) {
    read_plane<4>(tile, col, 0, u);
    read_plane<2>(tile + 256, col, 4, u);
  }
  if constexpr (P == Planes::kCrumbs) read_plane<2>(tile, col, 0, u);
  if constexpr (P == Planes::kCrumbsBits) {
    read_plane<2>(tile, col, 0, u);
    read_plane<1>(tile + 128, col, 2, u);
  }
  if constexpr (P == Planes::kInt8)  // the signed byte u - 128
    for (int k = 0; k < kTileK; ++k) u[k] = tile[32 * vector_of(k) + word_of(k, col)] ^ 0x80;
}

// Writes bits [shift, shift + W) of tile t's codes of columns [0, columns) (codes[c].u[k]
// for the tile's k) into a plane of W-bit fields: each 16-bit word is assembled in a
// register and stored once (or-ing fields into memory one at a time waited on each store).
template <int W>
inline void write_plane(uint8_t* plane, const Codes* codes, int columns, int t, int shift) {
  constexpr int per_word = 16 / W, chunks = 16 / per_word;  // 16 vectors p per tile
  for (int j = 0; j < 2 * columns; ++j) {
    // word j: column j / 2, k = kb(p) + 2 in the even word, kb(p) in the odd (word_of)
    const uint8_t* u = codes[j / 2].u + t * kTileK + ((j & 1) ? 0 : 2);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      unsigned word = 0;
      for (int field = 0; field < per_word; ++field) {
        const int p = chunk * per_word + field;
        word |= ((u[4 * (p / 2) + (p & 1)] >> shift) & ((1u << W) - 1)) << (field * W);
      }
      const uint16_t bits = static_cast<uint16_t>(word);
      std::memcpy(plane + chunk * 64 + 2 * j, &bits, 2);
    }
  }
}

// Tile t of a super-block (codes[c] for column c < columns; the tile's other bytes stay
// as they are, zero) in planes P.
template <Planes P>
inline void write_tile_codes(uint8_t* tile, const Codes* codes, int columns, int t) {
  if constexpr (P == Planes::kNibbles) write_plane<4>(tile, codes, columns, t, 0);
  if constexpr (P == Planes::kNibblesBits) {
    write_plane<4>(tile, codes, columns, t, 0);
    write_plane<1>(tile + 256, codes, columns, t, 4);
  }
  if constexpr (P == Planes::kNibblesCrumbs) {
    write_plane<4>(tile, codes, columns, t, 0);
    write_plane<2>(tile + 256, codes, columns, t, 4);
  }
  if constexpr (P == Planes::kCrumbs) write_plane<2>(tile, codes, columns, t, 0);
  if constexpr (P == Planes::kCrumbsBits) {
    write_plane<2>(tile, codes, columns, t, 0);
    write_plane<1>(tile + 128, codes, columns, t, 2);
  }
  if constexpr (P == Planes::kInt8)  // the signed byte u - 128, stored in address order
    for (int p = 0; p < 16; ++p)
      for (int j = 0; j < 2 * columns; ++j)
        tile[32 * p + j] = codes[j / 2].u[t * kTileK + 4 * (p / 2) + (p & 1) + ((j & 1) ? 0 : 2)]
                           ^ 0x80;
}

// Calls fn(std::integral_constant<Planes, P>{}) for a quantized plane layout P (false for a
// float one): a loop over a whole tile or strip picks its planes once, outside the loop.
template <class Fn>
inline bool with_code_planes(Planes planes, Fn&& fn) {
  switch (planes) {
    case Planes::kNibbles: fn(std::integral_constant<Planes, Planes::kNibbles>{}); return true;
    case Planes::kNibblesBits:
      fn(std::integral_constant<Planes, Planes::kNibblesBits>{});
      return true;
    case Planes::kNibblesCrumbs:
      fn(std::integral_constant<Planes, Planes::kNibblesCrumbs>{});
      return true;
    case Planes::kCrumbs: fn(std::integral_constant<Planes, Planes::kCrumbs>{}); return true;
    case Planes::kCrumbsBits:
      fn(std::integral_constant<Planes, Planes::kCrumbsBits>{});
      return true;
    case Planes::kInt8: fn(std::integral_constant<Planes, Planes::kInt8>{}); return true;
    default: return false;
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
  const float d = d_to_float(f, read_u16(meta + pos.d + 2 * col));
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

// The value a code u stands for before its sub-block's scale: u + c, or the table's entry.
inline float code_value(const Format& f, int u) {
  return f.lut ? static_cast<float>(lut_values(f)[u]) : static_cast<float>(u + f.c);
}

// Column col of tile t of a strip: its 32 weights w, exactly as gguf's dequantization gives
// them (w = S (u + c) - e mc per sub-block, or the IQ4 table's entry times S).
inline void tile_column(const StripView& strip, int64_t t, int col, float* w) {
  const Format& f = strip.f;
  const uint8_t* tile = strip.tile(t);
  uint8_t u[kTileK];
  const bool quantized = with_code_planes(f.planes, [&](auto planes) {
    read_tile_codes<decltype(planes)::value>(tile, col, u);
  });
  if (!quantized) {
    for (int k = 0; k < kTileK; ++k) w[k] = read_float(f, tile, k, col);
    return;
  }
  for (int k0 = 0; k0 < kTileK; k0 += f.sub_k) {  // a tile holds one or two sub-blocks
    const int64_t at = t * kTileK + k0;
    const SubScale s = sub_scale(f, strip.meta(at / f.super_k),
                                 static_cast<int>(at % f.super_k) / f.sub_k, col);
    for (int k = k0; k < k0 + f.sub_k; ++k)
      w[k] = std::fmaf(s.scale, code_value(f, u[k]), s.minus_min);
  }
}

// Column col of a strip, weights [0, k), into dst.
inline void strip_column(const StripView& strip, int col, float* dst) {
  for (int64_t t = 0; t < strip.k / kTileK; ++t) tile_column(strip, t, col, dst + t * kTileK);
}

}  // namespace shoal_quant
