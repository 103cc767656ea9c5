// GroupedExperts (quant_experts.h): a step's experts run one after another, each over its
// rows gathered together; each matmul splits over torch's threads as QuantLinear does.

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

}  // namespace

GroupedExperts::GroupedExperts(std::vector<std::shared_ptr<QuantLinear>> gate_up,
                               std::vector<std::shared_ptr<QuantLinear>> down, bool gelu)
    : gate_up_(std::move(gate_up)), down_(std::move(down)), gelu_(gelu) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(),
              "GroupedExperts: one gate_up and one down per expert");
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

  at::Tensor out = at::zeros({t, hidden_}, x.options().dtype(at::kFloat));
  float* out_p = out.data_ptr<float>();
  const bf16* x_p = x.data_ptr<bf16>();
  for (int64_t e = 0; e < n; ++e) {
    const int64_t begin = counts[e], count = counts[e + 1] - begin;
    if (count == 0) continue;
    at::Tensor rows_x = at::empty({count, hidden_}, x.options());
    bf16* gathered = rows_x.data_ptr<bf16>();
    int64_t local_prompt_from = count;  // rows before it are generated ones
    for (int64_t j = 0; j < count; ++j) {
      const int64_t row = pairs[begin + j] / k;
      if (row >= prompt_from && local_prompt_from == count) local_prompt_from = j;
      std::memcpy(gathered + j * hidden_, x_p + row * hidden_, hidden_ * sizeof(bf16));
    }
    const at::Tensor gate_up = linear(*gate_up_[e], rows_x, local_prompt_from);  // [count, 2F]
    at::Tensor act = at::empty({count, ffn_}, x.options());
    const bf16* gu = gate_up.data_ptr<bf16>();
    bf16* act_p = act.data_ptr<bf16>();
    for (int64_t j = 0; j < count; ++j) {
      if (gelu_) {
        shoal_decode::gated<true>(gu + j * 2 * ffn_, gu + j * 2 * ffn_ + ffn_, act_p + j * ffn_,
                                  ffn_);
      } else {
        shoal_decode::gated<false>(gu + j * 2 * ffn_, gu + j * 2 * ffn_ + ffn_, act_p + j * ffn_,
                                   ffn_);
      }
    }
    const at::Tensor y = linear(*down_[e], act, local_prompt_from);  // [count, H] bf16
    const bf16* y_p = y.data_ptr<bf16>();
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pair = pairs[begin + j], row = pair / k;
      const float w = weights_p[pair];
      float* o = out_p + row * hidden_;
      const bf16* yr = y_p + j * hidden_;
      for (int64_t c = 0; c < hidden_; ++c) o[c] += static_cast<float>(yr[c]) * w;
    }
  }
  return out;
}

}  // namespace shoal_quant
