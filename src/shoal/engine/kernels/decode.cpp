// Fused decode on CPU: every block of a llama-family or Gemma 3 model for a batch of
// single-token rows in one call, bf16 activations, packed weights (quant.h), a paged KV
// cache of float32, bf16 or int8 (rows with their scales, kv_layout.h).
//
// A batch-1 decode step in Python calls ~35 torch ops per block (~1,000 per step); at a few
// microseconds of dispatch each, that overhead is as large as the matmuls. Here one call
// runs every block: the projections are QuantLinear calls, attention reads the paged cache
// in place (attention.h), and the small ops (norms, RoPE, the KV write, the gated
// activation, residual adds) are loops over a few hundred floats (decode_rows.h).
//
// Gemma 3 adds per-head q / k norms (float32), norms on the attention and MLP outputs, a
// gelu-tanh gate, and sliding layers that attend to the last `window` keys with their own
// rotary table.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "attention.h"
#include "decode_rows.h"
#include "kv_layout.h"
#include "prompt_attention.h"
#include "quant.h"
#include "quant_experts.h"

namespace {

using shoal_decode::bf16;
using shoal_quant::QuantLinear;
using shoal_quant::RoutedFeedForward;

// Attention runs on several threads from this many (key, KV head) pairs per layer; below
// it a parallel region costs more than it saves.
constexpr int64_t kParallelKeys = 1536;

// Norm weights of one block, in the order Python passes them (absent ones are empty).
struct Norms {
  at::Tensor attn, mlp;             // [hidden] bf16
  at::Tensor post_attn, post_mlp;   // [hidden] bf16 (Gemma)
  at::Tensor q, k;                  // [head_dim] float32 (Gemma; Qwen3)
};

struct Block {
  Norms norms;
  std::shared_ptr<QuantLinear> qkv, o, gate_up, down;  // gate_up, down: null where moe is set
  std::shared_ptr<RoutedFeedForward> moe;               // a mixture-of-experts block's MLP
  bool sliding;
};

at::Tensor given(const at::Tensor& tensor) {
  return tensor.numel() ? tensor.contiguous() : at::Tensor();
}

const bf16* bf16_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<bf16>() : nullptr; }

