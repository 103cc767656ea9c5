// A mixture-of-experts layer's experts in one compiled call (quant_experts.cpp): the
// router's choices in, the weighted sum of the chosen experts' gated MLPs out, with no
// Python between experts.

#pragma once

#include <torch/extension.h>

#include <memory>
#include <optional>
#include <vector>

#include "quant.h"

namespace shoal_quant {

// Expert e is down(act(gate) * up) over gate_up[e] ([2F, H]: gate rows, then up rows) and
// down[e] ([H, F]), each a packed QuantLinear (with its bias, if any). act is silu or
// gelu_tanh, or with swiglu_limit gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1)
// * g * sigmoid(alpha * g), g = min(gate, limit), in float32 (layers/experts.py's
// ClampedSwiGLU: the same ATen ops, so the same bits).
//
// forward's result is bit for bit the per-expert Python path's (layers/experts.py): rows
// grouped by expert in ascending expert order (a group keeps its rows' order), each group
// through QuantLinear::forward as generated rows before prompt_from and prompt rows from it
// on, then out[row] += float(y) * weight in ascending expert order.
class GroupedExperts {
 public:
  GroupedExperts(std::vector<std::shared_ptr<QuantLinear>> gate_up,
                 std::vector<std::shared_ptr<QuantLinear>> down, bool gelu,
                 std::optional<double> swiglu_alpha = std::nullopt,
                 std::optional<double> swiglu_limit = std::nullopt);

  // x [T, H] bf16, weights [T, k] float32, chosen [T, k] int64 (expert ids); rows from
  // prompt_from on are prompt tokens (T: none) -> float32 [T, H].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& chosen,
                     int64_t prompt_from) const;

  int64_t experts() const { return static_cast<int64_t>(gate_up_.size()); }

 private:
  // [rows, 2F] bf16 gate/up projections -> [rows, F] bf16 activations.
  at::Tensor activate(const at::Tensor& gate_up) const;

  std::vector<std::shared_ptr<QuantLinear>> gate_up_, down_;
  bool gelu_;
  std::optional<double> swiglu_alpha_, swiglu_limit_;
  int64_t hidden_, ffn_;
};

// A mixture-of-experts feed-forward with top-k softmax routing for generated rows, in one
// call: the fused decoder's (decode.cpp) MLP of such a layer. forward(x) is bit for bit
// layers/experts.py's MixtureOfExperts over a Router (and its SharedExpert, if any) for
// generated rows: the router and the shared expert's gate run as the same ATen ops as
// there, in float32 (softmax of x.float() @ router.T, top k, rescaled to sum 1 where
// normalize), the routed experts through GroupedExperts, the shared expert's output scaled
// by sigmoid(x.float() . shared_gate) where it has a gate, added in float32, rounded once.
class RoutedFeedForward {
 public:
  // router: [experts, H] float32; shared_gate: [1, H] float32.
  RoutedFeedForward(at::Tensor router, int64_t top_k, bool normalize,
                    std::shared_ptr<GroupedExperts> experts,
                    std::shared_ptr<QuantLinear> shared_gate_up,
                    std::shared_ptr<QuantLinear> shared_down,
                    std::optional<at::Tensor> shared_gate, bool shared_gelu);

  // x [B, H] bf16, generated rows -> [B, H] bf16.
  at::Tensor forward(const at::Tensor& x) const;

 private:
  at::Tensor router_;
  int64_t top_k_;
  bool normalize_;
  std::shared_ptr<GroupedExperts> experts_;
  std::shared_ptr<QuantLinear> shared_gate_up_, shared_down_;
  at::Tensor shared_gate_;  // undefined: no gate
  bool shared_gelu_;
};

}  // namespace shoal_quant
