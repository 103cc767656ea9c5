// QuantLinear's paths (quant.h): how a forward call's rows and strips are split over torch's
// threads, and where decoded weights are kept while rows run over them. Generated rows
// take AMX's summation order on every machine (vectors for a few rows; for more, AMX tiles
// where there are any, else vectors over a decoded strip): the same bits on every path.
//
// Work is split by strips of 16 output columns. Up to a few rows, each thread decodes its
// strips' tiles as it goes (batch-1 decode reads every weight once: memory speed counts).
// With more rows, each strip is decoded once into a per-thread buffer and blocks of rows
// run over it while the block of x stays in cache.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant.h"
#include "vector.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SHOAL_QUANT_AVX512 1
#include "quant_kernels.h"
#else
#define SHOAL_QUANT_AVX512 0
#define SHOAL_QUANT_AMX 0
#endif

namespace shoal_quant {

using bf16 = at::BFloat16;

namespace {

// x rows per block while a decoded strip is reused: about this many bytes of x stay cached
// (AMX prompt rows read x again for every pair of strips; other paths for every strip).
constexpr int64_t kRowBlockBytes = 512 * 1024;
constexpr int64_t kAmxBlockBytes = 4 * 1024 * 1024;


#if SHOAL_QUANT_AVX512
// A thread's buffers for decoded strips.
struct StripBuffer {
  std::vector<__m512i> pairs, second;
  std::vector<float> scales, offsets;

  void reserve(int64_t k, int vectors, int sub_k) {
    const size_t n = static_cast<size_t>(k / 2 * vectors);
    if (pairs.size() < n) pairs.resize(n);
    const size_t s = static_cast<size_t>(k / sub_k * kCols);
    if (scales.size() < s) scales.resize(s), offsets.resize(s);
  }
};

#endif

}  // namespace

void QuantLinear::store(const Call& call, const Segment& seg, int64_t local, const float* acc,
                        int rows, int64_t row0) const {
  const int cols = static_cast<int>(std::min<int64_t>(kCols, seg.n - local * kCols));
  const int64_t col0 = seg.first_column + local * kCols;
  if (cols == kCols) {  // a whole strip: 16 columns a vector (the same roundings)
    const shoal_vec::f32x16 bias =
        call.bias != nullptr ? shoal_vec::load(call.bias + col0) : shoal_vec::f32x16{};
    for (int r = 0; r < rows; ++r) {
      shoal_vec::f32x16 v = shoal_vec::load(acc + r * kCols);
      if (call.bias != nullptr) v += bias;
      const int64_t at = (row0 + r) * n_total_ + col0;
      if (call.float_out) {
        shoal_vec::store(static_cast<float*>(call.out) + at, v);
      } else {
        shoal_vec::store(static_cast<bf16*>(call.out) + at, v);
      }
    }
    return;
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      float v = acc[r * kCols + c];
      if (call.bias != nullptr) v += call.bias[col0 + c];
      const int64_t at = (row0 + r) * n_total_ + col0 + c;
      if (call.float_out) {
        static_cast<float*>(call.out)[at] = v;
      } else {
        static_cast<bf16*>(call.out)[at] = bf16(v);
      }
    }
}

bool QuantLinear::store_pair(const Call& call, const Segment& seg, int64_t local,
                             const float* first, const float* second, int rows,
                             int64_t row0) const {
  if (call.float_out || (local + 2) * kCols > seg.n) return false;
  const int64_t col0 = seg.first_column + local * kCols;
  using shoal_vec::f32x16;
  const f32x16 bias0 = call.bias != nullptr ? shoal_vec::load(call.bias + col0) : f32x16{};
  const f32x16 bias1 =
      call.bias != nullptr ? shoal_vec::load(call.bias + col0 + kCols) : f32x16{};
  bf16* out = static_cast<bf16*>(call.out) + row0 * n_total_ + col0;
  for (int r = 0; r < rows; ++r) {
    f32x16 a = shoal_vec::load(first + r * kCols), b = shoal_vec::load(second + r * kCols);
    if (call.bias != nullptr) a += bias0, b += bias1;
    alignas(64) bf16 line[2 * kCols];
    shoal_vec::store(line, a);
    shoal_vec::store(line + kCols, b);
    std::memcpy(out + r * n_total_, line, sizeof line);  // one 64-byte store
  }
  return true;
}

// Few rows: each thread decodes its strips' tiles in registers, up to four strips of one
// segment side by side.
void QuantLinear::run_direct(const Call& call) const {
#if SHOAL_QUANT_AVX512
  const int64_t m = call.m, k = k_;
  const int side = strips_side_by_side(static_cast<int>(m));
  // Enough strips per task that a task is worth a thread (~32k multiply-adds).
  const int64_t grain = std::max<int64_t>(side, 32768 / (k * kCols * m));
  at::parallel_for(0, strips_total_, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[4 * kDirectRows * kCols];
    for (int64_t s = begin; s < end;) {
      const Segment& seg = segment_of(s);
      const int64_t local = s - seg.first_strip;
      const Kernels& kern = kernels(seg.type);
      // Side by side only within one segment and this task's strips; else one at a time.
      const bool together = kern.vectors == 1 && s + side <= end && local + side <= seg.strips;
      const int count = together ? side : 1;
      const uint8_t* strips[4];
      for (int i = 0; i < count; ++i)
        strips[i] = seg.packed.data_ptr<uint8_t>() + (local + i) * seg.strip_bytes;
      const float* sums = kern.sub_k == 16 ? call.sums16.data() : call.sums32.data();
      const DirectFn run = together ? kern.direct[m - 1] : kern.direct_single[m - 1];
      run(strips, k, call.chained.data(), k, sums, k / kern.sub_k, acc);
      for (int i = 0; i < count; ++i)
        store(call, seg, local + i, acc + i * m * kCols, static_cast<int>(m), 0);
      s += count;
    }
  });
#endif
}

