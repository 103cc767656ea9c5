// Attention of prompt rows (the Python path's prefill) on the CPU, each row computed alone:
// its result depends only on its query and its own keys and values, never on which rows
// share the call or how the prompt was split into chunks (torch's attention moves by ~1e-7
// with the split, enough to flip bf16 roundings).
//
// First each request's keys, per KV head, are transposed once into blocks of 16 positions
// aligned to absolute positions ([block][D][16] floats), so a score takes 16 keys per vector
// op with no horizontal sums. Then items of up to kRowsPerItem consecutive rows of one
// request and one KV head: per row and query head, scores block by block (one chain over d,
// in order), a two-pass softmax (the max, then exp and lane sums in key order) with exact
// zero weight outside the row's range [lo, position], and the values added key by key, read
// straight from the cache. Keys outside a row's range add exact zeros, so whatever else
// shares its item or call changes nothing.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kv_layout.h"
#include "vector.h"

namespace shoal_prompt_attention {

using shoal_vec::bf16;
using shoal_vec::f32x16;
using shoal_vec::kLanes;

constexpr int64_t kRowsPerItem = 8;

// What the rows attend to. Row r is position position[r] of a request whose key slots are
// key_slots[base[r] + 0 ..]; it sees positions [lo[r], position[r]]. The cache is
// [2 * kv_heads, slots, W]: keys of KV head g in plane g, values in plane kv_heads + g
// (W = dim; for int8, dim values and their scales, kv_layout.h).
struct Rows {
  const float* q;  // [rows, heads, dim], rotated
  int64_t rows, heads, kv_heads, dim;
  const int64_t* key_slots;
  const int64_t* base;
  const int64_t* position;
  const int64_t* lo;
  float scale;
};

// One request's run of rows and the key blocks they need.
struct Segment {
  int64_t first_row, rows;
  int64_t first_key;  // a multiple of 16: the block of the lowest lo
  int64_t last_key;   // the highest position
  int64_t blocks;
  int64_t offset;  // into the keys and values buffers: per KV head blocks * 16 * dim floats
};

// Rows grouped by request (consecutive rows sharing base) with their transposed key blocks.
inline std::vector<Segment> segments_of(const Rows& rows) {
  std::vector<Segment> out;
  int64_t offset = 0;
  for (int64_t r = 0; r < rows.rows;) {
    Segment s{r, 0, rows.lo[r], rows.position[r], 0, offset};
    for (; r < rows.rows && rows.base[r] == rows.base[s.first_row]; ++r, ++s.rows) {
      s.first_key = std::min(s.first_key, rows.lo[r]);
      s.last_key = std::max(s.last_key, rows.position[r]);
    }
    s.first_key = s.first_key / kLanes * kLanes;
    s.blocks = s.last_key / kLanes + 1 - s.first_key / kLanes;
    offset += rows.kv_heads * s.blocks * kLanes * rows.dim;
    out.push_back(s);
  }
  return out;
}

// Block `block` of a segment's keys of KV head g as floats, transposed to [dim][16], and
// its values as [16][dim] floats (zeros past the segment's last key). Converting once here
// spares every query head of every row a bf16 conversion (or an int8 dequantization: only
// the segment's blocks are widened, never the cache).
template <typename E>
void load_block(const Rows& rows, const E* cache, int64_t slots, const Segment& s, int64_t g,
                int64_t block, float* keys_t, float* values) {
  const int64_t dim = rows.dim, width = shoal_kv::row_width<E>(dim);
  const int64_t* request_slots = rows.key_slots + rows.base[s.first_row];
  for (int64_t t = 0; t < kLanes; ++t) {
    const int64_t key = s.first_key + block * kLanes + t;
    float* v = values + t * dim;
    if (key > s.last_key) {
      for (int64_t d = 0; d < dim; ++d) keys_t[d * kLanes + t] = 0.f;
      std::fill(v, v + dim, 0.f);
      continue;
    }
    const E* k = cache + (g * slots + request_slots[key]) * width;
    for (int64_t d = 0; d < dim; ++d) keys_t[d * kLanes + t] = shoal_kv::element(k, dim, d);
    const E* source = cache + ((rows.kv_heads + g) * slots + request_slots[key]) * width;
    for (int64_t d = 0; d < dim; ++d) v[d] = shoal_kv::element(source, dim, d);
  }
}

// Scores of one (row, head) over blocks [0, blocks) ([blocks * 16] into w), eight blocks at
// a time so independent chains hide the FMA latency; each score is one chain over d.
template <int B>
inline void score_blocks(const float* q, const float* kt, int64_t dim, float scale, float* w) {
  const int64_t stride = dim * kLanes;
  f32x16 s[B] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const f32x16 qd = shoal_vec::splat(q[d]);
    for (int b = 0; b < B; ++b) s[b] = shoal_vec::fma(qd, shoal_vec::load(kt + b * stride +
                                                                       d * kLanes), s[b]);
  }
  for (int b = 0; b < B; ++b) shoal_vec::store(w + b * kLanes, s[b] * scale);
}

