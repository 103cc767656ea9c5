// QuantLinear on AVX2 (quant_avx2.h): how a forward call's rows and strips are split over
// torch's threads. Built wherever the compiler targets AVX2 with FMA and F16C, AVX-512
// machines included, so that both paths are tested there.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant.h"

#if SHOAL_QUANT_AVX2
#include "quant_avx2.h"
#endif

namespace shoal_quant {

using bf16 = at::BFloat16;

bool avx2_available() { return SHOAL_QUANT_AVX2; }

#if SHOAL_QUANT_AVX2

namespace {

// Generated rows per pass over tiles decoded in registers: 4 rows' 8 accumulators, their 4
// int32 sums of one half, a code vector and x's pair in the 16 registers.
constexpr int kAvx2Rows = 4;
// More rows (prompts, and batches of generated rows) unpack a group of strips' codes a chunk
// of k at a time and run passes of this many rows over them: 12 int32 sums (6 rows, both
// halves) beside two code vectors and x's pair.
constexpr int kUnpackRows = 6;
// Dequantized and unpacked paths: strips per group, k per chunk (a group's chunks, 4 x 1024
// x 64 bytes of floats or 4 x 1024 x 32 of codes and their scales, stay in L2 while every
// block of rows runs over them; a block's x, 6 x 1024 floats or int16, in L1), rows per
// block.
constexpr int kGroupStrips = 4;
constexpr int64_t kChunkK = 1024;
constexpr int kBlockRows = 6;

using GeneratedFn = void (*)(const uint8_t*, int64_t, const X16&, const float*, int64_t,
                             float*);
using UnpackFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, __m256i*);
using UnpackedFn = void (*)(const __m256i*, int64_t, int64_t, const X16&, const float*,
                            int64_t, float*);
using DequantizeFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, float*);
using RowsFn = void (*)(const float*, int64_t, const float*, int64_t, float*);

struct Avx2Kernels {
  GeneratedFn generated[kAvx2Rows] = {};  // [rows - 1]
  UnpackFn unpack = nullptr;
  UnpackedFn unpacked[kUnpackRows] = {};  // [rows - 1]
  int unpacked_tile = 0;  // vectors per unpacked tile
  DequantizeFn dequantize = nullptr;  // float and IQ4 types
  bool buffered = false;  // float and IQ4 types: dequantized for every row
  int sub_k = 32;
};

template <QType T>
Avx2Kernels avx2_kernels_of() {
  using A = Avx2<T>;
  Avx2Kernels out;
  out.buffered = A::kBuffered;
  out.sub_k = A::f.sub_k;
  if constexpr (A::kBuffered) {
    out.dequantize = &avx2_dequantize<T>;
  } else {
    static_for<kAvx2Rows>([&](auto r) { out.generated[r] = &avx2_generated<T, r + 1>; });
    out.unpack = &avx2_unpack<T>;
    out.unpacked_tile = A::kUnpackedTile;
    static_for<kUnpackRows>([&](auto r) { out.unpacked[r] = &avx2_unpacked<T, r + 1>; });
  }
  return out;
}

const Avx2Kernels& avx2_kernels(QType type) {
  static const Avx2Kernels table[kNumTypes] = {
      avx2_kernels_of<QType::kF32>(),    avx2_kernels_of<QType::kF16>(),
      avx2_kernels_of<QType::kBF16>(),   avx2_kernels_of<QType::kQ4_0>(),
      avx2_kernels_of<QType::kQ4_1>(),   avx2_kernels_of<QType::kQ5_0>(),
      avx2_kernels_of<QType::kQ5_1>(),   avx2_kernels_of<QType::kQ8_0>(),
      avx2_kernels_of<QType::kQ2_K>(),   avx2_kernels_of<QType::kQ3_K>(),
      avx2_kernels_of<QType::kQ4_K>(),   avx2_kernels_of<QType::kQ5_K>(),
      avx2_kernels_of<QType::kQ6_K>(),   avx2_kernels_of<QType::kIQ4_NL>(),
      avx2_kernels_of<QType::kIQ4_XS>(),  avx2_kernels_of<QType::kMXFP4>(),
  };
  return table[static_cast<int>(type)];
}

constexpr RowsFn kRows[kBlockRows] = {&avx2_rows<1>, &avx2_rows<2>, &avx2_rows<3>,
                                      &avx2_rows<4>, &avx2_rows<5>, &avx2_rows<6>};

// x [m, k] bf16 -> float32 (exact).
std::vector<float> to_float(const bf16* x, int64_t m, int64_t k) {
  std::vector<float> out(m * k);
  at::parallel_for(0, m * k, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = static_cast<float>(x[i]);
  });
  return out;
}

