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

#include "quant_backend.h"

namespace shoal_quant {

using bf16 = at::BFloat16;

namespace {

// AMX prompt rows (run_amx_prompt): bytes of x, as A tiles, per block of rows (or per chunk
// of k): it stays in a core's L2 (2 MiB here) beside the decoded strips while every pair of
// strips runs over it; a block of at least kAmxMinRows rows over all of k where that fits,
// else kAmxBlockRows rows over chunks of k; and bytes of C kept between chunks.
constexpr int64_t kAmxBlockBytes = 1024 * 1024;
constexpr int64_t kAmxMinRows = 128;
constexpr int64_t kAmxBlockRows = 512;
constexpr int64_t kAmxPartialBytes = 4 * 1024 * 1024;


#if SHOAL_QUANT_AVX512

#if SHOAL_QUANT_AMX
// One or two strips' k-tiles [t0, t0 + tiles) decoded for the prompt tiles
// (decode_split) half a k-tile at a time: step() decodes the next half, so the work can be
// spread thinly between another pair's tile ops.
struct PairDecoder {
  int64_t k, t0, tiles;
  SplitFn fn[2] = {};
  const uint8_t* strip[2] = {};
  __m512i* out[2] = {};
  int strips = 0;
  int64_t next = 0;

  void add(SplitFn f, const uint8_t* s, __m512i* o) {
    fn[strips] = f, strip[strips] = s, out[strips] = o;
    ++strips;
  }
  int64_t units() const { return strips * tiles * 2; }
  void step() {
    if (next == units()) return;
    const int s = static_cast<int>(next % strips);
    const int64_t t = next / strips / 2;
    fn[s](strip[s], k, t0 + t, static_cast<int>(next / strips % 2), out[s] + t * 2 * kPairs);
    ++next;
  }
  void finish() {
    while (next < units()) step();
  }
};
#endif

#endif

}  // namespace

void QuantLinear::store(const Call& call, const Segment& seg, int64_t local, const float* acc,
                        int rows, int64_t row0, int64_t acc_stride) const {
  const int cols = static_cast<int>(std::min<int64_t>(kCols, seg.n - local * kCols));
  const int64_t col0 = seg.first_column + local * kCols;
  if (cols == kCols) {  // a whole strip: 16 columns a vector (the same roundings)
    const shoal_vec::f32x16 bias =
        call.bias != nullptr ? shoal_vec::load(call.bias + col0) : shoal_vec::f32x16{};
    for (int r = 0; r < rows; ++r) {
      shoal_vec::f32x16 v = shoal_vec::load(acc + r * acc_stride);
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
      float v = acc[r * acc_stride + c];
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

// Rows decoded in registers: each thread decodes its strips' tiles, up to four strips of
// one segment side by side (prompt: in the prompt rows' order), for up to a pass's rows
// (kDirectRows prompt rows, kGeneratedRows generated ones). More rows run a pass at a time
// over a block of strips, so a block's bytes come from memory once and stay in L2 while
// every pass decodes them again (cheaper here than decoding into buffers: no stores, no
// reloads).
void QuantLinear::run_direct(const Call& call, bool prompt) const {
#if SHOAL_QUANT_AVX512
  const int64_t m = call.m, k = k_;
  const int64_t pass = prompt ? kDirectRows : kGeneratedRows;
  const int first = static_cast<int>(std::min<int64_t>(m, pass));
  // Enough strips per task that a task is worth a thread (~32k multiply-adds).
  const int64_t grain =
      std::max<int64_t>(strips_side_by_side(first), 32768 / (k * kCols * m));
  // A block of about kDirectBlockBytes of packed weights (~half a byte a weight), in whole
  // fours of strips so that side-by-side runs never straddle blocks.
  const int64_t strips_per_block = kDirectBlockBytes / (k * kCols / 2) / 4 * 4;
  const int64_t block = m <= pass ? strips_total_ : std::max<int64_t>(4, strips_per_block);
  at::parallel_for(0, strips_total_, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += block) {
      const int64_t b1 = std::min(end, b0 + block);
      for (int64_t r0 = 0; r0 < m; r0 += pass)
        direct_rows(call, prompt, b0, b1, r0, static_cast<int>(std::min<int64_t>(pass, m - r0)));
    }
  });
#endif
}

// Rows [row0, row0 + rows) (at most a pass's) over strips [begin, end).
void QuantLinear::direct_rows(const Call& call, bool prompt, int64_t begin, int64_t end,
                              int64_t row0, int rows) const {
#if SHOAL_QUANT_AVX512
  const int64_t k = k_;
  const int side = strips_side_by_side(rows);
  alignas(64) float acc[4 * kGeneratedRows * kCols];
  for (int64_t s = begin; s < end;) {
    const Segment& seg = segment_of(s);
    const int64_t local = s - seg.first_strip;
    const Kernels& kern = kernels(seg.type);
    // Side by side only within one segment and these strips; else one at a time.
    const bool together = kern.vectors == 1 && s + side <= end && local + side <= seg.strips;
    const int count = together ? side : 1;
    const uint8_t* strips[4];
    for (int i = 0; i < count; ++i)
      strips[i] = seg.packed.data_ptr<uint8_t>() + (local + i) * seg.strip_bytes;
    const int64_t sum_stride = k / kern.sub_k;
    const float* sums = (kern.sub_k == 16 ? call.sums16.data() : call.sums32.data()) +
                        row0 * sum_stride;
    const DirectFn run =
        prompt ? (together ? kern.prompt_direct[rows - 1] : kern.prompt_direct_single[rows - 1])
               : (together ? kern.direct[rows - 1] : kern.direct_single[rows - 1]);
    run(strips, k, call.chained.data() + row0 * k, k, sums, sum_stride, acc);
    for (int i = 0; i < count; ++i) store(call, seg, local + i, acc + i * rows * kCols, rows, row0);
    s += count;
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

// Prompt rows on AMX. x is first copied into A tiles (tile_rows: each tile 1 KiB in a row).
// Then, per block of rows, strips in pairs: each pair's k-tiles decoded into hi / lo B
// tiles once per block (and chunk of k), and the block's rows run over them 32 at a time
// (two row tiles times two strips: 6 tile loads per 8 tile ops). A thread decodes its next
// pair half a k-tile at a time between the current pair's tile ops (PairDecoder), into the
// other of two buffers: the vector units are free while the tile unit multiplies, though
// only for a little work per k-tile step, so the decoding is spread evenly over the pair.
//
// The tile ops want their operands from L1 / L2: a block of x that stays in this core's L2
// while every pair of strips runs over it, and decoded tiles just written. Where the whole
// block's x does not fit (long k, or many rows), k is cut into chunks whose x does: for
// each chunk, every pair of strips is decoded over that chunk alone and runs the rows over
// it, its C tiles kept between chunks in `partial` (a group of pairs at a time, so that
// stays a few MiB). A row's C still sums k-tile after k-tile in one order, and the chunks
// depend on M only through where they cut k, which does not change the sums: each row's
// result is the same for any M and any rows beside it.
void QuantLinear::run_amx_prompt(const Call& call) const {
#if SHOAL_QUANT_AMX
  const int64_t m = call.m, k = k_, k_tiles = k / kTileK;
  constexpr int64_t kTileFloats = kTileRows * kCols;
  constexpr int64_t kSlotFloats = 4 * kTileFloats;  // a pass's C: [2 strips][2 row tiles]
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  // Rows per block (in row tiles) and k per chunk (a multiple of kTileK): whole k where a
  // block of at least kAmxMinRows rows fits kAmxBlockBytes, else chunks of k.
  const int64_t fit_tiles = kAmxBlockBytes / (kTileRows * k * 2);
  int64_t block_tiles = row_tiles, chunk_k = k;
  if (fit_tiles >= std::min(row_tiles, kAmxMinRows / kTileRows)) {
    const int64_t blocks = (row_tiles + fit_tiles - 1) / std::max<int64_t>(fit_tiles, 1);
    block_tiles = (row_tiles + blocks - 1) / blocks;
  } else {
    block_tiles = std::min<int64_t>(row_tiles, kAmxBlockRows / kTileRows);
    const int64_t chunks =
        (block_tiles * kTileRows * k * 2 + kAmxBlockBytes - 1) / kAmxBlockBytes;
    chunk_k = (k_tiles + chunks - 1) / chunks * kTileK;
  }
  const bool chunked = chunk_k < k;

  // x as A tiles: block by block (block b's rows at b's first row * k), in each block chunk
  // by chunk ([k0, k0 + chunk) at k0 * the block's rows), then tile_rows' layout.
  at::Tensor tiled = at::empty({row_tiles * kTileRows * k}, at::kBFloat16);
  bf16* xt = tiled.data_ptr<bf16>();
  const int64_t block_rows = block_tiles * kTileRows;
  auto block_x = [&](int64_t m0, int64_t k0) {
    const int64_t rows = std::min(block_rows, row_tiles * kTileRows - m0);
    return xt + m0 * k + k0 * rows;
  };
  at::parallel_for(0, row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t m0 = tile * kTileRows / block_rows * block_rows;
      for (int64_t k0 = 0; k0 < k; k0 += chunk_k) {
        const int64_t kc = std::min(chunk_k, k - k0);
        tile_rows(call.x, m, k, tile * kTileRows, 1, k0, kc,
                  block_x(m0, k0) + (tile * kTileRows - m0) * kc);
      }
    }
  });

  const int64_t pairs = (strips_total_ + 1) / 2;
  const int64_t passes = (block_tiles + 1) / 2;  // per block: 2 row tiles, the last maybe 1
  // Pairs per group while chunks of k keep their C in `partial`.
  const int64_t group =
      chunked ? std::max<int64_t>(1, kAmxPartialBytes / (passes * kSlotFloats * 4)) : pairs;
  at::Tensor partial;
  if (chunked) partial = at::empty({std::min(group, pairs) * passes * kSlotFloats}, at::kFloat);
  const int tile_height = static_cast<int>(std::min<int64_t>(m, kTileRows));

  for (int64_t m0 = 0; m0 < row_tiles * kTileRows; m0 += block_rows) {
    const int64_t tiles_here = std::min(block_tiles, row_tiles - m0 / kTileRows);
    const int64_t passes_here = (tiles_here + 1) / 2;
    for (int64_t g0 = 0; g0 < pairs; g0 += group) {
      for (int64_t k0 = 0; k0 < k; k0 += chunk_k) {
        const int64_t kc = std::min(chunk_k, k - k0);
        const int64_t t0 = k0 / kTileK, tiles = kc / kTileK;
        const bool last = k0 + kc == k;
        const bf16* x = block_x(m0, k0);
        at::parallel_for(g0, std::min(pairs, g0 + group), 1, [&](int64_t begin, int64_t end) {
          // Two buffers: the pair being multiplied, and the next one being decoded.
          thread_local StripBuffer buffers[2];
          const size_t vectors = static_cast<size_t>(tiles * 2 * kPairs);
          for (StripBuffer& b : buffers) {
            if (b.pairs.size() < vectors) b.pairs.resize(vectors);
            if (b.second.size() < vectors) b.second.resize(vectors);
          }
          auto decoder = [&](int64_t pair) {
            PairDecoder d{k, t0, tiles};
            StripBuffer& b = buffers[(pair - begin) % 2];
            for (int64_t s = 2 * pair; s < std::min(2 * pair + 2, strips_total_); ++s) {
              const Segment& seg = segment_of(s);
              d.add(kernels(seg.type).split,
                    seg.packed.data_ptr<uint8_t>() + (s - seg.first_strip) * seg.strip_bytes,
                    s == 2 * pair ? b.pairs.data() : b.second.data());
            }
            return d;
          };
          PairDecoder ahead = decoder(begin);
          ahead.finish();
          alignas(64) float local[kSlotFloats];
          configure_tiles(tile_height);
          for (int64_t pair = begin; pair < end; ++pair) {
            const int64_t s0 = 2 * pair, s1 = s0 + 1;
            const Segment& seg0 = segment_of(s0);
            const int64_t local0 = s0 - seg0.first_strip;
            const Segment* seg1 = s1 < strips_total_ ? &segment_of(s1) : nullptr;
            const StripBuffer& b = buffers[(pair - begin) % 2];
            const __m512i* second = seg1 != nullptr ? b.second.data() : nullptr;
            // The next pair decodes between this one's k-tiles, spread evenly over them.
            ahead = pair + 1 < end ? decoder(pair + 1) : PairDecoder{k, t0, tiles};
            const int64_t steps = passes_here * tiles, units = ahead.units();
            int64_t credit = 0;
            auto between = [&] {
              for (credit += units; credit >= steps; credit -= steps) ahead.step();
            };
            for (int64_t pass = 0; pass < passes_here; ++pass) {
              const int64_t tile = 2 * pass;
              const bool both = tile + 1 < tiles_here;
              const bf16* x0 = x + tile * kTileRows * kc;
              float* c = chunked ? partial.data_ptr<float>() +
                                       ((pair - g0) * passes + pass) * kSlotFloats
                                 : local;
              if (both) {
                strips_amx_split<2>(b.pairs.data(), second, tiles, x0, x0 + kTileRows * kc, c,
                                    k0 > 0, between);
              } else {
                strips_amx_split<1>(b.pairs.data(), second, tiles, x0, x0, c, k0 > 0, between);
              }
              if (!last) continue;
              for (int half = 0; half < (both ? 2 : 1); ++half) {
                const int64_t row = m0 + (tile + half) * kTileRows;
                const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - row));
                if (rows <= 0) break;
                const float* first = c + half * kTileFloats;
                if (seg1 == &seg0 &&
                    store_pair(call, seg0, local0, first, first + 2 * kTileFloats, rows, row))
                  continue;
                store(call, seg0, local0, first, rows, row);
                if (seg1 != nullptr)
                  store(call, *seg1, s1 - seg1->first_strip, first + 2 * kTileFloats, rows,
                        row);
              }
            }
            ahead.finish();
          }
          _tile_release();
        });
      }
    }
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
#if SHOAL_QUANT_AVX2
  if (backend_ == Backend::kAvx2) {
    avx2_columns(x.data_ptr<bf16>(), m, wanted_p, count, out_p);
    return out;
  }
#endif
#if SHOAL_QUANT_AVX512
  const std::vector<bf16> chained = chain_order(x.data_ptr<bf16>(), m, k);
  const std::vector<float> sums16 = runs16_ ? run_sums(x.data_ptr<bf16>(), m, k, 16)
                                            : std::vector<float>();
  const std::vector<float> sums32 = runs32_ ? run_sums(x.data_ptr<bf16>(), m, k, 32)
                                            : std::vector<float>();
  // Each (row, column): its strip for that row alone, as a one-row forward computes it.
  at::parallel_for(0, m * count, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kCols];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / count, column = wanted_p[i];
      const Segment* seg = &segment_of_column(column);
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
  TORCH_CHECK(false, "QuantLinear: forward_columns needs the AVX512-BF16 or AVX2 kernels");
#endif
  return out;
}

}  // namespace shoal_quant