inline void scores(const float* q, const float* keys_t, int64_t blocks, int64_t dim,
                   float scale, float* w) {
  const int64_t stride = dim * kLanes;
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8)
    score_blocks<8>(q, keys_t + b * stride, dim, scale, w + b * kLanes);
  for (; b < blocks; ++b)
    score_blocks<1>(q, keys_t + b * stride, dim, scale, w + b * kLanes);
}

// Scores to weights in place: exp(score - peak) for keys [lo, position] (counted from w's
// first key), exact zeros elsewhere; returns 1 / their sum (lane sums in key order, then
// the lanes).
inline float weights_of(float* w, int64_t blocks, int64_t lo, int64_t position) {
  f32x16 lane;
  for (int t = 0; t < kLanes; ++t) lane[t] = static_cast<float>(t);
  const float inf = std::numeric_limits<float>::infinity();
  f32x16 peaks = shoal_vec::splat(-inf);
  for (int64_t b = 0; b < blocks; ++b) {
    const f32x16 key = lane + static_cast<float>(b * kLanes);
    const f32x16 score = shoal_vec::load(w + b * kLanes);
    const auto inside = (key >= static_cast<float>(lo)) & (key <= static_cast<float>(position));
    peaks = inside && score > peaks ? score : peaks;
  }
  const float peak = shoal_vec::hmax(peaks);
  f32x16 totals{};
  for (int64_t b = 0; b < blocks; ++b) {
    const f32x16 key = lane + static_cast<float>(b * kLanes);
    const auto inside = (key >= static_cast<float>(lo)) & (key <= static_cast<float>(position));
    const f32x16 e = shoal_vec::exp(shoal_vec::load(w + b * kLanes) - peak);
    const f32x16 kept = inside ? e : f32x16{};
    shoal_vec::store(w + b * kLanes, kept);
    totals += kept;
  }
  return 1.f / shoal_vec::hsum(totals);
}