// x [m, k] as generated rows' int16 pairs and tile scales (quant_avx2.h, X16): q = x /
// 2^(e - 14), e the largest exponent of the tile's 32 values. A bf16 value within 2^7 of the
// tile's largest is exact; a smaller one rounds to a multiple of 2^(e - 14), at most 2^-15
// of the largest value away (bf16's own rounding moves the largest by up to 2^-9).
struct X16Buffers {
  std::vector<int32_t> pairs;
  std::vector<float> scales;
  X16 view(int64_t row, int64_t k) const {
    return {pairs.data() + row * (k / 2), scales.data() + row * (k / kTileK), k / 2,
            k / kTileK};
  }
};

// 2^n as a float (n within float's normal exponents).
inline float power_of_two(int n) {
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

X16Buffers avx2_x16(const std::vector<float>& x, int64_t m, int64_t k) {
  X16Buffers out{std::vector<int32_t>(m * k / 2), std::vector<float>(m * k / kTileK)};
  at::parallel_for(0, m * (k / kTileK), 256, [&](int64_t begin, int64_t end) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t tile = begin; tile < end; ++tile) {
      const float* from = x.data() + tile * kTileK;
      __m256 v[4], largest = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(from + 8 * i);
        largest = _mm256_max_ps(largest, _mm256_and_ps(v[i], magnitude));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, largest);
      const float top = *std::max_element(lanes, lanes + 8);
      // top < 2^e with e its exponent + 1; q = x * 2^(15 - e) rounds to nearest even.
      uint32_t bits;
      std::memcpy(&bits, &top, sizeof bits);
      const int e = static_cast<int>(bits >> 23) - 126;
      const int shift = top > 0.f && bits >> 23 != 0 ? std::clamp(15 - e, -126, 126) : 0;
      out.scales[tile] = power_of_two(-shift);
      const __m256 to_q = _mm256_set1_ps(power_of_two(shift));
      alignas(32) int32_t q[kTileK];
      for (int i = 0; i < 4; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i),
                           _mm256_cvtps_epi32(_mm256_mul_ps(v[i], to_q)));
      int32_t* pairs = out.pairs.data() + tile * kPairs;
      for (int p = 0; p < kPairs; ++p)
        pairs[p] = (q[pair_k(p) + 2] & 0xFFFF) |
                   static_cast<int32_t>(static_cast<uint32_t>(q[pair_k(p)]) << 16);
    }
  });
  return out;
}

}  // namespace

// Strips [begin, end) of one segment for every row, on dequantized weights: groups of
// strips, a chunk of k at a time.
void QuantLinear::avx2_dequantized(const Call& call, const Segment& seg, int64_t begin,
                                   int64_t end, const float* x) const {
  const Avx2Kernels& kern = avx2_kernels(seg.type);
  const int64_t m = call.m, k = k_;
  const int64_t chunk = std::min(k, kChunkK);
  thread_local std::vector<float> weights, acc;
  weights.resize(kGroupStrips * chunk * kCols);
  for (int64_t g0 = begin; g0 < end; g0 += kGroupStrips) {
    const int strips = static_cast<int>(std::min<int64_t>(kGroupStrips, end - g0));
    acc.assign(strips * m * kCols, 0.f);
    for (int64_t k0 = 0; k0 < k; k0 += chunk) {
      const int64_t kc = std::min(chunk, k - k0);
      for (int s = 0; s < strips; ++s)
        kern.dequantize(
            seg.packed.data_ptr<uint8_t>() + (g0 - seg.first_strip + s) * seg.strip_bytes, k,
            k0 / kTileK, (k0 + kc) / kTileK, weights.data() + s * chunk * kCols);
      for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, m - r0));
        for (int s = 0; s < strips; ++s)
          kRows[rows - 1](x + r0 * k + k0, k, weights.data() + s * chunk * kCols, kc,
                          acc.data() + (s * m + r0) * kCols);
      }
    }
    for (int s = 0; s < strips; ++s)
      store(call, seg, g0 - seg.first_strip + s, acc.data() + s * m * kCols,
            static_cast<int>(m), 0);
  }
}

