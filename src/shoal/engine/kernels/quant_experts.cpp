// GroupedExperts and RoutedFeedForward (quant_experts.h): a step's experts each over its rows
// gathered together; a decode step's projections in one parallel region per kind (gate/up,
// then down), other steps' one expert after another, each split over torch's threads.

#include "quant_experts.h"

#include <ATen/Parallel.h>

#include <cstring>

#include "decode_rows.h"

namespace shoal_quant {

using bf16 = at::BFloat16;

namespace {

// QuantLinear's forward as layers/packing.py calls it: rows before local_prompt_from are
// generated, the rest prompt rows, each kind its own arithmetic.
at::Tensor linear(const QuantLinear& op, const at::Tensor& x, int64_t local_prompt_from) {
  const int64_t rows = x.size(0);
  if (local_prompt_from >= rows) return op.forward(x, false, false);
  if (local_prompt_from <= 0) return op.forward(x, false, true);
  return at::cat({op.forward(x.narrow(0, 0, local_prompt_from), false, false),
                  op.forward(x.narrow(0, local_prompt_from, rows - local_prompt_from), false,
                             true)});
}

// act(gate) * up of each row of a [rows, 2F] bf16 projection -> [rows, F] bf16 (the
// decoder's own pass: decode_rows.h).
at::Tensor gated_rows(const at::Tensor& gate_up, bool gelu) {
  const int64_t rows = gate_up.size(0), ffn = gate_up.size(1) / 2;
  at::Tensor act = at::empty({rows, ffn}, gate_up.options());
  const bf16* gu = gate_up.data_ptr<bf16>();
  bf16* act_p = act.data_ptr<bf16>();
  for (int64_t j = 0; j < rows; ++j) {
    if (gelu) {
      shoal_decode::gated<true>(gu + j * 2 * ffn, gu + j * 2 * ffn + ffn, act_p + j * ffn, ffn);
    } else {
      shoal_decode::gated<false>(gu + j * 2 * ffn, gu + j * 2 * ffn + ffn, act_p + j * ffn, ffn);
    }
  }
  return act;
}

// gpt-oss's clamped SwiGLU of a [rows, 2F] bf16 projection -> [rows, F] bf16: the ATen
// ops of layers/experts.py's ClampedSwiGLU, in its order, so the same kernels and bits.
at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  const std::vector<at::Tensor> halves = gate_up.to(at::kFloat).chunk(2, -1);
  const at::Tensor gate = halves[0].clamp(std::nullopt, limit);
  const at::Tensor up = halves[1].clamp(-limit, limit);
  const at::Tensor glu = gate * at::sigmoid(gate * alpha);
  return ((up + 1) * glu).to(at::kBFloat16);
}

}  // namespace

GroupedExperts::GroupedExperts(std::vector<std::shared_ptr<QuantLinear>> gate_up,
                               std::vector<std::shared_ptr<QuantLinear>> down, bool gelu,
                               std::optional<double> swiglu_alpha,
                               std::optional<double> swiglu_limit)
    : gate_up_(std::move(gate_up)), down_(std::move(down)), gelu_(gelu),
      swiglu_alpha_(swiglu_alpha), swiglu_limit_(swiglu_limit) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(),
              "GroupedExperts: one gate_up and one down per expert");
  TORCH_CHECK(swiglu_alpha_.has_value() == swiglu_limit_.has_value(),
              "GroupedExperts: a clamped SwiGLU needs both its alpha and its limit");
  hidden_ = gate_up_[0]->in_features();
  ffn_ = down_[0]->in_features();
  for (size_t e = 0; e < gate_up_.size(); ++e)
    TORCH_CHECK(gate_up_[e]->in_features() == hidden_ && gate_up_[e]->out_features() == 2 * ffn_ &&
                    down_[e]->in_features() == ffn_ && down_[e]->out_features() == hidden_,
                "GroupedExperts: expert ", e, " is not [", 2 * ffn_, ", ", hidden_, "] / [",
                hidden_, ", ", ffn_, "]");
}