class Decoder {
 public:
  // norms: per block attn, mlp, post_attn, post_mlp, q, k (empty tensors where absent);
  // linears: per block qkv, o, gate_up, down (gate_up and down null in a mixture-of-experts
  // block); moe: per block its experts, or null (a dense block); sliding: per block.
  Decoder(const std::vector<at::Tensor>& norms,
          const std::vector<std::shared_ptr<QuantLinear>>& linears,
          const std::vector<std::shared_ptr<RoutedFeedForward>>& moe,
          const std::vector<bool>& sliding, int64_t heads, int64_t kv_heads, int64_t head_dim,
          double scale, double eps, int64_t window, bool gelu)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        scale_(static_cast<float>(scale)), eps_(static_cast<float>(eps)), window_(window),
        gelu_(gelu) {
    const size_t blocks = sliding.size();
    TORCH_CHECK(norms.size() == 6 * blocks && linears.size() == 4 * blocks &&
                    moe.size() == blocks,
                "Decoder: 6 norms, 4 linears and one experts entry per block");
    TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0,
                "Decoder: heads must be a multiple of kv heads");
    for (size_t i = 0; i < blocks; ++i) {
      const at::Tensor* n = &norms[6 * i];
      Block block{{given(n[0]), given(n[1]), given(n[2]), given(n[3]), given(n[4]),
                   given(n[5])},
                  linears[4 * i], linears[4 * i + 1], linears[4 * i + 2], linears[4 * i + 3],
                  moe[i], sliding[i]};
      TORCH_CHECK(block.norms.attn.scalar_type() == at::kBFloat16 &&
                      block.norms.mlp.scalar_type() == at::kBFloat16,
                  "Decoder: norm weights must be bfloat16");
      TORCH_CHECK(!block.norms.q.defined() || block.norms.q.scalar_type() == at::kFloat,
                  "Decoder: q / k norm weights must be float32");
      TORCH_CHECK(block.qkv && block.o && (block.moe || (block.gate_up && block.down)),
                  "Decoder: a block lacks a projection");
      blocks_.push_back(std::move(block));
    }
  }

  // hidden: [B, hidden] bf16 -> [B, hidden] bf16 after every block.
  // caches: per block [2 * H_kv, slots, W] float32 or bf16 (W = D), or int8 (each row's D
  // values, then its groups' bf16 scales, kv_layout.h) -- keys, then values.
  // rope: (cos, signed sin) [B, D] float32 for full layers, then for sliding layers (the
  // same pair again where a model has one table); slots: [B] int64, each row's new KV slot;
  // tables: [B, W] int64 block ids; context: [B] int64, each row's keys (new one included).
  // chained: some rows read keys that other rows of the step write (consecutive positions
  // of one request: guesses being verified), so every row's key and value are written
  // before any row attends.
  at::Tensor forward(const at::Tensor& hidden, const std::vector<at::Tensor>& caches,
                     const std::vector<at::Tensor>& rope, const at::Tensor& slots,
                     const at::Tensor& tables, const at::Tensor& context,
                     int64_t block_size, bool chained) const {
    TORCH_CHECK(caches.size() == blocks_.size(), "Decoder: one KV cache per block");
    TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2,
                "Decoder: hidden must be [B, hidden] bfloat16");
    TORCH_CHECK(rope.size() == 4, "Decoder: rope is (cos, sin) for full, then sliding layers");
    const int64_t rows = hidden.size(0);
    for (const at::Tensor& t : rope)
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 &&
                      t.size(0) == rows && t.size(1) == head_dim_,
                  "Decoder: cos and sin must be [B, head_dim] float32");
    TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                    context.scalar_type() == at::kLong && slots.is_contiguous() &&
                    context.is_contiguous() && tables.dim() == 2 && slots.size(0) == rows &&
                    tables.size(0) == rows && context.size(0) == rows,
                "Decoder: slots, tables and context must be int64, one per row");
    TORCH_CHECK(block_size >= 1, "Decoder: block_size must be >= 1");
    if (blocks_.empty()) return hidden.clone();
    const at::ScalarType dtype = caches[0].scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar,
                "Decoder: KV caches must be float32, bfloat16 or int8");
    Step step = plan(rows, caches, tables.contiguous(), context, slots, block_size);
    step.chained = chained;
    if (dtype == at::kFloat) return run<float>(hidden, caches, rope, step);
    if (dtype == at::kChar) return run<int8_t>(hidden, caches, rope, step);
    return run<bf16>(hidden, caches, rope, step);
  }

 private:
  // Where each row's keys lie, checked once (the loops below do not check).
  struct Step {
    int64_t rows, slots_per_cache;
    std::vector<int64_t> key_slots;           // row b's keys: [first[b], first[b] + ctx[b])
    std::vector<int64_t> first, ctx, new_slot;
    std::vector<int64_t> window_first, window_length;  // the last `window` keys of each row
    bool chained = false;  // see forward()
  };

  Step plan(int64_t rows, const std::vector<at::Tensor>& caches, const at::Tensor& tables,
            const at::Tensor& context, const at::Tensor& slots, int64_t block_size) const {
    Step step{rows, caches[0].size(1), {}, std::vector<int64_t>(rows + 1, 0),
              std::vector<int64_t>(rows), std::vector<int64_t>(rows),
              std::vector<int64_t>(rows), std::vector<int64_t>(rows)};
    const int64_t* table = tables.data_ptr<int64_t>();
    const int64_t width = tables.size(1);
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t ctx = context.data_ptr<int64_t>()[b];
      TORCH_CHECK(ctx >= 1 && (ctx - 1) / block_size < width,
                  "Decoder: a row's context is longer than its block table");
      step.ctx[b] = ctx;
      step.new_slot[b] = slots.data_ptr<int64_t>()[b];
      TORCH_CHECK(step.new_slot[b] >= 0 && step.new_slot[b] < step.slots_per_cache,
                  "Decoder: slot out of range");
      step.first[b + 1] = step.first[b] + ctx;
      const int64_t seen = window_ > 0 ? std::min(ctx, window_) : ctx;
      step.window_first[b] = step.first[b] + ctx - seen;
      step.window_length[b] = seen;
    }
    step.key_slots.resize(step.first[rows]);
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t p = 0; p < step.ctx[b]; ++p) {
        const int64_t block_id = table[b * width + p / block_size];
        TORCH_CHECK(block_id >= 0 && (block_id + 1) * block_size <= step.slots_per_cache,
                    "Decoder: block id out of range");
        step.key_slots[step.first[b] + p] = block_id * block_size + p % block_size;
      }
    const int64_t row = caches[0].scalar_type() == at::kChar
                            ? shoal_kv::row_width<int8_t>(head_dim_) : head_dim_;
    for (const at::Tensor& cache : caches)
      TORCH_CHECK(cache.is_contiguous() && cache.scalar_type() == caches[0].scalar_type() &&
                      cache.dim() == 3 && cache.size(0) == 2 * kv_heads_ &&
                      cache.size(1) == step.slots_per_cache && cache.size(2) == row,
                  "Decoder: KV caches must be [2 * H_kv, slots, W], contiguous, one dtype");
    return step;
  }

  template <typename E>
  at::Tensor run(const at::Tensor& hidden, const std::vector<at::Tensor>& caches,
                 const std::vector<at::Tensor>& rope, const Step& step) const {
    const int64_t rows = step.rows, width = hidden.size(1);
    at::Tensor h = hidden.contiguous().clone();
    at::Tensor x = at::empty_like(h);
    // A block's last residual add is deferred into the next block's first pass over the rows.
    at::Tensor pending;
    for (size_t layer = 0; layer < blocks_.size(); ++layer) {
      const Block& block = blocks_[layer];
      norm_rows(h, pending, block.norms.attn, x, width);
      const at::Tensor attn = attention<E>(block, x, caches[layer], rope, step);
      at::Tensor o = block.o->forward(attn, false);  // [B, hidden]
      post_norm(block.norms.post_attn, o, width);
      norm_rows(h, o, block.norms.mlp, x, width);
      if (block.moe) {
        pending = block.moe->forward(x);  // [B, hidden]
        post_norm(block.norms.post_mlp, pending, width);
        continue;
      }
      const at::Tensor gate_up = block.gate_up->forward(x, false);  // [B, 2 F]: gate, then up
      const int64_t ffn = gate_up.size(1) / 2;
      at::Tensor act = at::empty({rows, ffn}, h.options());
      const bf16* gu = gate_up.data_ptr<bf16>();
      bf16* act_p = act.data_ptr<bf16>();
      shoal_decode::for_rows(rows, [&](int64_t b) {
        if (gelu_) {
          shoal_decode::gated<true>(gu + b * 2 * ffn, gu + b * 2 * ffn + ffn, act_p + b * ffn, ffn);
        } else {
          shoal_decode::gated<false>(gu + b * 2 * ffn, gu + b * 2 * ffn + ffn, act_p + b * ffn,
                                     ffn);
        }
      });
      pending = block.down->forward(act, false);
      post_norm(block.norms.post_mlp, pending, width);
    }
    bf16* h_p = h.data_ptr<bf16>();
    const bf16* pending_p = pending.data_ptr<bf16>();
    shoal_decode::for_rows(rows, [&](int64_t b) {
      shoal_decode::residual_add(h_p + b * width, pending_p + b * width, width);
    });
    return h;
  }

  // h += delta (if any), then x = norm(h), row by row.
  void norm_rows(at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight, at::Tensor& x,
                 int64_t width) const {
    bf16* h_p = h.data_ptr<bf16>();
    bf16* x_p = x.data_ptr<bf16>();
    const bf16* delta_p = bf16_or_null(delta);
    const bf16* w = weight.data_ptr<bf16>();
    shoal_decode::for_rows(h.size(0), [&](int64_t b) {
      if (delta_p != nullptr)
        shoal_decode::residual_add(h_p + b * width, delta_p + b * width, width);
      shoal_decode::rms_norm(h_p + b * width, w, x_p + b * width, width, eps_);
    });
  }

  // Gemma's norm of a branch output, in place (nothing where the model has none).
  void post_norm(const at::Tensor& weight, at::Tensor& y, int64_t width) const {
    if (!weight.defined()) return;
    bf16* y_p = y.data_ptr<bf16>();
    const bf16* w = weight.data_ptr<bf16>();
    shoal_decode::for_rows(y.size(0), [&](int64_t b) {
      shoal_decode::rms_norm(y_p + b * width, w, y_p + b * width, width, eps_);
    });
  }

  // The qkv projection, q / k norms, RoPE, the KV write and attention: [B, H * D] bf16.
  template <typename E>
  at::Tensor attention(const Block& block, const at::Tensor& x, const at::Tensor& cache,
                       const std::vector<at::Tensor>& rope, const Step& step) const {
    const int64_t rows = step.rows, dim = head_dim_, group = heads_ / kv_heads_;
    const at::Tensor qkv = block.qkv->forward(x, false);  // [B, (H + 2 H_kv) D]
    const bf16* qkv_p = qkv.data_ptr<bf16>();
    const int64_t qkv_width = qkv.size(1);
    at::Tensor attn = at::empty({rows, heads_ * dim}, x.options());
    at::Tensor q = at::empty({rows, heads_, dim}, x.options().dtype(at::kFloat));
    float* q_p = q.data_ptr<float>();
    E* cache_p = cache.data_ptr<E>();
    const float* cos = rope[block.sliding ? 2 : 0].data_ptr<float>();
    const float* sin = rope[block.sliding ? 3 : 1].data_ptr<float>();
    const float* q_norm = block.norms.q.defined() ? block.norms.q.data_ptr<float>() : nullptr;
    const float* k_norm = block.norms.k.defined() ? block.norms.k.data_ptr<float>() : nullptr;
    const int64_t slots = step.slots_per_cache, width = shoal_kv::row_width<E>(dim);
    // One head of row b: float32, normed where the model norms it, rotated into out.
    auto head = [&](int64_t b, int64_t index, const float* norm, float* out) {
      float raw[512];  // head_dim <= 512 (checked in the binding)
      const bf16* src = qkv_p + b * qkv_width + index * dim;
      for (int64_t i = 0; i < dim; ++i) raw[i] = src[i];
      if (norm != nullptr) shoal_decode::rms_norm_f32(raw, norm, dim, eps_);
      shoal_decode::rotate(raw, cos + b * dim, sin + b * dim, out, dim);
    };
    // Item (b, g): its query heads into q, its key and value into the cache.
    auto prepare = [&](int64_t b, int64_t g) {
      for (int64_t j = g * group; j < (g + 1) * group; ++j)
        head(b, j, q_norm, q_p + (b * heads_ + j) * dim);
      float key[512], value[512];
      head(b, heads_ + g, k_norm, key);
      const bf16* v = qkv_p + b * qkv_width + (heads_ + kv_heads_ + g) * dim;
      for (int64_t i = 0; i < dim; ++i) value[i] = static_cast<float>(v[i]);
      shoal_kv::write_row(key, dim, cache_p + (g * slots + step.new_slot[b]) * width);
      shoal_kv::write_row(value, dim,
                          cache_p + ((kv_heads_ + g) * slots + step.new_slot[b]) * width);
    };
    const shoal_attention::Layout layout{heads_, kv_heads_, dim, slots, scale_};
    const bool windowed = block.sliding && window_ > 0;
    const int64_t* first = windowed ? step.window_first.data() : step.first.data();
    const int64_t* length = windowed ? step.window_length.data() : step.ctx.data();
    if (!step.chained) {
      shoal_attention::attend(layout, q_p, cache_p, step.key_slots.data(), first, length, rows,
                              kParallelKeys, attn.data_ptr<bf16>(), prepare);
      return attn;
    }
    // The same arithmetic in two passes: every row's query, key and value, then attention.
    at::parallel_for(0, rows * kv_heads_, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) prepare(item / kv_heads_, item % kv_heads_);
    });
    shoal_attention::attend(layout, q_p, cache_p, step.key_slots.data(), first, length, rows,
                            kParallelKeys, attn.data_ptr<bf16>(), [](int64_t, int64_t) {});
    return attn;
  }

  std::vector<Block> blocks_;
  int64_t heads_, kv_heads_, head_dim_;
  float scale_, eps_;
  int64_t window_;  // sliding layers' key window; 0: none
  bool gelu_;
};

