// Fused decode of llama-family blocks on CPU: a batch of single-token rows, bf16
// activations, int4 / int8 / bf16 weights as the Python path holds them, a float32 paged KV
// cache.
//
// A batch-1 decode step in Python calls ~35 torch ops per block (~1,000 per step); at a few
// microseconds of dispatch each, that overhead is as large as the matmuls. Here one call
// runs every block: the matmuls go to the ATen kernels the Python path uses (see Linear),
// attention reads the paged cache in place (attention.h), and the small ops (RMSNorm, RoPE,
// the KV write, SiLU, residual adds) are loops over a few hundred floats, on 16-lane
// vectors where they are hot (vector.h). Rounding follows the Python path: every tensor it
// keeps in bf16 (norm outputs, projections, the residual stream) is rounded to bf16 here.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "vector.h"

namespace {

using bf16 = at::BFloat16;

constexpr int64_t kGroupSize = 32;  // int4 quantization group along the input dimension
// Attention runs on several threads from this many (key, KV head) pairs per layer; below
// it a parallel region costs more than it saves.
constexpr int64_t kParallelKeys = 1536;
// The per-row passes (norms, residual adds, SiLU) run on several threads from this many rows.
constexpr int64_t kParallelRows = 8;

using shoal_vec::f32x16;
using shoal_vec::kLanes;

// One linear layer as the Python path holds it (models/layers/linear.py), for [B, in] bf16
// inputs: the same ATen kernel the Python path calls for such inputs. Quantized weights serve
// up to quant_max_rows rows; bigger inputs use the layer's dense copy, prepacked for oneDNN.
enum class LinearKind : int64_t { kInt4 = 0, kInt8 = 1, kDense = 2 };

// mkldnn::_linear_pointwise(X, W, B?, attr, scalars, algorithm): the prepacked linear.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.defined() ? c10::IValue(bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string());
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

struct Linear {
  LinearKind kind;
  at::Tensor weight;  // int4: packed; int8: q [out, in]; dense: [out, in] bf16
  at::Tensor scales;  // int4: scales_and_zeros [in / 32, out, 2]; int8: [out]; dense: unused
  at::Tensor bias;    // [out] bf16, or undefined
  at::Tensor dense;   // quantized kinds: the oneDNN-packed bf16 copy, or undefined

  // x: [B, in] bf16 -> [B, out] bf16
  at::Tensor operator()(const at::Tensor& x, int64_t quant_max_rows) const {
    if (kind != LinearKind::kDense && x.size(0) > quant_max_rows && dense.defined())
      return packed_linear(x, dense, bias);
    at::Tensor y;
    switch (kind) {
      case LinearKind::kInt4:
        y = at::_weight_int4pack_mm_for_cpu(x, weight, kGroupSize, scales);
        break;
      case LinearKind::kInt8:
        y = at::_weight_int8pack_mm(x, weight, scales);
        break;
      default:
        return at::linear(x, weight, bias);
    }
    if (bias.defined()) y.add_(bias);
    return y;
  }
};

struct Block {
  at::Tensor attn_norm, mlp_norm;  // [hidden] bf16
  Linear qkv, o, gate_up, down;
};

// out[i] = bf16(x[i] * rsqrt(mean(x^2) + eps) * w[i]), accumulated in float32 and rounded
// once, as the Python path's layer-norm form of RMSNorm for a few rows does (its rms_norm
// for more rows rounds twice; bf16 paths are judged by quality, not identity).
void rms_norm(const bf16* x, const bf16* w, bf16* out, int64_t n, float eps) {
  f32x16 squares{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f32x16 v = shoal_vec::load(x + i);
    squares += v * v;
  }
  float sum = shoal_vec::hsum(squares);
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * x[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i + kLanes <= n; i += kLanes)
    shoal_vec::store(out + i, shoal_vec::load(x + i) * scale * shoal_vec::load(w + i));
  for (; i < n; ++i) out[i] = bf16(x[i] * scale * w[i]);
}

// h[i] = bf16(h[i] + delta[i]): the residual stream stays bf16, as in the Python path.
void residual_add(bf16* h, const bf16* delta, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    shoal_vec::store(h + i, shoal_vec::load(h + i) + shoal_vec::load(delta + i));
  for (; i < n; ++i) h[i] = bf16(static_cast<float>(h[i]) + delta[i]);
}

// out[i] = bf16(bf16(silu(gate[i])) * up[i]): torch's silu on a bf16 tensor, then the
// product, each rounded to bf16.
void silu_mul(const bf16* gate, const bf16* up, bf16* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f32x16 g = shoal_vec::load(gate + i);
    const f32x16 silu = shoal_vec::round_bf16(g / (1.f + shoal_vec::exp(-g)));
    shoal_vec::store(out + i, silu * shoal_vec::load(up + i));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = bf16(static_cast<float>(bf16(g / (1.f + std::exp(-g)))) * up[i]);
  }
}