at::Tensor GroupedExperts::forward(const at::Tensor& input, const at::Tensor& weights_in,
                                   const at::Tensor& chosen_in, int64_t prompt_from) const {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2 &&
                  input.size(1) == hidden_,
              "GroupedExperts: x must be [T, ", hidden_, "] bfloat16");
  const int64_t t = input.size(0);
  TORCH_CHECK(chosen_in.dim() == 2 && chosen_in.size(0) == t &&
                  weights_in.sizes() == chosen_in.sizes(),
              "GroupedExperts: weights and chosen must be [T, k]");
  const at::Tensor x = input.contiguous();
  const at::Tensor chosen = chosen_in.to(at::kLong).contiguous();
  const at::Tensor weights = weights_in.to(at::kFloat).contiguous();
  const int64_t k = chosen.size(1), n = experts();
  const int64_t* chosen_p = chosen.data_ptr<int64_t>();
  const float* weights_p = weights.data_ptr<float>();

  // (row, choice) pairs by expert, rows ascending within an expert (a stable sort by expert).
  // A choice outside [0, n) names an expert another rank holds (expert parallelism): skipped.
  const auto held = [n](int64_t e) { return e >= 0 && e < n; };
  std::vector<int64_t> counts(n + 1, 0);
  for (int64_t i = 0; i < t * k; ++i)
    if (held(chosen_p[i])) ++counts[chosen_p[i] + 1];
  for (int64_t e = 0; e < n; ++e) counts[e + 1] += counts[e];
  std::vector<int64_t> pairs(counts[n]), next(counts.begin(), counts.end() - 1);
  for (int64_t i = 0; i < t * k; ++i)
    if (held(chosen_p[i])) pairs[next[chosen_p[i]]++] = i;

  // Each chosen expert's rows gathered ([count, H] bf16), in ascending expert order.
  struct Group {
    int64_t expert, begin, count, local_prompt_from;  // rows before it are generated ones
    at::Tensor x;
  };
  std::vector<Group> groups;
  const bf16* x_p = x.data_ptr<bf16>();
  for (int64_t e = 0; e < n; ++e) {
    const int64_t begin = counts[e], count = counts[e + 1] - begin;
    if (count == 0) continue;
    Group group{e, begin, count, count, at::empty({count, hidden_}, x.options())};
    bf16* gathered = group.x.data_ptr<bf16>();
    for (int64_t j = 0; j < count; ++j) {
      const int64_t row = pairs[begin + j] / k;
      if (row >= prompt_from && group.local_prompt_from == count) group.local_prompt_from = j;
      std::memcpy(gathered + j * hidden_, x_p + row * hidden_, hidden_ * sizeof(bf16));
    }
    groups.push_back(std::move(group));
  }
  // Generated rows only (a decode step): every expert's projection in one parallel region.
  const bool generated = prompt_from >= t;
  const auto project = [&](const std::vector<std::shared_ptr<QuantLinear>>& ops,
                           const std::vector<at::Tensor>& inputs) {
    std::vector<at::Tensor> outs;
    if (generated) {
      std::vector<const QuantLinear*> chosen_ops;
      for (const Group& g : groups) chosen_ops.push_back(ops[g.expert].get());
      return QuantLinear::forward_generated(chosen_ops, inputs);
    }
    for (size_t i = 0; i < groups.size(); ++i)
      outs.push_back(linear(*ops[groups[i].expert], inputs[i], groups[i].local_prompt_from));
    return outs;
  };
  std::vector<at::Tensor> inputs;
  for (const Group& g : groups) inputs.push_back(g.x);
  const std::vector<at::Tensor> gate_up = project(gate_up_, inputs);  // each [count, 2F]
  for (size_t i = 0; i < groups.size(); ++i) inputs[i] = activate(gate_up[i]);
  const std::vector<at::Tensor> ys = project(down_, inputs);  // each [count, H] bf16

  at::Tensor out = at::zeros({t, hidden_}, x.options().dtype(at::kFloat));
  float* out_p = out.data_ptr<float>();
  for (size_t i = 0; i < groups.size(); ++i) {
    const bf16* y_p = ys[i].data_ptr<bf16>();
    for (int64_t j = 0; j < groups[i].count; ++j) {
      const int64_t pair = pairs[groups[i].begin + j], row = pair / k;
      const float w = weights_p[pair];
      float* o = out_p + row * hidden_;
      const bf16* yr = y_p + j * hidden_;
      for (int64_t c = 0; c < hidden_; ++c) o[c] += static_cast<float>(yr[c]) * w;
    }
  }
  return out;
}

at::Tensor GroupedExperts::activate(const at::Tensor& gate_up) const {
  if (swiglu_limit_) return clamped_swiglu(gate_up, *swiglu_alpha_, *swiglu_limit_);
  return gated_rows(gate_up, gelu_);
}

RoutedFeedForward::RoutedFeedForward(at::Tensor router, int64_t top_k, bool normalize,
                                     std::shared_ptr<GroupedExperts> experts,
                                     std::shared_ptr<QuantLinear> shared_gate_up,
                                     std::shared_ptr<QuantLinear> shared_down,
                                     std::optional<at::Tensor> shared_gate, bool shared_gelu)
    : router_(router.contiguous()), top_k_(top_k), normalize_(normalize),
      experts_(std::move(experts)), shared_gate_up_(std::move(shared_gate_up)),
      shared_down_(std::move(shared_down)),
      shared_gate_(shared_gate ? shared_gate->contiguous() : at::Tensor()),
      shared_gelu_(shared_gelu) {
  TORCH_CHECK(experts_ != nullptr, "RoutedFeedForward: no experts");
  TORCH_CHECK(router_.scalar_type() == at::kFloat && router_.dim() == 2 &&
                  router_.size(0) == experts_->experts(),
              "RoutedFeedForward: router must be [experts, hidden] float32");
  TORCH_CHECK(top_k_ >= 1 && top_k_ <= router_.size(0), "RoutedFeedForward: bad top_k");
  TORCH_CHECK((shared_gate_up_ == nullptr) == (shared_down_ == nullptr),
              "RoutedFeedForward: a shared expert needs gate_up and down");
  TORCH_CHECK(!shared_gate_.defined() || shared_gate_up_ != nullptr,
              "RoutedFeedForward: a shared gate without a shared expert");
}

at::Tensor RoutedFeedForward::forward(const at::Tensor& x) const {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor probs = at::softmax(at::linear(xf, router_), -1);  // [B, experts]
  auto [weights, chosen] = at::topk(probs, top_k_, -1);                // [B, k] each
  if (normalize_) weights = weights / weights.sum(at::IntArrayRef{-1}, true);
  at::Tensor out = experts_->forward(x, weights, chosen, x.size(0));  // [B, H] float32
  if (shared_gate_up_ != nullptr) {
    const at::Tensor gate_up = shared_gate_up_->forward(x, false, false);  // [B, 2F]
    at::Tensor shared =
        shared_down_->forward(gated_rows(gate_up, shared_gelu_), false, false).to(at::kFloat);
    if (shared_gate_.defined()) shared = at::sigmoid(at::linear(xf, shared_gate_)) * shared;
    out += shared;
  }
  return out.to(at::kBFloat16);
}

}  // namespace shoal_quant