// RMSNorm of bf16 rows [T, D] with a bf16 weight [D] -> [T, D] bf16, each row alone and
// rounded once, as the decoder's own pass (the Python path's bf16 rows: torch's rms_norm
// for bf16 makes seven passes over float32 copies, ~2.5x the time of this one).
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "rms_norm_rows: x must be [T, D] contiguous bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm_rows: weight must be [", x.size(1), "] bfloat16");
  at::Tensor out = at::empty_like(x);
  const int64_t width = x.size(1);
  const bf16* in = x.data_ptr<bf16>();
  const bf16* w = weight.data_ptr<bf16>();
  bf16* normed = out.data_ptr<bf16>();
  shoal_decode::for_rows(x.size(0), [&](int64_t b) {
    shoal_decode::rms_norm(in + b * width, w, normed + b * width, width, static_cast<float>(eps));
  });
  return out;
}

// act(gate) * up per row of a [T, 2F] bf16 gate/up projection -> [T, F] bf16, rounded as
// the decoder's own pass (the Python path's prompt rows).
at::Tensor gated(const at::Tensor& gate_up, bool gelu) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 &&
                  gate_up.size(1) % 2 == 0, "gated: gate_up must be [T, 2F] bfloat16");
  const at::Tensor in = gate_up.contiguous();
  const int64_t rows = in.size(0), ffn = in.size(1) / 2;
  at::Tensor out = at::empty({rows, ffn}, in.options());
  const bf16* gu = in.data_ptr<bf16>();
  bf16* act = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (gelu) {
        shoal_decode::gated<true>(gu + b * 2 * ffn, gu + b * 2 * ffn + ffn, act + b * ffn, ffn);
      } else {
        shoal_decode::gated<false>(gu + b * 2 * ffn, gu + b * 2 * ffn + ffn, act + b * ffn, ffn);
      }
    }
  });
  return out;
}