// body(b) for every row b; on torch's intra-op threads once a batch has kParallelRows rows
// (below that a parallel region costs more than the rows' few microseconds of work).
template <typename Body>
void for_rows(int64_t rows, const Body& body) {
  at::parallel_for(0, rows, rows >= kParallelRows ? 1 : rows, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) body(b);
  });
}

// Rotary embedding in the half-split layout, float32:
// out = x * cos + roll(x, D/2) * signed_sin, with signed_sin = (-sin, sin).
void rotate(const bf16* x, const float* cos, const float* sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const float swapped = x[i < half ? i + half : i - half];
    out[i] = static_cast<float>(x[i]) * cos[i] + swapped * sin[i];
  }
}

class LlamaDecoder {
 public:
  // linears: per block qkv, o, gate_up, down, each as (weight, scales, bias, dense copy)
  // with its kind in kinds (LinearKind); an empty tensor stands for none.
  // norms: per block attn_norm, mlp_norm. quant_max_rows: see Linear.
  LlamaDecoder(const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& linears,
               const std::vector<int64_t>& kinds, int64_t heads, int64_t kv_heads,
               int64_t head_dim, double scale, double eps, int64_t quant_max_rows)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        scale_(static_cast<float>(scale)), eps_(static_cast<float>(eps)),
        quant_max_rows_(quant_max_rows) {
    const size_t blocks = norms.size() / 2;
    TORCH_CHECK(norms.size() % 2 == 0 && kinds.size() == 4 * blocks &&
                    linears.size() == 4 * kinds.size(),
                "LlamaDecoder: 2 norms and 4 linears (4 tensors each) per block");
    TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0,
                "LlamaDecoder: heads must be a multiple of kv heads");
    for (size_t i = 0; i < blocks; ++i) {
      Block block;
      block.attn_norm = norms[2 * i].contiguous();
      block.mlp_norm = norms[2 * i + 1].contiguous();
      TORCH_CHECK(block.attn_norm.scalar_type() == at::kBFloat16 &&
                      block.mlp_norm.scalar_type() == at::kBFloat16,
                  "LlamaDecoder: norm weights must be bfloat16");
      Linear* parts[4] = {&block.qkv, &block.o, &block.gate_up, &block.down};
      for (size_t j = 0; j < 4; ++j) {
        const int64_t kind = kinds[4 * i + j];
        TORCH_CHECK(kind >= 0 && kind <= 2, "LlamaDecoder: unknown linear kind ", kind);
        const at::Tensor* t = &linears[4 * (4 * i + j)];
        TORCH_CHECK(kind != 2 || t[0].scalar_type() == at::kBFloat16,
                    "LlamaDecoder: dense weights must be bfloat16");
        auto given = [](const at::Tensor& tensor) {
          return tensor.numel() ? tensor : at::Tensor();
        };
        *parts[j] = Linear{static_cast<LinearKind>(kind), t[0], given(t[1]), given(t[2]),
                           given(t[3])};
      }
      blocks_.push_back(std::move(block));
    }
  }

  // hidden: [B, hidden] bf16 -> [B, hidden] bf16 after every block.
  // caches: per block [2 * H_kv, slots, D] float32 (keys, then values).
  // cos, sin: [B, D] float32 (sin signed as above); slots: [B] int64, each row's new KV slot;
  // tables: [B, W] int64 block ids; context: [B] int64, each row's keys (new one included).
  at::Tensor forward(at::Tensor hidden, const std::vector<at::Tensor>& caches,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& tables, const at::Tensor& context,
                     int64_t block_size) const {
    TORCH_CHECK(caches.size() == blocks_.size(), "LlamaDecoder: one KV cache per block");
    TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2,
                "LlamaDecoder: hidden must be [B, hidden] bfloat16");
    const int64_t rows = hidden.size(0), width = hidden.size(1);
    TORCH_CHECK(blocks_.empty() || width == blocks_[0].attn_norm.size(0),
                "LlamaDecoder: hidden width differs from the model's");
    TORCH_CHECK(cos.size(0) == rows && slots.size(0) == rows && tables.size(0) == rows &&
                    context.size(0) == rows, "LlamaDecoder: per-row inputs disagree on B");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.size(1) == head_dim_ && sin.sizes() == cos.sizes(),
                "LlamaDecoder: cos and sin must be [B, head_dim] float32");
    TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                    context.scalar_type() == at::kLong && slots.is_contiguous() &&
                    context.is_contiguous() && tables.dim() == 2,
                "LlamaDecoder: slots, tables and context must be int64");
    at::Tensor h = hidden.contiguous().clone();
    at::Tensor x = at::empty_like(h);
    const int64_t dim = head_dim_, q_width = heads_ * dim;
    at::Tensor attn = at::empty({rows, q_width}, h.options());
    at::Tensor q = at::empty({rows, heads_, dim}, cos.options());  // rotated queries, float32
    const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
    const auto* cos_p = cos_c.data_ptr<float>();
    const auto* sin_p = sin_c.data_ptr<float>();
    const at::Tensor tables_c = tables.contiguous();
    const auto* table_p = tables_c.data_ptr<int64_t>();
    const int64_t table_width = tables_c.size(1);
    const auto* slot_p = slots.data_ptr<int64_t>();
    const auto* ctx_p = context.data_ptr<int64_t>();
    TORCH_CHECK(block_size >= 1, "LlamaDecoder: block_size must be >= 1");
    TORCH_CHECK(!caches.empty() || blocks_.empty(), "LlamaDecoder: no KV caches");
    const int64_t cache_slots = caches.empty() ? 0 : caches[0].size(1);
    const shoal_attention::Layout layout{heads_, kv_heads_, head_dim_, cache_slots, scale_};
    // Row b's keys lie in slots key_slots[first[b] .. first[b + 1]), the same in every layer.
    // Checked here, once, to lie inside the caches (the loops below do not check).
    std::vector<int64_t> first(rows + 1, 0);
    for (int64_t b = 0; b < rows; ++b) {
      TORCH_CHECK(ctx_p[b] >= 1 && (ctx_p[b] - 1) / block_size < table_width,
                  "LlamaDecoder: a row's context is longer than its block table");
      TORCH_CHECK(slot_p[b] >= 0 && slot_p[b] < cache_slots, "LlamaDecoder: slot out of range");
      first[b + 1] = first[b] + ctx_p[b];
    }
    std::vector<int64_t> key_slots(first[rows]);
    for (int64_t b = 0; b < rows; ++b) {
      for (int64_t p = 0; p < ctx_p[b]; ++p) {
        const int64_t block_id = table_p[b * table_width + p / block_size];
        TORCH_CHECK(block_id >= 0 && (block_id + 1) * block_size <= cache_slots,
                    "LlamaDecoder: block id out of range");
        key_slots[first[b] + p] = block_id * block_size + p % block_size;
      }
    }

    // A block's down projection is added to h in the next block's first pass over the
    // rows, together with that block's norm.
    at::Tensor pending;
    const int64_t group = heads_ / kv_heads_;
    for (size_t layer = 0; layer < blocks_.size(); ++layer) {
      const Block& block = blocks_[layer];
      const at::Tensor& cache = caches[layer];
      TORCH_CHECK(cache.is_contiguous() && cache.scalar_type() == at::kFloat &&
                      cache.dim() == 3 && cache.size(0) == 2 * kv_heads_ &&
                      cache.size(1) == cache_slots && cache.size(2) == head_dim_,
                  "LlamaDecoder: KV caches must be [2 * H_kv, slots, D] contiguous float32");
      float* cache_p = cache.data_ptr<float>();
      auto key_row = [&](int64_t head, int64_t slot) {
        return cache_p + (head * cache_slots + slot) * dim;
      };
      bf16* h_p = h.data_ptr<bf16>();
      bf16* x_p = x.data_ptr<bf16>();
      const bf16* attn_norm = block.attn_norm.data_ptr<bf16>();
      const bf16* pending_p = pending.defined() ? pending.data_ptr<bf16>() : nullptr;
      for_rows(rows, [&](int64_t b) {
        if (pending_p != nullptr) residual_add(h_p + b * width, pending_p + b * width, width);
        rms_norm(h_p + b * width, attn_norm, x_p + b * width, width, eps_);
      });
      const at::Tensor qkv = block.qkv(x, quant_max_rows_);  // [B, (H + 2 H_kv) D]
      const bf16* qkv_p = qkv.data_ptr<bf16>();
      const int64_t qkv_width = qkv.size(1);
      float* q_p = q.data_ptr<float>();
      // Row b's queries of KV head g rotated into q, its key rotated and its value copied
      // into the cache: the attention item (b, g) does this before it reads them.
      auto prepare = [&](int64_t b, int64_t g) {
        const bf16* row = qkv_p + b * qkv_width;
        const float* c = cos_p + b * dim;
        const float* s = sin_p + b * dim;
        for (int64_t head = g * group; head < (g + 1) * group; ++head)
          rotate(row + head * dim, c, s, q_p + (b * heads_ + head) * dim, dim);
        rotate(row + (heads_ + g) * dim, c, s, key_row(g, slot_p[b]), dim);
        const bf16* v = row + (heads_ + kv_heads_ + g) * dim;
        float* v_out = key_row(kv_heads_ + g, slot_p[b]);
        for (int64_t i = 0; i < dim; ++i) v_out[i] = v[i];
      };
      shoal_attention::attend(layout, q_p, cache_p, key_slots, first, rows, kParallelKeys,
                              attn.data_ptr<bf16>(), prepare);
      const at::Tensor o = block.o(attn, quant_max_rows_);
      const bf16* o_p = o.data_ptr<bf16>();
      const bf16* mlp_norm = block.mlp_norm.data_ptr<bf16>();
      for_rows(rows, [&](int64_t b) {
        residual_add(h_p + b * width, o_p + b * width, width);
        rms_norm(h_p + b * width, mlp_norm, x_p + b * width, width, eps_);
      });
      const at::Tensor gate_up = block.gate_up(x, quant_max_rows_);  // [B, 2 F]: gate, then up
      const int64_t ffn = gate_up.size(1) / 2;
      at::Tensor act = at::empty({rows, ffn}, h.options());
      const bf16* gu_p = gate_up.data_ptr<bf16>();
      bf16* act_p = act.data_ptr<bf16>();
      for_rows(rows, [&](int64_t b) {
        silu_mul(gu_p + b * 2 * ffn, gu_p + b * 2 * ffn + ffn, act_p + b * ffn, ffn);
      });
      pending = block.down(act, quant_max_rows_);
    }
    if (pending.defined()) {
      bf16* h_p = h.data_ptr<bf16>();
      const bf16* pending_p = pending.data_ptr<bf16>();
      for_rows(rows, [&](int64_t b) {
        residual_add(h_p + b * width, pending_p + b * width, width);
      });
    }
    return h;
  }

 private:
  std::vector<Block> blocks_;
  int64_t heads_, kv_heads_, head_dim_;
  float scale_, eps_;
  int64_t quant_max_rows_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<int64_t>&, int64_t, int64_t, int64_t, double,
                          double, int64_t>())
      .def("forward", &LlamaDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