// The weighted values of P pairs at once, head size NV * 16, over keys [from, to]: each
// output element one chain in key order; held in registers.
template <int NV, int P>
void add_values(const float* values, int64_t from, int64_t to, const float* const* w,
                const float* inverse, bf16* const* out) {
  constexpr int64_t D = NV * kLanes;
  f32x16 acc[P][NV] = {};
  for (int64_t key = from; key <= to; ++key) {
    const float* v = values + key * D;
    f32x16 weight[P];
    for (int p = 0; p < P; ++p) weight[p] = shoal_vec::splat(w[p][key]);
    for (int c = 0; c < NV; ++c) {
      const f32x16 vc = shoal_vec::load(v + c * kLanes);
      for (int p = 0; p < P; ++p) acc[p][c] = shoal_vec::fma(weight[p], vc, acc[p][c]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < NV; ++c) shoal_vec::store(out[p] + c * kLanes, acc[p][c] * inverse[p]);
}

using AddValues = void (*)(const float*, int64_t, int64_t, const float* const*, const float*,
                           bf16* const*);

// Pairs at a time for a head size: enough chains to hide the FMA latency, few enough
// accumulators for the registers.
inline int64_t pairs_at_once(int64_t dim) { return dim <= 64 ? 4 : dim <= 128 ? 2 : 1; }

template <int NV>
AddValues add_values_for(int64_t at_once) {
  switch (at_once) {
    case 4: return add_values<NV, 4>;
    case 2: return add_values<NV, 2>;
    default: return add_values<NV, 1>;
  }
}

// nullptr where the head size is not a multiple of 16 up to 256.
inline AddValues pick_add_values(int64_t dim, int64_t at_once) {
  switch (dim) {
    case 16: return add_values_for<1>(at_once);
    case 32: return add_values_for<2>(at_once);
    case 48: return add_values_for<3>(at_once);
    case 64: return add_values_for<4>(at_once);
    case 80: return add_values_for<5>(at_once);
    case 96: return add_values_for<6>(at_once);
    case 128: return add_values_for<8>(at_once);
    case 256: return add_values<16, 1>;
    default: return nullptr;
  }
}

// Other head sizes: the same chains, one pair at a time, element by element.
inline void add_values_scalar(const float* values, int64_t dim, int64_t from, int64_t to,
                              const float* w, float inverse, float* acc, bf16* out) {
  std::fill(acc, acc + dim, 0.f);
  for (int64_t key = from; key <= to; ++key) {
    const float* v = values + key * dim;
    for (int64_t d = 0; d < dim; ++d) acc[d] = std::fma(w[key], v[d], acc[d]);
  }
  for (int64_t d = 0; d < dim; ++d) out[d] = bf16(acc[d] * inverse);
}

// The thread's own scratch.
struct Scratch {
  std::vector<float> weights, inverse, acc;
};

// One item: rows [first, first + count) of segment s and KV head g; keys_t and values are
// the segment's blocks of that head (load_block).
inline void attend_item(const Rows& rows, const Segment& s, const float* keys_t,
                        const float* values, int64_t first, int64_t count, int64_t g,
                        Scratch& scratch, bf16* out) {
  const int64_t dim = rows.dim, group = rows.heads / rows.kv_heads;
  int64_t lowest = rows.lo[first], last = rows.position[first];
  for (int64_t r = first; r < first + count; ++r) {
    lowest = std::min(lowest, rows.lo[r]);
    last = std::max(last, rows.position[r]);
  }
  // The item's blocks within the segment's: [skip, skip + blocks).
  const int64_t skip = (lowest - s.first_key) / kLanes;
  const int64_t blocks = (last - s.first_key) / kLanes + 1 - skip, length = blocks * kLanes;
  const int64_t item_key = s.first_key + skip * kLanes;  // the position of w[0]
  const int64_t pairs = count * group;
  scratch.weights.resize(pairs * length);
  scratch.inverse.resize(pairs);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t r = first + pair / group, head = g * group + pair % group;
    float* w = scratch.weights.data() + pair * length;
    scores(rows.q + (r * rows.heads + head) * dim, keys_t + skip * dim * kLanes, blocks, dim,
           rows.scale, w);
    scratch.inverse[pair] = weights_of(w, blocks, rows.lo[r] - item_key,
                                       rows.position[r] - item_key);
  }
  // Values: keys outside [lowest, last] have zero weight in every pair; skipping them
  // adds nothing. Pointers are shifted so w[key] and values[key * dim] are that position's.
  const float* shifted = values - s.first_key * dim;
  auto weights = [&](int64_t pair) { return scratch.weights.data() + pair * length - item_key; };
  auto output = [&](int64_t pair) {
    return out + ((first + pair / group) * rows.heads + g * group + pair % group) * dim;
  };
  if (pick_add_values(dim, 1) == nullptr) {
    scratch.acc.resize(dim);
    for (int64_t pair = 0; pair < pairs; ++pair)
      add_values_scalar(shifted, dim, lowest, last, weights(pair), scratch.inverse[pair],
                        scratch.acc.data(), output(pair));
    return;
  }
  const int64_t most = pairs_at_once(dim);
  for (int64_t pair = 0; pair < pairs;) {
    const int64_t at_once = pairs - pair >= most ? most : 1;
    const float* w[4];
    bf16* o[4];
    for (int64_t p = 0; p < at_once; ++p) {
      w[p] = weights(pair + p);
      o[p] = output(pair + p);
    }
    pick_add_values(dim, at_once)(shifted, lowest, last, w, scratch.inverse.data() + pair, o);
    pair += at_once;
  }
}

// Every row and KV head, on torch's intra-op threads. out: [rows, heads * dim].
template <typename E>
void attend(const Rows& rows, const E* cache, int64_t slots, bf16* out) {
  if (rows.rows == 0) return;
  const std::vector<Segment> segments = segments_of(rows);
  const int64_t kv_heads = rows.kv_heads, block_floats = rows.dim * kLanes;
  // Each (segment, block) loaded for every KV head: keys transposed, values as floats.
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t i = 0; i < static_cast<int64_t>(segments.size()); ++i)
    for (int64_t b = 0; b < segments[i].blocks; ++b) blocks.emplace_back(i, b);
  const Segment& end_segment = segments.back();
  const int64_t floats = end_segment.offset + kv_heads * end_segment.blocks * block_floats;
  std::vector<float> keys_t(floats), values(floats);
  auto head_offset = [&](const Segment& s, int64_t g) { return s.offset + g * s.blocks *
                                                                           block_floats; };
  const int64_t loads = static_cast<int64_t>(blocks.size()) * kv_heads;
  at::parallel_for(0, loads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [index, b] = blocks[i / kv_heads];
      const Segment& s = segments[index];
      const int64_t g = i % kv_heads, at = head_offset(s, g) + b * block_floats;
      load_block(rows, cache, slots, s, g, b, keys_t.data() + at, values.data() + at);
    }
  });
  // Items: runs of up to kRowsPerItem consecutive rows of one segment.
  struct Item {
    int64_t segment, first, count;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < static_cast<int64_t>(segments.size()); ++i) {
    const Segment& s = segments[i];
    for (int64_t r = s.first_row; r < s.first_row + s.rows; r += kRowsPerItem)
      items.push_back({i, r, std::min(kRowsPerItem, s.first_row + s.rows - r)});
  }
  // A row's cost grows with its position, and the threads take contiguous ranges: pair the
  // cheapest item with the dearest ([0, n-1, 1, n-2, ...]) so each range's share is even.
  const int64_t count = static_cast<int64_t>(items.size());
  std::vector<Item> order;
  order.reserve(count);
  for (int64_t i = 0, j = count - 1; i <= j; ++i, --j) {
    order.push_back(items[i]);
    if (i != j) order.push_back(items[j]);
  }
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = order[i / kv_heads];
      const Segment& s = segments[item.segment];
      const int64_t g = i % kv_heads, at = head_offset(s, g);
      attend_item(rows, s, keys_t.data() + at, values.data() + at, item.first, item.count, g,
                  scratch, out);
    }
  });
}

}  // namespace shoal_prompt_attention