void QuantLinear::run_buffered(const Call& call) const {
#if SHOAL_QUANT_AVX512
  const int64_t m = call.m, k = k_;
  const int64_t block_rows = std::max<int64_t>(kBlockRows, kRowBlockBytes / (2 * k));
  for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
    const int64_t rows = std::min(block_rows, m - m0);
    at::parallel_for(0, strips_total_, 1, [&](int64_t begin, int64_t end) {
      thread_local StripBuffer buffer;
      alignas(64) float acc[kBlockRows * kCols];
      for (int64_t s = begin; s < end; ++s) {
        const Segment& seg = segment_of(s);
        const int64_t local = s - seg.first_strip;
        const Kernels& kern = kernels(seg.type);
        buffer.reserve(k, kern.vectors, kern.sub_k);
        kern.decode(seg.packed.data_ptr<uint8_t>() + local * seg.strip_bytes, k,
                    buffer.pairs.data(), buffer.scales.data(), buffer.offsets.data());
        const float* sums = kern.sub_k == 16 ? call.sums16.data() : call.sums32.data();
        const int64_t sum_stride = k / kern.sub_k;
        for (int64_t r0 = m0; r0 < m0 + rows; r0 += kBlockRows) {
          const int group = static_cast<int>(std::min<int64_t>(kBlockRows, m0 + rows - r0));
          kern.buffered[group - 1](buffer.pairs.data(), buffer.scales.data(),
                                   buffer.offsets.data(), k, call.chained.data() + r0 * k, k,
                                   sums + r0 * sum_stride, sum_stride, acc);
          store(call, seg, local, acc, group, r0);
        }
      }
    });
  }
#endif
}

// Generated tokens on an AMX machine, more rows: each strip decoded once per block of rows,
// then 16 rows per pass on tiles.
void QuantLinear::run_tiles(const Call& call) const {
#if SHOAL_QUANT_AMX
  const int64_t m = call.m, k = k_;
  const int64_t block_rows = std::max<int64_t>(kTileRows, kRowBlockBytes / (2 * k));
  for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
    const int64_t rows = std::min(block_rows, m - m0);
    at::parallel_for(0, strips_total_, 1, [&](int64_t begin, int64_t end) {
      thread_local StripBuffer buffer;
      alignas(64) float acc[kTileRows * kCols];
      int configured_rows = 0, configured_sub = 0;
      for (int64_t s = begin; s < end; ++s) {
        const Segment& seg = segment_of(s);
        const int64_t local = s - seg.first_strip;
        const Kernels& kern = kernels(seg.type);
        buffer.reserve(k, kern.vectors, kern.sub_k);
        kern.decode_pairs(seg.packed.data_ptr<uint8_t>() + local * seg.strip_bytes, k,
                          buffer.pairs.data(), buffer.scales.data(), buffer.offsets.data());
        const float* sums = kern.sub_k == 16 ? call.sums16.data() : call.sums32.data();
        const int64_t sum_stride = k / kern.sub_k;
        for (int64_t r0 = m0; r0 < m0 + rows; r0 += kTileRows) {
          const int group = static_cast<int>(std::min<int64_t>(kTileRows, m0 + rows - r0));
          if (group != configured_rows || kern.sub_k != configured_sub)
            configure_decode_tiles(configured_rows = group, configured_sub = kern.sub_k);
          kern.tiles(buffer.pairs.data(), buffer.scales.data(), buffer.offsets.data(), k,
                     call.x + r0 * k, k, group, sums + r0 * sum_stride, sum_stride, acc);
          store(call, seg, local, acc, group, r0);
        }
      }
      if (configured_rows) _tile_release();
    });
  }
#endif
}