// Attention of prompt rows (the Python path's prefill): row r's queries q[r] ([H, D] float32,
// rotated) over the keys at key_slots[start[r] .. start[r] + length[r]) of a layer's cache
// (its own key written there first) -> [T, H * D] bf16. Each row is computed alone, its
// keys in order: a row's result does not depend on how its prompt was split into chunks
// (torch's attention moves by ~1e-7 with the split, enough to flip a bf16 rounding).
// Attention of rows each over its own keys: row r is position position[r] of a request
// whose key slots are key_slots[base[r] ..] and sees positions [lo[r], position[r]].
// Prompt rows take the prompt kernel (prompt_attention.h); generated rows the decode
// kernel's arithmetic, so a generated token's result is the fused decoder's.
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& key_slots,
                       const at::Tensor& base, const at::Tensor& position, const at::Tensor& lo,
                       double scale, bool prompt, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3,
              "attend_rows: q must be [T, H, D] float32");
  const bool int8_cache = cache.scalar_type() == at::kChar;
  const int64_t width = int8_cache ? shoal_kv::row_width<int8_t>(q.size(2)) : q.size(2);
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(2) == width &&
                  (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16 ||
                   int8_cache),
              "attend_rows: the cache must be [2 * H_kv, slots, D] float32 or bfloat16, or "
              "int8 rows of D values and their scales");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = cache.size(0) / 2, slots = cache.size(1);
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "attend_rows: heads and KV heads differ");
  const at::Tensor keys = key_slots.to(at::kLong).contiguous();
  const at::Tensor bases = base.to(at::kLong).contiguous();
  const at::Tensor positions = position.to(at::kLong).contiguous();
  const at::Tensor los = lo.to(at::kLong).contiguous();
  TORCH_CHECK(bases.numel() == rows && positions.numel() == rows && los.numel() == rows,
              "attend_rows: one base, position and lo per row");
  const int64_t* key_p = keys.data_ptr<int64_t>();
  for (int64_t i = 0; i < keys.numel(); ++i)
    TORCH_CHECK(key_p[i] >= 0 && key_p[i] < slots, "attend_rows: key slot out of range");
  const int64_t *base_p = bases.data_ptr<int64_t>(), *position_p = positions.data_ptr<int64_t>();
  const int64_t* lo_p = los.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(base_p[r] >= 0 && lo_p[r] >= 0 && lo_p[r] <= position_p[r] &&
                    base_p[r] + position_p[r] < keys.numel(),
                "attend_rows: a row's keys lie outside key_slots");
  const at::Tensor queries = q.contiguous();
  at::Tensor sink_logits;  // [heads] float32, or undefined
  if (sinks.has_value() && sinks->defined()) {
    sink_logits = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_logits.dim() == 1 && sink_logits.size(0) == heads,
                "attend_rows: sinks must be one logit per head");
  }
  const float* sink_p = sink_logits.defined() ? sink_logits.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, heads * dim}, q.options().dtype(at::kBFloat16));
  const bool bf16_cache = cache.scalar_type() == at::kBFloat16;
  if (prompt) {
    const shoal_prompt_attention::Rows layout{queries.data_ptr<float>(), rows, heads, kv_heads,
                                              dim, key_p, base_p, position_p, lo_p,
                                              static_cast<float>(scale), sink_p};
    if (bf16_cache) {
      shoal_prompt_attention::attend(layout, cache.data_ptr<bf16>(), slots, out.data_ptr<bf16>());
    } else if (int8_cache) {
      shoal_prompt_attention::attend(layout, cache.data_ptr<int8_t>(), slots,
                                     out.data_ptr<bf16>());
    } else {
      shoal_prompt_attention::attend(layout, cache.data_ptr<float>(), slots,
                                     out.data_ptr<bf16>());
    }
    return out;
  }
  const at::Tensor starts = bases + los;
  const at::Tensor lengths = positions + 1 - los;
  const shoal_attention::Layout layout{heads, kv_heads, dim, slots, static_cast<float>(scale),
                                       sink_p};
  auto nothing = [](int64_t, int64_t) {};
  // Every item is a row's whole key range: always worth a thread.
  if (bf16_cache) {
    shoal_attention::attend(layout, queries.data_ptr<float>(), cache.data_ptr<bf16>(), key_p,
                            starts.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), rows, 0,
                            out.data_ptr<bf16>(), nothing);
  } else if (int8_cache) {
    shoal_attention::attend(layout, queries.data_ptr<float>(), cache.data_ptr<int8_t>(), key_p,
                            starts.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), rows, 0,
                            out.data_ptr<bf16>(), nothing);
  } else {
    shoal_attention::attend(layout, queries.data_ptr<float>(), cache.data_ptr<float>(), key_p,
                            starts.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), rows, 0,
                            out.data_ptr<bf16>(), nothing);
  }
  return out;
}

}  // namespace

