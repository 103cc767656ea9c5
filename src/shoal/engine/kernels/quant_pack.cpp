// GGUF blocks to codes, codes to strips, and strips back to float32 (quant_formats.h).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "quant.h"
#include "quant_strip.h"

namespace shoal_quant {

namespace {

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL: 32 weights, the low nibble of byte j is weight j and
// the high nibble weight j + 16; Q5's fifth bits are a little-endian uint32 (bit i: weight i).
void read_small(const Format& f, const uint8_t* block, Codes& out) {
  out.d = read_u16(block);
  int at = 2;
  if (f.has_e) {
    out.e = read_u16(block + at) ^ 0x8000;  // the file adds m: e = -m
    at += 2;
  }
  uint32_t high = 0;
  if (f.planes == Planes::kNibblesBits) {
    std::memcpy(&high, block + at, 4);
    at += 4;
  }
  const uint8_t* qs = block + at;
  for (int j = 0; j < 16; ++j) {
    out.u[j] = (qs[j] & 0xF) | (((high >> j) & 1) << 4);
    out.u[j + 16] = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
  }
}

void read_q8_0(const uint8_t* block, Codes& out) {
  out.d = read_u16(block);
  for (int j = 0; j < 32; ++j)
    out.u[j] = static_cast<uint8_t>(static_cast<int8_t>(block[2 + j]) + 128);
}

// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin. Each half of 128
// weights reads 32 bytes of qs four times at shifts 0, 2, 4, 6, 16 weights per sub-block.
void read_q2_k(const uint8_t* block, Codes& out) {
  const uint8_t* scales = block;
  const uint8_t* qs = block + 16;
  out.d = read_u16(block + 80);
  out.e = read_u16(block + 82);
  for (int s = 0; s < 16; ++s) out.sc[s] = static_cast<int8_t>(scales[s]);  // packed scale|min
  int y = 0;
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = qs + 32 * half;
    for (int shift = 0; shift < 8; shift += 2)
      for (int l = 0; l < 32; ++l) out.u[y++] = (q[l] >> shift) & 3;
  }
}

// Q3_K: hmask[32], qs[64], scales[12] (sixteen 6-bit codes), d. The high bit set means the
// code keeps its value; clear means minus 4 (u = low + 4 * high, value = u - 4).
void read_q3_k(const uint8_t* block, Codes& out) {
  const uint8_t* hmask = block;
  const uint8_t* qs = block + 32;
  out.d = read_u16(block + 108);
  uint32_t aux[4];
  std::memcpy(aux, block + 96, 12);
  const uint32_t tmp = aux[2], low4 = 0x0f0f0f0f, low2 = 0x03030303;
  aux[2] = ((aux[0] >> 4) & low4) | (((tmp >> 4) & low2) << 4);
  aux[3] = ((aux[1] >> 4) & low4) | (((tmp >> 6) & low2) << 4);
  aux[0] = (aux[0] & low4) | (((tmp >> 0) & low2) << 4);
  aux[1] = (aux[1] & low4) | (((tmp >> 2) & low2) << 4);
  int8_t codes[16];
  std::memcpy(codes, aux, 16);
  for (int s = 0; s < 16; ++s) out.sc[s] = static_cast<int8_t>(codes[s] - 32);
  int y = 0;
  uint8_t m = 1;
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = qs + 32 * half;
    for (int shift = 0; shift < 8; shift += 2, m <<= 1)
      for (int l = 0; l < 32; ++l)
        out.u[y++] = ((q[l] >> shift) & 3) | ((hmask[l] & m) ? 4 : 0);
  }
}

// Q4_K / Q5_K: d, dmin, scales[12] (eight 6-bit scale and min codes), (qh[32]), qs[128].
// Each 64 weights take 32 bytes of qs: low nibbles then high nibbles; Q5's fifth bits come
// from qh at bits 2i and 2i + 1 for the i-th 64.
void read_q45_k(const Format& f, const uint8_t* block, Codes& out) {
  out.d = read_u16(block);
  out.e = read_u16(block + 2);
  const uint8_t* scales = block + 4;
  const bool five = f.planes == Planes::kNibblesBits;
  const uint8_t* qh = block + 16;
  const uint8_t* ql = block + (five ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, mn;
    scale_min_k4(s, scales, &sc, &mn);
    out.sc[s] = static_cast<int8_t>(sc);
    out.mc[s] = mn;
  }
  for (int i = 0; i < 4; ++i)
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = ql[32 * i + l];
      int lo = byte & 0xF, hi = byte >> 4;
      if (five) {
        lo |= ((qh[l] >> (2 * i)) & 1) << 4;
        hi |= ((qh[l] >> (2 * i + 1)) & 1) << 4;
      }
      out.u[64 * i + l] = static_cast<uint8_t>(lo);
      out.u[64 * i + 32 + l] = static_cast<uint8_t>(hi);
    }
}

