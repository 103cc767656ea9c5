// QuantLinear's path for many prompt rows on AVX512-BF16 vectors without AMX tiles: panels
// of strips decoded once per call, the rows run over them a few rows and strips a pass
// (strips_prompt, quant_avx512.h). A few rows, and generated rows, take run_direct.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "quant.h"

#include "quant_backend.h"

namespace shoal_quant {

// Strips in panels of up to kPanelStrips, within one segment, each panel decoded once into a
// thread's buffers; then, per block of rows and chunk of k, each pass of kGroupRows rows
// runs over the panel's strips kGroupStrips at a time (its x rows stay in L1 meanwhile),
// their sums kept in `totals` [groups][rows][kGroupStrips][16] between chunks. x is read
// from memory once per panel, the panel's chunk stays in L2 for every pass.
void QuantLinear::run_groups(const Call& call) const {
#if SHOAL_QUANT_AVX512
  const int64_t m = call.m, k = k_;
  struct Panel {
    const Segment* seg;
    int64_t local;  // the panel's first strip within seg
    int count;
  };
  // Panels of whole groups, narrower where there would be too few to keep every thread busy.
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t even_share = (strips_total_ + 2 * threads - 1) / (2 * threads);
  const int panel_width = static_cast<int>(std::clamp<int64_t>(
      (even_share + kGroupStrips - 1) / kGroupStrips * kGroupStrips, kGroupStrips,
      kPanelStrips));
  std::vector<Panel> panels;
  for (const Segment& seg : segments_) {
    for (int64_t local = 0; local < seg.strips; local += panel_width)
      panels.push_back(
          {&seg, local, static_cast<int>(std::min<int64_t>(panel_width, seg.strips - local))});
  }
  const int64_t chunk_k = std::min(k, kGroupChunkK);
  // Whole passes of kGroupRows per block: a short pass runs fewer chains than latency needs.
  const int64_t block_rows =
      std::max<int64_t>(1, kRowBlockBytes / (2 * chunk_k) / kGroupRows) * kGroupRows;
  at::parallel_for(0, static_cast<int64_t>(panels.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local StripBuffer buffers[kPanelStrips];
    thread_local std::vector<float> totals;
    for (int64_t index = begin; index < end; ++index) {
      const Panel& panel = panels[index];
      const Segment& seg = *panel.seg;
      const Kernels& type = kernels(seg.type);
      const GroupKernels& kern = type.prompt;
      const __m512i* vectors[kPanelStrips];
      const float* scales[kPanelStrips];
      const float* offsets[kPanelStrips];
      for (int i = 0; i < panel.count; ++i) {
        StripBuffer& buffer = buffers[i];
        buffer.reserve(k, type.vectors, type.sub_k);
        kern.decode(seg.packed.data_ptr<uint8_t>() + (panel.local + i) * seg.strip_bytes, k,
                    buffer.pairs.data(), buffer.scales.data(), buffer.offsets.data());
        vectors[i] = buffer.pairs.data();
        scales[i] = buffer.scales.data();
        offsets[i] = buffer.offsets.data();
      }
      const float* sums = type.sub_k == 16 ? call.sums16.data() : call.sums32.data();
      const int64_t sum_stride = k / type.sub_k;
      const int group = kern.strips;  // strips per pass
      const int64_t groups = (panel.count + group - 1) / group;
      for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
        const int64_t rows = std::min(block_rows, m - m0);
        // Group j's sums: totals + j * group_floats, [rows][its strips][16].
        const int64_t group_floats = rows * group * kCols;
        const size_t need = static_cast<size_t>(groups * group_floats);
        if (totals.size() < need) totals.resize(need);
        std::fill(totals.begin(), totals.begin() + static_cast<int64_t>(need), 0.f);
        for (int64_t k0 = 0; k0 < k; k0 += chunk_k) {
          const int64_t g0 = k0 / type.sub_k, g1 = std::min(k0 + chunk_k, k) / type.sub_k;
          for (int64_t r0 = m0; r0 < m0 + rows; r0 += kGroupRows) {
            const int here = static_cast<int>(std::min<int64_t>(kGroupRows, m0 + rows - r0));
            for (int64_t j = 0; j < groups; ++j) {
              const int width = static_cast<int>(std::min<int64_t>(group, panel.count - j * group));
              kern.run[width - 1][here - 1](vectors + j * group, scales + j * group,
                                            offsets + j * group, g0, g1,
                                            call.chained.data() + r0 * k, k,
                                            sums + r0 * sum_stride, sum_stride,
                                            totals.data() + j * group_floats +
                                                (r0 - m0) * width * kCols);
            }
          }
        }
        // Each strip's rows out of its group's totals (a row every width * 16 floats).
        for (int i = 0; i < panel.count; ++i) {
          const int64_t j = i / group;
          const int width = static_cast<int>(std::min<int64_t>(group, panel.count - j * group));
          store(call, seg, panel.local + i, totals.data() + j * group_floats + i % group * kCols,
                static_cast<int>(rows), m0, width * kCols);
        }
      }
    }
  });
#endif
}

}  // namespace shoal_quant