namespace shoal_quant {
void bind(pybind11::module& m);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  shoal_quant::bind(m);
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of [T, D] bf16 rows",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gated", &gated, "act(gate) * up of a [T, 2F] bf16 gate/up projection",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("attend_rows", &attend_rows, "attention of rows, each over its own keys",
        pybind11::arg("q"), pybind11::arg("cache"), pybind11::arg("key_slots"),
        pybind11::arg("base"), pybind11::arg("position"), pybind11::arg("lo"),
        pybind11::arg("scale"), pybind11::arg("prompt"), pybind11::arg("sinks") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init([](const std::vector<at::Tensor>& norms,
                             const std::vector<std::shared_ptr<QuantLinear>>& linears,
                             const std::vector<std::shared_ptr<RoutedFeedForward>>& moe,
                             const std::vector<bool>& sliding, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, double scale, double eps, int64_t window,
                             bool gelu) {
             TORCH_CHECK(head_dim >= 1 && head_dim <= 512, "Decoder: head_dim must be <= 512");
             return Decoder(norms, linears, moe, sliding, heads, kv_heads, head_dim, scale, eps,
                            window, gelu);
           }))
      .def("forward", &Decoder::forward, pybind11::arg("hidden"), pybind11::arg("caches"),
           pybind11::arg("rope"), pybind11::arg("slots"), pybind11::arg("tables"),
           pybind11::arg("context"), pybind11::arg("block_size"),
           pybind11::arg("chained") = false,
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