void QuantLinear::run_avx2(const Call& call) const {
  const int64_t m = call.m, k = k_;
  const std::vector<float> x = to_float(call.x, m, k);
  // Rows of the plane types: x as int16 pairs, and its sums per sub-block where a type with
  // a min reads them.
  bool any_planes = false;
  for (const Segment& seg : segments_) any_planes |= !avx2_kernels(seg.type).buffered;
  X16Buffers x16;
  std::vector<float> sums16, sums32;
  if (any_planes) {
    x16 = avx2_x16(x, m, k);
    if (mins16_) sums16 = run_sums(call.x, m, k, 16);
    if (mins32_) sums32 = run_sums(call.x, m, k, 32);
  }
  const int64_t grain = std::max<int64_t>(1, 32768 / (k * kCols * m));
  at::parallel_for(0, strips_total_, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<__m256i> codes;
    thread_local std::vector<float> group_acc;  // [strips][m][16] of a group
    alignas(32) float acc[kAvx2Rows * kCols];
    for (int64_t s0 = begin; s0 < end;) {
      const Segment& seg = segment_of(s0);
      const int64_t s1 = std::min(end, seg.first_strip + seg.strips);
      const Avx2Kernels& kern = avx2_kernels(seg.type);
      if (kern.buffered) {
        avx2_dequantized(call, seg, s0, s1, x.data());
        s0 = s1;
        continue;
      }
      const float* sums = kern.sub_k == 16 ? sums16.data() : sums32.data();
      const int64_t sum_stride = k / kern.sub_k;
      const uint8_t* packed = seg.packed.data_ptr<uint8_t>();
      if (m <= kAvx2Rows) {  // codes decoded in registers as each strip streams in
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t local = s - seg.first_strip;
          kern.generated[m - 1](packed + local * seg.strip_bytes, k, x16.view(0, k), sums,
                                sum_stride, acc);
          store(call, seg, local, acc, static_cast<int>(m), 0);
        }
        s0 = s1;
        continue;
      }
      // Groups of strips unpacked a chunk of k at a time: a pass's 6 rows of x serve the
      // group's strips from L1 while their codes come from L2.
      const int64_t tiles = k / kTileK, chunk_tiles = std::min(k, kChunkK) / kTileK;
      const int64_t chunk_vectors = chunk_tiles * kern.unpacked_tile;  // a strip's chunk
      for (int64_t g0 = s0; g0 < s1; g0 += kGroupStrips) {
        const int64_t strips = std::min<int64_t>(kGroupStrips, s1 - g0);
        const int64_t first = g0 - seg.first_strip;
        group_acc.assign(strips * m * kCols, 0.f);
        codes.resize(strips * chunk_vectors);
        for (int64_t t0 = 0; t0 < tiles; t0 += chunk_tiles) {
          const int64_t t1 = std::min(tiles, t0 + chunk_tiles);
          for (int64_t j = 0; j < strips; ++j)
            kern.unpack(packed + (first + j) * seg.strip_bytes, k, t0, t1,
                        codes.data() + j * chunk_vectors);
          for (int64_t r0 = 0; r0 < m; r0 += kUnpackRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kUnpackRows, m - r0));
            for (int64_t j = 0; j < strips; ++j)
              kern.unpacked[rows - 1](codes.data() + j * chunk_vectors, t0, t1,
                                      x16.view(r0, k), sums ? sums + r0 * sum_stride : sums,
                                      sum_stride,
                                      group_acc.data() + (j * m + r0) * kCols);
          }
        }
        for (int64_t j = 0; j < strips; ++j)
          store(call, seg, first + j, group_acc.data() + j * m * kCols, static_cast<int>(m), 0);
      }
      s0 = s1;
    }
  });
}

// Each (row, column) from its strip for that row alone, as forward computes a generated row;
// x's float, int16 and sum forms made once for all of them.
void QuantLinear::avx2_columns(const bf16* x_bf16, int64_t m, const int64_t* wanted,
                               int64_t count, float* out) const {
  const int64_t k = k_;
  const std::vector<float> x = to_float(x_bf16, m, k);
  const X16Buffers x16 = avx2_x16(x, m, k);
  const std::vector<float> sums16 = mins16_ ? run_sums(x_bf16, m, k, 16) : std::vector<float>();
  const std::vector<float> sums32 = mins32_ ? run_sums(x_bf16, m, k, 32) : std::vector<float>();
  at::parallel_for(0, m * count, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float acc[kCols];
    std::vector<float> weights;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / count, column = wanted[i];
      const Segment& seg = segment_of_column(column);
      const Avx2Kernels& kern = avx2_kernels(seg.type);
      const uint8_t* strip = seg.packed.data_ptr<uint8_t>() +
                             (column - seg.first_column) / kCols * seg.strip_bytes;
      if (kern.buffered) {  // avx2_dequantized's arithmetic for one row
        weights.resize(std::min(k, kChunkK) * kCols);
        std::fill(acc, acc + kCols, 0.f);
        for (int64_t k0 = 0; k0 < k; k0 += kChunkK) {
          const int64_t kc = std::min(kChunkK, k - k0);
          kern.dequantize(strip, k, k0 / kTileK, (k0 + kc) / kTileK, weights.data());
          kRows[0](x.data() + r * k + k0, k, weights.data(), kc, acc);
        }
      } else {
        const int64_t stride = k / kern.sub_k;
        const float* sums = kern.sub_k == 16 ? sums16.data() : sums32.data();
        kern.generated[0](strip, k, x16.view(r, k), sums ? sums + r * stride : sums, stride,
                          acc);
      }
      float v = acc[(column - seg.first_column) % kCols];
      if (bias_.defined()) v += bias_.data_ptr<float>()[column];
      out[i] = v;
    }
  });
}

#endif  // SHOAL_QUANT_AVX2

}  // namespace shoal_quant