// Q6_K: ql[128], qh[64], scales[16] (int8), d. Each half of 128 weights: 64 bytes of ql, 32 of
// qh; value = u - 32.
void read_q6_k(const uint8_t* block, Codes& out) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  std::memcpy(out.sc, block + 192, 16);
  out.d = read_u16(block + 208);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* l_ = ql + 64 * half;
    const uint8_t* h_ = qh + 32 * half;
    uint8_t* y = out.u + 128 * half;
    for (int l = 0; l < 32; ++l) {
      y[l] = (l_[l] & 0xF) | (((h_[l] >> 0) & 3) << 4);
      y[l + 32] = (l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4);
      y[l + 64] = (l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4);
      y[l + 96] = (l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4);
    }
  }
}

// IQ4_XS: d, scales_h (uint16), scales_l[4], qs[128]; eight 32-weight sub-blocks with 6-bit
// scale codes minus 32, nibbles as IQ4_NL's.
void read_iq4_xs(const uint8_t* block, Codes& out) {
  out.d = read_u16(block);
  const uint16_t scales_h = read_u16(block + 2);
  const uint8_t* scales_l = block + 4;
  const uint8_t* qs = block + 8;
  for (int s = 0; s < 8; ++s) {
    const int low = (scales_l[s / 2] >> (4 * (s % 2))) & 0xF;
    const int high = (scales_h >> (2 * s)) & 3;
    out.sc[s] = static_cast<int8_t>((low | (high << 4)) - 32);
    for (int j = 0; j < 16; ++j) {
      out.u[32 * s + j] = qs[16 * s + j] & 0xF;
      out.u[32 * s + j + 16] = qs[16 * s + j] >> 4;
    }
  }
}

// MXFP4: an E8M0 byte e, then 16 bytes of nibbles as IQ4_NL's. ggml's scale is 2^(e - 128)
// (half of E8M0's 2^(e - 127): its table holds doubled values), kept as bf16 bits: exponent
// field e - 1, or for e < 2 the subnormals 2^-127 and 2^-128.
void read_mxfp4(const uint8_t* block, Codes& out) {
  const int e = block[0];
  out.d = static_cast<uint16_t>(e < 2 ? 0x0020 << e : (e - 1) << 7);
  const uint8_t* qs = block + 1;
  for (int j = 0; j < 16; ++j) {
    out.u[j] = qs[j] & 0xF;
    out.u[j + 16] = qs[j] >> 4;
  }
}

void read_floats(QType type, const uint8_t* data, Codes& out) {
  for (int j = 0; j < 32; ++j) {
    if (type == QType::kF32) {
      std::memcpy(&out.raw[j], data + 4 * j, 4);
    } else if (type == QType::kF16) {
      out.raw[j] = half_to_float(read_u16(data + 2 * j));
    } else {
      const uint32_t wide = static_cast<uint32_t>(read_u16(data + 2 * j)) << 16;
      std::memcpy(&out.raw[j], &wide, 4);
    }
  }
}

// Writes one super-block of 16 columns (codes[c] for column c; absent columns are zero).
void write_super_block(const Format& f, const Codes* codes, int columns, uint8_t* tiles,
                       uint8_t* meta) {
  const int tiles_here = f.super_k / kTileK;
  const int bytes = plane_bytes(f.planes);
  std::memset(tiles, 0, static_cast<size_t>(tiles_here) * bytes);
  const bool quantized = with_code_planes(f.planes, [&](auto planes) {
    for (int t = 0; t < tiles_here; ++t)
      write_tile_codes<decltype(planes)::value>(tiles + t * bytes, codes, columns, t);
  });
  if (!quantized) {
    for (int t = 0; t < tiles_here; ++t) {
      uint8_t* tile = tiles + t * bytes;
      for (int c = 0; c < columns; ++c)
        for (int k = 0; k < kTileK; ++k) {
          const float value = codes[c].raw[t * kTileK + k];
          if (f.planes == Planes::kF32) {
            std::memcpy(tile + 128 * vector_of(k) + 4 * word_of(k, c), &value, 4);
            continue;
          }
          const uint16_t bits = f.planes == Planes::kBF16
                                    ? c10::BFloat16(value).x  // exact: the values were bf16
                                    : c10::Half(value).x;     // exact: the values were fp16
          std::memcpy(tile + 64 * vector_of(k) + 2 * word_of(k, c), &bits, 2);
        }
    }
    return;
  }
  std::memset(meta, 0, meta_bytes(f));
  const MetaPos pos = meta_pos(f);
  const int subs = f.super_k / f.sub_k;
  for (int c = 0; c < columns; ++c) {
    std::memcpy(meta + pos.d + 2 * c, &codes[c].d, 2);
    if (f.has_e) std::memcpy(meta + pos.e + 2 * c, &codes[c].e, 2);
    for (int s = 0; s < subs; ++s) {
      if (f.has_sc) meta[pos.sc + s * kCols + c] = static_cast<uint8_t>(codes[c].sc[s]);
      if (f.has_mc && !f.mc_in_sc) meta[pos.mc + s * kCols + c] = codes[c].mc[s];
    }
  }
}

