// Attention of prompt rows (the Python path's prefill) on the CPU, each row computed alone:
// its result depends only on its query and its own keys and values, never on which rows
// share the call or how the prompt was split into chunks (torch's attention moves by ~1e-7
// with the split, enough to flip bf16 roundings).
//
// First each request's keys, per KV head, are transposed once into blocks of 16 positions
// aligned to absolute positions ([block][D][16] floats), so a score takes 16 keys per vector
// op with no horizontal sums, and its values widened to floats. Then items of up to
// kRowsPerItem consecutive rows of one request and one KV head: scores in register tiles of
// (row, head) pairs x blocks (4 x 6 with AVX-512, 2 x 3 with AVX2; one chain over d per
// score, in order), a two-pass softmax
// per pair (the max, then exp and lane sums in key order) with exact zero weight outside the
// row's range [lo, position], and the values added key by key in tiles of pairs x columns
// (6 x 64, or 3 x 32; one chain per output element, in key order). A tile loads each key or value
// vector once for all its pairs: ~2x the speed of pair-at-a-time chains, the same bits.
// Keys outside a row's range add exact zeros, so whatever else shares its item or call
// changes nothing.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
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
  const float* sinks = nullptr;  // [heads]: logits joining each softmax's sum (gpt-oss)
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

// Scores of P (row, head) pairs over B blocks (16 keys each, into w[p] + b * 16): each key
// vector is loaded once for P pairs, and the P * B independent chains hide the FMA latency.
// Each score is still one chain over d, in order, so the tile shape changes no bit.
template <int P, int B>
inline void score_tile(const float* const* q, const float* kt, int64_t dim, float scale,
                       float* const* w) {
  const int64_t stride = dim * kLanes;
  f32x16 s[P][B] = {};
  for (int64_t d = 0; d < dim; ++d) {
    f32x16 qd[P];
    for (int p = 0; p < P; ++p) qd[p] = shoal_vec::splat(q[p][d]);
    for (int b = 0; b < B; ++b) {
      const f32x16 key = shoal_vec::load(kt + b * stride + d * kLanes);
      for (int p = 0; p < P; ++p) s[p][b] = shoal_vec::fma(qd[p], key, s[p][b]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int b = 0; b < B; ++b) shoal_vec::store(w[p] + b * kLanes, s[p][b] * scale);
}

// Tile shapes: P * B accumulators, P query values and a key within the registers. AVX-512
// has 32 registers of 16 floats; AVX2 16 of 8 (an f32x16 takes two).
#if defined(__AVX512F__) || !defined(__AVX2__)
constexpr int kScoreBlocks = 6;   // x 4 pairs: 24 chains and 29 of the 32 registers
constexpr int kScorePairs = 4;
constexpr int kValueColumns = 4;  // x 6 pairs: 24 chains, 6 weights and a value
constexpr int kValuePairs = 6;
#else
constexpr int kScoreBlocks = 3;   // x 2 pairs: 12 chains, 2 query values and a key: 16
constexpr int kScorePairs = 2;
constexpr int kValueColumns = 2;  // x 3 pairs: 12 chains, 3 weights and a value: 16
constexpr int kValuePairs = 3;
#endif

// Scores of P pairs over blocks [0, blocks) of keys_t ([blocks * 16] into each w[p]).
template <int P>
void scores(const float* const* q, const float* keys_t, int64_t blocks, int64_t dim,
            float scale, float* const* w) {
  const int64_t stride = dim * kLanes;
  float* at[P];
  int64_t b = 0;
  auto tile = [&](auto blocks_at_once) {
    for (int p = 0; p < P; ++p) at[p] = w[p] + b * kLanes;
    score_tile<P, decltype(blocks_at_once)::value>(q, keys_t + b * stride, dim, scale, at);
    b += decltype(blocks_at_once)::value;
  };
  while (b + kScoreBlocks <= blocks) tile(std::integral_constant<int, kScoreBlocks>{});
  while (b + 2 <= blocks) tile(std::integral_constant<int, 2>{});
  while (b < blocks) tile(std::integral_constant<int, 1>{});
}

using Scores = void (*)(const float* const*, const float*, int64_t, int64_t, float,
                        float* const*);

// The tile for `pairs` pairs, 1 .. kScorePairs.
inline Scores pick_scores(int64_t pairs) {
  switch (std::min<int64_t>(pairs, kScorePairs)) {
    case 1: return scores<1>;
    case 2: return scores<2>;
    case 3: return scores<3>;
    default: return scores<kScorePairs>;
  }
}

// Scores to weights in place: exp(score - peak) for keys [lo, position] (counted from w's
// first key), exact zeros elsewhere; returns 1 / their sum (lane sums in key order, then
// the lanes, then the sink's share where the head has a sink logit).
inline float weights_of(float* w, int64_t blocks, int64_t lo, int64_t position,
                        const float* sink) {
  const float inf = std::numeric_limits<float>::infinity();
  f32x16 peaks = shoal_vec::splat(-inf);
  for (int64_t b = 0; b < blocks; ++b) {
    const f32x16 key = shoal_vec::iota(static_cast<float>(b * kLanes));
    const f32x16 score = shoal_vec::load(w + b * kLanes);
    const auto inside = (key >= static_cast<float>(lo)) & (key <= static_cast<float>(position));
    peaks = shoal_vec::select(inside & (score > peaks), score, peaks);
  }
  const float peak = sink ? std::max(*sink, shoal_vec::hmax(peaks)) : shoal_vec::hmax(peaks);
  f32x16 totals{};
  for (int64_t b = 0; b < blocks; ++b) {
    const f32x16 key = shoal_vec::iota(static_cast<float>(b * kLanes));
    const auto inside = (key >= static_cast<float>(lo)) & (key <= static_cast<float>(position));
    const f32x16 e = shoal_vec::exp(shoal_vec::load(w + b * kLanes) - peak);
    const f32x16 kept = shoal_vec::select(inside, e, f32x16{});
    shoal_vec::store(w + b * kLanes, kept);
    totals += kept;
  }
  const float total = shoal_vec::hsum(totals);
  return 1.f / (sink ? total + std::exp(*sink - peak) : total);
}

// The weighted values of P pairs over keys [from, to] for C column vectors (16 values each)
// starting at column `column`: each output element one chain in key order, held in
// registers; each value vector is loaded once for P pairs. The column split changes no bit.
template <int C, int P>
void add_value_columns(const float* values, int64_t dim, int64_t column, int64_t from,
                       int64_t to, const float* const* w, const float* inverse,
                       bf16* const* out) {
  f32x16 acc[P][C] = {};
  for (int64_t key = from; key <= to; ++key) {
    const float* v = values + key * dim + column;
    f32x16 weight[P];
    for (int p = 0; p < P; ++p) weight[p] = shoal_vec::splat(w[p][key]);
    for (int c = 0; c < C; ++c) {
      const f32x16 vc = shoal_vec::load(v + c * kLanes);
      for (int p = 0; p < P; ++p) acc[p][c] = shoal_vec::fma(weight[p], vc, acc[p][c]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < C; ++c)
      shoal_vec::store(out[p] + column + c * kLanes, acc[p][c] * inverse[p]);
}

// The weighted values of P pairs over the whole head (dim a multiple of 16), kValueColumns
// vectors a pass.
template <int P>
void add_values(const float* values, int64_t dim, int64_t from, int64_t to,
                const float* const* w, const float* inverse, bf16* const* out) {
  constexpr int64_t pass = kValueColumns * kLanes;
  int64_t column = 0;
  for (; column + pass <= dim; column += pass)
    add_value_columns<kValueColumns, P>(values, dim, column, from, to, w, inverse, out);
  for (; column < dim; column += kLanes)
    add_value_columns<1, P>(values, dim, column, from, to, w, inverse, out);
}

using AddValues = void (*)(const float*, int64_t, int64_t, int64_t, const float* const*,
                           const float*, bf16* const*);

// The pass for `pairs` pairs, 1 .. kValuePairs.
inline AddValues pick_add_values(int64_t pairs) {
  switch (std::min<int64_t>(pairs, kValuePairs)) {
    case 1: return add_values<1>;
    case 2: return add_values<2>;
    case 3: return add_values<3>;
    case 4: return add_values<4>;
    case 5: return add_values<5>;
    default: return add_values<kValuePairs>;
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
  auto weights_at = [&](int64_t pair) { return scratch.weights.data() + pair * length; };
  // Where a pair's query and output sit: [rows, heads, dim].
  auto pair_at = [&](int64_t pair) {
    return ((first + pair / group) * rows.heads + g * group + pair % group) * dim;
  };
  for (int64_t pair = 0; pair < pairs;) {
    const int64_t at_once = std::min<int64_t>(kScorePairs, pairs - pair);
    const float* q[kScorePairs];
    float* w[kScorePairs];
    for (int64_t p = 0; p < at_once; ++p) {
      q[p] = rows.q + pair_at(pair + p);
      w[p] = weights_at(pair + p);
    }
    pick_scores(at_once)(q, keys_t + skip * dim * kLanes, blocks, dim, rows.scale, w);
    pair += at_once;
  }
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t r = first + pair / group;
    const float* sink = rows.sinks ? rows.sinks + g * group + pair % group : nullptr;
    scratch.inverse[pair] = weights_of(weights_at(pair), blocks, rows.lo[r] - item_key,
                                       rows.position[r] - item_key, sink);
  }
  // Values: keys outside [lowest, last] have zero weight in every pair; skipping them
  // adds nothing. Pointers are shifted so w[key] and values[key * dim] are that position's.
  const float* shifted = values - s.first_key * dim;
  auto weights = [&](int64_t pair) { return weights_at(pair) - item_key; };
  if (dim % kLanes != 0) {
    scratch.acc.resize(dim);
    for (int64_t pair = 0; pair < pairs; ++pair)
      add_values_scalar(shifted, dim, lowest, last, weights(pair), scratch.inverse[pair],
                        scratch.acc.data(), out + pair_at(pair));
    return;
  }
  for (int64_t pair = 0; pair < pairs;) {
    const int64_t at_once = std::min<int64_t>(kValuePairs, pairs - pair);
    const float* w[kValuePairs];
    bf16* o[kValuePairs];
    for (int64_t p = 0; p < at_once; ++p) {
      w[p] = weights(pair + p);
      o[p] = out + pair_at(pair + p);
    }
    pick_add_values(at_once)(shifted, dim, lowest, last, w, scratch.inverse.data() + pair, o);
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
