// Decode attention over the paged float32 KV cache: one query token per row, its keys read
// through the row's block table (no gather).
//
// Work items are (row, KV head) pairs; the query heads that share a KV head read each key
// and value once. For head sizes that are multiples of 16 (32, 64, 128, ...) an item runs
// on the compiler's generic 16-float vectors (one AVX-512 register, two AVX2 ones, four on
// NEON), with the queries and the output accumulators held in registers; other head sizes
// take a scalar loop. At 16 rows of a few hundred tokens, scalar attention took a third of
// a decode step on the built-in model; this form took it to about a fifth, where reading
// the float32 keys and values from memory is most of its cost.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vector.h"

namespace shoal_attention {

using shoal_vec::bf16;
using shoal_vec::f32x16;
using shoal_vec::kLanes;

// Keys are 16-slot runs scattered over the cache by the block table; asking for a row this
// many keys ahead hides the latency the hardware prefetcher cannot (it does not know the
// next block).
constexpr int64_t kPrefetchKeys = 8;

// Brings a row of NV * 16 floats toward the cache, one prefetch per 64-byte line.
template <int NV>
inline void prefetch_row(const float* row) {
  for (int c = 0; c < NV; ++c) __builtin_prefetch(row + kLanes * c);
}

// Position p's row of a key or value plane ([slots, kLanes * NV]) into vectors, prefetching
// the row kPrefetchKeys positions ahead (rows lie wherever the block table put them).
template <int NV>
inline void load_row(const float* plane, const int64_t* key_slots, int64_t p, int64_t length,
                     f32x16 (&row)[NV]) {
  constexpr int64_t D = kLanes * NV;
  if (p + kPrefetchKeys < length) prefetch_row<NV>(plane + key_slots[p + kPrefetchKeys] * D);
  const float* r = plane + key_slots[p] * D;
  for (int c = 0; c < NV; ++c) row[c] = shoal_vec::load(r + kLanes * c);
}

// The shape of one layer's attention and where its cache lies.
// cache: [2 * kv_heads, slots, dim] float32, keys of KV head g in plane g, values in
// plane kv_heads + g. q: [B, heads, dim] float32 (rotated). out: [B, heads * dim] bf16.
struct Layout {
  int64_t heads, kv_heads, dim, slots;
  float scale;
};

// Softmax of each query head's scores in place ([group, length]); returns 1 / sum for each.
inline void softmax_rows(float* scores, int64_t group, int64_t length, float* inverse_total) {
  for (int64_t j = 0; j < group; ++j) {
    float* s = scores + j * length;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < length; ++p) peak = std::max(peak, s[p]);
    f32x16 totals{};
    int64_t p = 0;
    for (; p + kLanes <= length; p += kLanes) {
      const f32x16 e = shoal_vec::exp(shoal_vec::load(s + p) - peak);
      shoal_vec::store(s + p, e);
      totals += e;
    }
    float total = shoal_vec::hsum(totals);
    for (; p < length; ++p) {
      s[p] = std::exp(s[p] - peak);
      total += s[p];
    }
    inverse_total[j] = 1.f / total;
  }
}

// Query heads [j0, j0 + G) of one item, head size kLanes * NV. q: the item's first query head;
// keys / values: the KV head's planes; scores: scratch [group, length].
template <int NV, int G>
void attend_vector(const float* q, const float* keys, const float* values,
                   const int64_t* key_slots, int64_t length, float scale, float* scores,
                   bf16* out) {
  constexpr int64_t D = kLanes * NV;
  f32x16 qv[G][NV];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < NV; ++c) qv[j][c] = shoal_vec::load(q + j * D + kLanes * c);
  for (int64_t p = 0; p < length; ++p) {
    f32x16 kv[NV];
    load_row<NV>(keys, key_slots, p, length, kv);
    for (int j = 0; j < G; ++j) {
      f32x16 dot = qv[j][0] * kv[0];
      for (int c = 1; c < NV; ++c) dot += qv[j][c] * kv[c];
      scores[j * length + p] = shoal_vec::hsum(dot) * scale;
    }
  }
  float inverse_total[G];
  softmax_rows(scores, G, length, inverse_total);
  f32x16 acc[G][NV] = {};
  for (int64_t p = 0; p < length; ++p) {
    f32x16 vv[NV];
    load_row<NV>(values, key_slots, p, length, vv);
    for (int j = 0; j < G; ++j) {
      const float weight = scores[j * length + p];
      for (int c = 0; c < NV; ++c) acc[j][c] += weight * vv[c];
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < NV; ++c) {
      shoal_vec::store(out + j * D + kLanes * c, acc[j][c] * inverse_total[j]);
    }
}

