// QuantLinear's path for many prompt rows on AVX512-BF16 vectors without AMX tiles: groups
// of strips decoded once per call, the rows run over them a few rows and strips a pass
// (strips_prompt, quant_avx512.h). A few rows, and generated rows, take run_direct.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant.h"

#include "quant_backend.h"

namespace shoal_quant {

// Strips in groups of up to the type's width, within one segment, each group decoded once
// into a thread's buffers; then, per block of rows and chunk of k, the block's rows run
// over the chunk kGroupRows at a time, their sums kept in `totals` [rows][strips][16]
// between chunks, while the chunk's strips and x stay in cache.
void QuantLinear::run_groups(const Call& call) const {
#if SHOAL_QUANT_AVX512
  const int64_t m = call.m, k = k_;
  struct Group {
    const Segment* seg;
    int64_t local;  // the group's first strip within seg
    int count;
  };
  std::vector<Group> groups;
  for (const Segment& seg : segments_) {
    const int width = kernels(seg.type).prompt.strips;
    for (int64_t local = 0; local < seg.strips; local += width)
      groups.push_back(
          {&seg, local, static_cast<int>(std::min<int64_t>(width, seg.strips - local))});
  }
  const int64_t chunk_k = std::min(k, kGroupChunkK);
  const int64_t block_rows = std::max<int64_t>(kGroupRows, kRowBlockBytes / (2 * chunk_k));
  // A group's strips are decoded once; its rows then run block by block (x of a block and
  // chunk stays in L2 beside the chunk's decoded strips).
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local StripBuffer buffers[kGroupStrips];
    thread_local std::vector<float> totals;
    for (int64_t index = begin; index < end; ++index) {
      const Group& group = groups[index];
      const Segment& seg = *group.seg;
      const Kernels& type = kernels(seg.type);
      const GroupKernels& kern = type.prompt;
      const __m512i* vectors[kGroupStrips];
      const float* scales[kGroupStrips];
      const float* offsets[kGroupStrips];
      for (int i = 0; i < group.count; ++i) {
        StripBuffer& buffer = buffers[i];
        buffer.reserve(k, type.vectors, type.sub_k);
        kern.decode(seg.packed.data_ptr<uint8_t>() + (group.local + i) * seg.strip_bytes, k,
                    buffer.pairs.data(), buffer.scales.data(), buffer.offsets.data());
        vectors[i] = buffer.pairs.data();
        scales[i] = buffer.scales.data();
        offsets[i] = buffer.offsets.data();
      }
      const int width = group.count;
      const float* sums = type.sub_k == 16 ? call.sums16.data() : call.sums32.data();
      const int64_t sum_stride = k / type.sub_k;
      for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
        const int64_t rows = std::min(block_rows, m - m0);
        const size_t need = static_cast<size_t>(rows * width * kCols);
        if (totals.size() < need) totals.resize(need);
        std::fill(totals.begin(), totals.begin() + static_cast<int64_t>(need), 0.f);
        for (int64_t k0 = 0; k0 < k; k0 += chunk_k) {
          const int64_t g0 = k0 / type.sub_k, g1 = std::min(k0 + chunk_k, k) / type.sub_k;
          for (int64_t r0 = m0; r0 < m0 + rows; r0 += kGroupRows) {
            const int here = static_cast<int>(std::min<int64_t>(kGroupRows, m0 + rows - r0));
            kern.run[width - 1][here - 1](vectors, scales, offsets, g0, g1,
                                          call.chained.data() + r0 * k, k,
                                          sums + r0 * sum_stride, sum_stride,
                                          totals.data() + (r0 - m0) * width * kCols);
          }
        }
        // totals [rows][width][16] -> each strip's rows, as store() takes them.
        alignas(64) float strip_rows[kGroupRows * kCols];
        for (int i = 0; i < width; ++i)
          for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
            const int here = static_cast<int>(std::min<int64_t>(kGroupRows, rows - r0));
            for (int r = 0; r < here; ++r)
              std::memcpy(strip_rows + r * kCols,
                          totals.data() + ((r0 + r) * width + i) * kCols, kCols * sizeof(float));
            store(call, seg, group.local + i, strip_rows, here, m0 + r0);
          }
      }
    }
  });
#endif
}

}  // namespace shoal_quant
