// Decode attention over the paged KV cache (float32, bf16 or int8 elements, E below): one
// query token per row, its keys read through the row's block table (no gather). int8 rows
// (kv_layout.h) are dequantized in registers as they are loaded.
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

#include "kv_layout.h"
#include "vector.h"

namespace shoal_attention {

using shoal_vec::bf16;
using shoal_vec::f32x16;
using shoal_vec::kLanes;

// Keys are 16-slot runs scattered over the cache by the block table; asking for a row this
// many keys ahead hides the latency the hardware prefetcher cannot (it does not know the
// next block).
constexpr int64_t kPrefetchKeys = 8;

// Brings a row of NV * 16 elements toward the cache, one prefetch per 64-byte line (an
// int8 row's scales may start or spill onto one more line).
template <int NV, typename E>
inline void prefetch_row(const E* row) {
  constexpr int kPerLine = 64 / sizeof(E);
  for (int c = 0; c < NV * kLanes; c += kPerLine) __builtin_prefetch(row + c);
  if constexpr (shoal_kv::kQuantized<E>)
    __builtin_prefetch(row + shoal_kv::row_width<E>(NV * kLanes) - 1);
}

// Position p's row of a key or value plane ([slots, W]) into float vectors, prefetching the
// row kPrefetchKeys positions ahead (rows lie wherever the block table put them).
template <int NV, typename E>
inline void load_row(const E* plane, const int64_t* key_slots, int64_t p, int64_t length,
                     f32x16 (&row)[NV]) {
  constexpr int64_t D = kLanes * NV, W = shoal_kv::row_width<E>(D);
  if (p + kPrefetchKeys < length) prefetch_row<NV>(plane + key_slots[p + kPrefetchKeys] * W);
  const E* r = plane + key_slots[p] * W;
  for (int c = 0; c < NV; ++c) row[c] = shoal_vec::load(r + kLanes * c);
  if constexpr (shoal_kv::kQuantized<E>) {
    constexpr int kGroups = D / shoal_kv::group_size(D), kPerScale = NV / kGroups;
    float scales[kGroups];  // widened together: one vector op, not one per scale
    shoal_kv::group_scales<kGroups>(r, D, scales);
    for (int c = 0; c < NV; ++c) row[c] *= scales[c / kPerScale];
  }
}

// The shape of one layer's attention and where its cache lies.
// cache: [2 * kv_heads, slots, W] of E (W = dim; for int8, dim values and their scales),
// keys of KV head g in plane g, values in plane kv_heads + g. q: [B, heads, dim] float32
// (rotated). out: [B, heads * dim] bf16.
// sinks: [heads] float32 logits that join each head's softmax denominator with no value
// (gpt-oss's attention sinks), or nullptr.
struct Layout {
  int64_t heads, kv_heads, dim, slots;
  float scale;
  const float* sinks = nullptr;
};

// Softmax of each query head's scores in place ([group, length]); returns 1 / sum for each.
// sinks: the group's heads' sink logits (counted in the peak and the sum), or nullptr.
inline void softmax_rows(float* scores, int64_t group, int64_t length, float* inverse_total,
                         const float* sinks) {
  for (int64_t j = 0; j < group; ++j) {
    float* s = scores + j * length;
    float peak = sinks ? sinks[j] : -std::numeric_limits<float>::infinity();
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
    if (sinks) total += std::exp(sinks[j] - peak);
    inverse_total[j] = 1.f / total;
  }
}

// Query heads [j0, j0 + G) of one item, head size kLanes * NV. q: the item's first query head;
// keys / values: the KV head's planes; scores: scratch [group, length].
template <int NV, int G, typename E>
void attend_vector(const float* q, const E* keys, const E* values,
                   const int64_t* key_slots, int64_t length, float scale, float* scores,
                   bf16* out, const float* sinks) {
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
  softmax_rows(scores, G, length, inverse_total, sinks);
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
template <typename E>
void attend_scalar(const float* q, const E* keys, const E* values,
                          const int64_t* key_slots, int64_t length, int64_t group, int64_t dim,
                          float scale, float* scores, bf16* out, const float* sinks) {
  const int64_t width = shoal_kv::row_width<E>(dim);
  for (int64_t p = 0; p < length; ++p) {
    const E* k = keys + key_slots[p] * width;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * dim;
      float dot = 0.f;
      for (int64_t i = 0; i < dim; ++i) dot += qj[i] * shoal_kv::element(k, dim, i);
      scores[j * length + p] = dot * scale;
    }
  }
  std::vector<float> inverse_total(group), acc(group * dim, 0.f);
  softmax_rows(scores, group, length, inverse_total.data(), sinks);
  for (int64_t p = 0; p < length; ++p) {
    const E* v = values + key_slots[p] * width;
    for (int64_t j = 0; j < group; ++j) {
      const float weight = scores[j * length + p];
      float* a = acc.data() + j * dim;
      for (int64_t i = 0; i < dim; ++i) a[i] += weight * shoal_kv::element(v, dim, i);
    }
  }
  for (int64_t j = 0; j < group; ++j)
    for (int64_t i = 0; i < dim; ++i) out[j * dim + i] = bf16(acc[j * dim + i] * inverse_total[j]);
}

template <typename E>
using VectorFn = void (*)(const float*, const E*, const E*, const int64_t*, int64_t, float,
                          float*, bf16*, const float*);

// Query heads go through attend_vector up to this many at a time (4 heads x 8 vectors of
// queries fill half of AVX-512's registers); heads of 256 go one at a time.
inline int64_t max_heads_at_once(int64_t dim) { return dim > 128 ? 1 : 4; }

// nullptr where the head size has no vector form.
template <int NV, typename E>
VectorFn<E> vector_fn(int64_t heads_at_once) {
  switch (heads_at_once) {
    case 1: return attend_vector<NV, 1, E>;
    case 2: return attend_vector<NV, 2, E>;
    case 3: return attend_vector<NV, 3, E>;
    default: return attend_vector<NV, 4, E>;
  }
}

template <typename E>
VectorFn<E> pick_vector_fn(int64_t dim, int64_t heads_at_once) {
  switch (dim) {
    case 16: return vector_fn<1, E>(heads_at_once);
    case 32: return vector_fn<2, E>(heads_at_once);
    case 64: return vector_fn<4, E>(heads_at_once);
    case 128: return vector_fn<8, E>(heads_at_once);
    case 256: return attend_vector<16, 1, E>;
    default: return nullptr;
  }
}

// Row b's query heads of KV head g over its keys key_slots[0 .. length).
template <typename E>
void attend_item(const Layout& layout, const float* q_p, const E* cache_p,
                 const int64_t* key_slots, int64_t length, int64_t b, int64_t g,
                 std::vector<float>& scores, bf16* out_p) {
  const int64_t dim = layout.dim, group = layout.heads / layout.kv_heads;
  const int64_t width = shoal_kv::row_width<E>(dim);
  const E* keys = cache_p + g * layout.slots * width;
  const E* values = cache_p + (layout.kv_heads + g) * layout.slots * width;
  const int64_t head0 = b * layout.heads + g * group;  // the item's first query head
  // The sinks of the item's heads (heads g * group .. of the layer), if any.
  auto sinks_from = [&](int64_t j) {
    return layout.sinks ? layout.sinks + g * group + j : nullptr;
  };
  if (pick_vector_fn<E>(dim, 1) == nullptr) {
    scores.resize(group * length);
    attend_scalar(q_p + head0 * dim, keys, values, key_slots, length, group, dim,
                  layout.scale, scores.data(), out_p + head0 * dim, sinks_from(0));
    return;
  }
  const int64_t most = max_heads_at_once(dim);
  scores.resize(std::min(group, most) * length);
  for (int64_t j0 = 0; j0 < group; j0 += most) {
    const int64_t at_once = std::min(most, group - j0);
    pick_vector_fn<E>(dim, at_once)(q_p + (head0 + j0) * dim, keys, values, key_slots, length,
                                    layout.scale, scores.data(), out_p + (head0 + j0) * dim,
                                    sinks_from(j0));
  }
}

// All rows and KV heads of one layer. Row b's keys are key_slots[start[b] .. start[b] +
// length[b]). prepare(b, g) runs first in each item: it writes the row's rotated queries
// of KV head g and its new key and value, which the item then reads. Items run on torch's
// intra-op threads once there are parallel_keys key-head pairs.
template <typename E, typename Prepare>
void attend(const Layout& layout, const float* q_p, const E* cache_p, const int64_t* key_slots,
            const int64_t* start, const int64_t* length, int64_t rows, int64_t parallel_keys,
            bf16* out_p, const Prepare& prepare) {
  const int64_t items = rows * layout.kv_heads;
  int64_t keys = 0;
  for (int64_t b = 0; b < rows; ++b) keys += length[b];
  const int64_t grain = keys * layout.kv_heads >= parallel_keys ? 1 : items;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / layout.kv_heads, g = item % layout.kv_heads;
      prepare(b, g);
      attend_item(layout, q_p, cache_p, key_slots + start[b], length[b], b, g, scores, out_p);
    }
  });
}

}  // namespace shoal_attention