// Prompt rows on AMX: strips in pairs, each decoded once per block of rows into hi / lo B
// tiles, then 32 rows at a time (two row tiles; 16 or fewer for the last rows).
void QuantLinear::run_amx_prompt(const Call& call) const {
#if SHOAL_QUANT_AMX
  const int64_t m = call.m, k = k_;
  constexpr int64_t kPassRows = kRowTiles * kTileRows;
  constexpr int64_t kTileFloats = kTileRows * kCols;
  const int64_t block_rows =
      std::max<int64_t>(kPassRows, kAmxBlockBytes / (2 * k) / kPassRows * kPassRows);
  const int64_t pairs = (strips_total_ + 1) / 2;
  const size_t split_vectors = static_cast<size_t>(k / kTileK * 2 * kPairs);
  for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
    const int64_t rows = std::min(block_rows, m - m0);
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      thread_local StripBuffer buffer;
      if (buffer.pairs.size() < split_vectors) buffer.pairs.resize(split_vectors);
      if (buffer.second.size() < split_vectors) buffer.second.resize(split_vectors);
      alignas(64) float c[2 * kPassRows * kCols];  // [strip][row tile][16][16]
      int configured = 0;
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t s0 = 2 * pair, s1 = s0 + 1;
        const Segment& seg0 = segment_of(s0);
        const int64_t local0 = s0 - seg0.first_strip;
        kernels(seg0.type).split(seg0.packed.data_ptr<uint8_t>() + local0 * seg0.strip_bytes,
                                 k, buffer.pairs.data());
        const Segment* seg1 = s1 < strips_total_ ? &segment_of(s1) : nullptr;
        if (seg1 != nullptr)
          kernels(seg1->type).split(
              seg1->packed.data_ptr<uint8_t>() + (s1 - seg1->first_strip) * seg1->strip_bytes,
              k, buffer.second.data());
        for (int64_t r0 = m0; r0 < m0 + rows;) {
          // 32 rows as two row tiles; then 16; then the rest as one short tile (the
          // second tile repeats the first's rows and its results are dropped).
          const int64_t left = m0 + rows - r0;
          const bool both = left >= kPassRows;
          const int tile = static_cast<int>(std::min<int64_t>(kTileRows, left));
          if (tile != configured) configure_tiles(configured = tile);
          const bf16* x0 = call.x + r0 * k;
          strips_amx_split(buffer.pairs.data(), seg1 ? buffer.second.data() : nullptr, k, x0,
                           both ? x0 + kTileRows * k : x0, k, c);
          for (int half = 0; half < (both ? 2 : 1); ++half) {
            const float* first = c + half * kTileFloats;
            const int64_t row = r0 + half * tile;
            if (seg1 == &seg0 &&
                store_pair(call, seg0, local0, first, first + 2 * kTileFloats, tile, row))
              continue;
            store(call, seg0, local0, first, tile, row);
            if (seg1 != nullptr)
              store(call, *seg1, s1 - seg1->first_strip, first + 2 * kTileFloats, tile, row);
          }
          r0 += both ? kPassRows : tile;
        }
      }
      if (configured) _tile_release();
    });
  }
#endif
}

at::Tensor QuantLinear::forward_columns(const at::Tensor& input,
                                        const at::Tensor& columns) const {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2 && input.size(1) == k_,
              "QuantLinear: x must be [M, ", k_, "] bfloat16");
  TORCH_CHECK(columns.dim() == 2 && columns.size(0) == input.size(0),
              "QuantLinear: columns must be [M, C]");
  const at::Tensor x = input.contiguous();
  const at::Tensor wanted = columns.to(at::kLong).contiguous();
  const int64_t m = x.size(0), count = wanted.size(1), k = k_;
  at::Tensor out = at::empty({m, count}, x.options().dtype(at::kFloat));
  float* out_p = out.data_ptr<float>();
  const int64_t* wanted_p = wanted.data_ptr<int64_t>();
  for (int64_t i = 0; i < m * count; ++i)
    TORCH_CHECK(wanted_p[i] >= 0 && wanted_p[i] < n_total_, "QuantLinear: column ",
                wanted_p[i], " out of range");
#if SHOAL_QUANT_AVX512
  const std::vector<bf16> chained = chain_order(x.data_ptr<bf16>(), m, k);
  const std::vector<float> sums16 = run_sums(x.data_ptr<bf16>(), m, k, 16);
  const std::vector<float> sums32 = run_sums(x.data_ptr<bf16>(), m, k, 32);
  // Each (row, column): its strip for that row alone, as a one-row forward computes it.
  at::parallel_for(0, m * count, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kCols];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / count, column = wanted_p[i];
      const Segment* seg = &segments_.front();
      for (const Segment& candidate : segments_)
        if (column < candidate.first_column + candidate.n) {
          seg = &candidate;
          break;
        }
      const int64_t strip = (column - seg->first_column) / kCols;
      const Kernels& kern = kernels(seg->type);
      const uint8_t* bytes = seg->packed.data_ptr<uint8_t>() + strip * seg->strip_bytes;
      const float* sums = (kern.sub_k == 16 ? sums16.data() : sums32.data()) +
                          r * (k / kern.sub_k);
      kern.direct_single[0](&bytes, k, chained.data() + r * k, k, sums, k / kern.sub_k, acc);
      float v = acc[(column - seg->first_column) % kCols];
      if (bias_.defined()) v += bias_.data_ptr<float>()[column];
      out_p[i] = v;
    }
  });
#else
  TORCH_CHECK(false, "QuantLinear: forward_columns needs the AVX512-BF16 kernels");
#endif
  return out;
}

}  // namespace shoal_quant