void check_shape(const Format& f, int64_t n, int64_t k) {
  TORCH_CHECK(n >= 1 && k >= 1, "quant: empty weight");
  TORCH_CHECK(k % f.super_k == 0 && k % kTileK == 0, "quant: ", f.name, " needs the input size ",
              "to be a multiple of ", f.super_k, ", not ", k);
}

}  // namespace

void read_block(QType type, const uint8_t* block, Codes& out) {
  const Format& f = format_of(type);
  switch (type) {
    case QType::kQ4_0: case QType::kQ4_1: case QType::kQ5_0: case QType::kQ5_1:
    case QType::kIQ4_NL:
      read_small(f, block, out);
      break;
    case QType::kQ8_0: read_q8_0(block, out); break;
    case QType::kQ2_K: read_q2_k(block, out); break;
    case QType::kQ3_K: read_q3_k(block, out); break;
    case QType::kQ4_K: case QType::kQ5_K: read_q45_k(f, block, out); break;
    case QType::kQ6_K: read_q6_k(block, out); break;
    case QType::kIQ4_XS: read_iq4_xs(block, out); break;
    case QType::kMXFP4: read_mxfp4(block, out); break;
    default: read_floats(type, block, out); break;
  }
}

QType qtype(int64_t code) {
  TORCH_CHECK(code >= 0 && code < kNumTypes, "quant: unknown weight type ", code);
  return static_cast<QType>(code);
}

at::Tensor pack(int64_t type_code, const at::Tensor& raw, int64_t n, int64_t k) {
  const Format& f = format_of(qtype(type_code));
  check_shape(f, n, k);
  const int64_t row_bytes = k / f.gguf_block_k * f.gguf_block_bytes;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == n * row_bytes,
              "quant: ", f.name, " [", n, ", ", k, "] needs ", n * row_bytes, " contiguous bytes");
  const int64_t strips = strip_count(n), per_strip = strip_bytes(f, k);
  at::Tensor out = at::zeros({strips * per_strip}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t blocks = k / f.super_k;
  const int64_t super_bytes = f.super_k / f.gguf_block_k * f.gguf_block_bytes;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    std::vector<Codes> codes(kCols);
    for (int64_t s = begin; s < end; ++s) {
      const int columns = static_cast<int>(std::min<int64_t>(kCols, n - s * kCols));
      uint8_t* strip = dst + s * per_strip;
      StripView view{f, k, strip};
      for (int64_t b = 0; b < blocks; ++b) {
        for (int c = 0; c < columns; ++c)
          read_block(f.type, src + (s * kCols + c) * row_bytes + b * super_bytes, codes[c]);
        const int64_t first_tile = b * f.super_k / kTileK;
        write_super_block(f, codes.data(), columns, strip + first_tile * plane_bytes(f.planes),
                          const_cast<uint8_t*>(view.meta(b)));
      }
    }
  });
  return out;
}

at::Tensor dequantize_rows(int64_t type_code, const at::Tensor& packed, int64_t n, int64_t k,
                           const at::Tensor& rows) {
  const Format& f = format_of(qtype(type_code));
  check_shape(f, n, k);
  const int64_t per_strip = strip_bytes(f, k);
  TORCH_CHECK(packed.numel() == strip_count(n) * per_strip, "quant: packed size mismatch");
  const at::Tensor ids = rows.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  at::Tensor out = at::empty({ids.numel(), k}, packed.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  at::parallel_for(0, ids.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < n, "quant: row ", id[i], " out of range");
      const StripView strip{f, k, base + id[i] / kCols * per_strip};
      const int col = static_cast<int>(id[i] % kCols);
      strip_column(strip, col, dst + i * k);
    }
  });
  return out;
}

at::Tensor dequantize(int64_t type_code, const at::Tensor& packed, int64_t n, int64_t k) {
  return dequantize_rows(type_code, packed, n, k, at::arange(n, packed.options().dtype(at::kLong)));
}

int64_t packed_bytes(int64_t type_code, int64_t n, int64_t k) {
  const Format& f = format_of(qtype(type_code));
  return strip_count(n) * strip_bytes(f, k);
}

}  // namespace shoal_quant