// Any head size and group: the same arithmetic in scalar loops.
inline void attend_scalar(const float* q, const float* keys, const float* values,
                          const int64_t* key_slots, int64_t length, int64_t group, int64_t dim,
                          float scale, float* scores, bf16* out) {
  for (int64_t p = 0; p < length; ++p) {
    const float* k = keys + key_slots[p] * dim;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * dim;
      float dot = 0.f;
      for (int64_t i = 0; i < dim; ++i) dot += qj[i] * k[i];
      scores[j * length + p] = dot * scale;
    }
  }
  std::vector<float> inverse_total(group), acc(group * dim, 0.f);
  softmax_rows(scores, group, length, inverse_total.data());
  for (int64_t p = 0; p < length; ++p) {
    const float* v = values + key_slots[p] * dim;
    for (int64_t j = 0; j < group; ++j) {
      const float weight = scores[j * length + p];
      float* a = acc.data() + j * dim;
      for (int64_t i = 0; i < dim; ++i) a[i] += weight * v[i];
    }
  }
  for (int64_t j = 0; j < group; ++j)
    for (int64_t i = 0; i < dim; ++i) out[j * dim + i] = bf16(acc[j * dim + i] * inverse_total[j]);
}

using VectorFn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t,
                          float, float*, bf16*);

// Query heads go through attend_vector up to this many at a time (4 heads x 8 vectors of
// queries fill half of AVX-512's registers).
constexpr int64_t kMaxHeadsAtOnce = 4;

// nullptr where the head size has no vector form.
template <int NV>
VectorFn vector_fn(int64_t heads_at_once) {
  switch (heads_at_once) {
    case 1: return attend_vector<NV, 1>;
    case 2: return attend_vector<NV, 2>;
    case 3: return attend_vector<NV, 3>;
    default: return attend_vector<NV, 4>;
  }
}

inline VectorFn pick_vector_fn(int64_t dim, int64_t heads_at_once) {
  switch (dim) {
    case 16: return vector_fn<1>(heads_at_once);
    case 32: return vector_fn<2>(heads_at_once);
    case 64: return vector_fn<4>(heads_at_once);
    case 128: return vector_fn<8>(heads_at_once);
    default: return nullptr;
  }
}

// Row b's query heads of KV head g over its keys key_slots[0 .. length).
inline void attend_item(const Layout& layout, const float* q_p, const float* cache_p,
                        const int64_t* key_slots, int64_t length, int64_t b, int64_t g,
                        std::vector<float>& scores, bf16* out_p) {
  const int64_t dim = layout.dim, group = layout.heads / layout.kv_heads;
  const float* keys = cache_p + g * layout.slots * dim;
  const float* values = cache_p + (layout.kv_heads + g) * layout.slots * dim;
  const int64_t head0 = b * layout.heads + g * group;  // the item's first query head
  if (pick_vector_fn(dim, 1) == nullptr) {
    scores.resize(group * length);
    attend_scalar(q_p + head0 * dim, keys, values, key_slots, length, group, dim,
                  layout.scale, scores.data(), out_p + head0 * dim);
    return;
  }
  scores.resize(std::min(group, kMaxHeadsAtOnce) * length);
  for (int64_t j0 = 0; j0 < group; j0 += kMaxHeadsAtOnce) {
    const int64_t at_once = std::min(kMaxHeadsAtOnce, group - j0);
    pick_vector_fn(dim, at_once)(q_p + (head0 + j0) * dim, keys, values, key_slots, length,
                                 layout.scale, scores.data(), out_p + (head0 + j0) * dim);
  }
}

// All rows and KV heads of one layer. Row b's keys lie in key_slots[first[b] .. first[b+1]).
// prepare(b, g) runs first in each item: it writes the row's rotated queries of KV head g
// and its new key and value, which the item then reads. Items run on torch's intra-op
// threads once there are parallel_keys key-head pairs.
template <typename Prepare>
void attend(const Layout& layout, const float* q_p, const float* cache_p,
            const std::vector<int64_t>& key_slots, const std::vector<int64_t>& first,
            int64_t rows, int64_t parallel_keys, bf16* out_p, const Prepare& prepare) {
  const int64_t items = rows * layout.kv_heads;
  const int64_t grain = first[rows] * layout.kv_heads >= parallel_keys ? 1 : items;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / layout.kv_heads, g = item % layout.kv_heads;
      prepare(b, g);
      attend_item(layout, q_p, cache_p, key_slots.data() + first[b], first[b + 1] - first[b],
                  b, g, scores, out_p);
    }
  });
}

}  // namespace shoal_attention
