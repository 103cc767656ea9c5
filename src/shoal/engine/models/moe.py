"""The mixture-of-experts feed-forward of one decoder layer, built from its canonical tensors
(layers.{i}.router, layers.{i}.experts.{e}.gate/up/down, qwen2moe's shared expert, and
gpt-oss's router and expert biases)."""

from __future__ import annotations

import torch

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.layers.experts import (
    ClampedSwiGLU,
    LogitTopKRouter,
    MixtureOfExperts,
    Router,
    SharedExpert,
)
from shoal.engine.models.layers.linear import WeightPlan, build_linear
from shoal.engine.models.layers.mlp import GatedMLP
from shoal.engine.weights.quant import RawTensor


def make_experts(config: ModelConfig, index: int, weights: dict[str, RawTensor],
                 plan: WeightPlan) -> MixtureOfExperts:
    if plan.shard is not None:
        raise UnsupportedModel("mixture-of-experts layers cannot be split by tensor "
                               "parallelism yet: split the model by layers (pipeline)")
    prefix = f"layers.{index}."
    router_weight = _float32(weights[prefix + "router.weight"], plan)
    if config.router_softmax_after_topk:
        router = LogitTopKRouter(router_weight, _float32(weights[prefix + "router.bias"], plan),
                                 config.num_experts_per_token)
    else:
        router = Router(router_weight, config.num_experts_per_token, config.norm_topk_prob)
    make_expert = _gated_mlp if config.swiglu_limit is None else _clamped_swiglu
    experts = [make_expert(weights, f"{prefix}experts.{e}.", config, plan)
               for e in range(config.num_experts)]
    shared = None
    if config.shared_expert_intermediate_size:
        gate = _float32(weights[prefix + "shared_expert_gate.weight"], plan).reshape(1, -1)
        shared = SharedExpert(_gated_mlp(weights, prefix + "shared_expert.", config, plan), gate)
    return plan.backend.experts(router, experts, shared)


def _gated_mlp(weights: dict[str, RawTensor], prefix: str, config: ModelConfig,
               plan: WeightPlan) -> GatedMLP:
    gate, up, down = (weights[prefix + p + ".weight"] for p in ("gate", "up", "down"))
    return plan.backend.gated_mlp(build_linear([gate, up], None, plan),
                                  build_linear([down], None, plan), config.hidden_activation)


def _clamped_swiglu(weights: dict[str, RawTensor], prefix: str, config: ModelConfig,
                    plan: WeightPlan) -> ClampedSwiGLU:
    """gpt-oss's expert: gate, up and down with a bias each."""
    gate, up, down = (weights[prefix + p + ".weight"] for p in ("gate", "up", "down"))
    gate_bias, up_bias, down_bias = (weights[prefix + p + ".bias"] for p in ("gate", "up", "down"))
    return ClampedSwiGLU(build_linear([gate, up], [gate_bias, up_bias], plan),
                         build_linear([down], [down_bias], plan),
                         config.swiglu_alpha, config.swiglu_limit)


def _float32(raw: RawTensor, plan: WeightPlan) -> torch.Tensor:
    # Router and shared-expert gate are small ([experts, hidden], [1, hidden]) and decide
    # which weights are read: kept in float32 whatever the compute dtype.
    return raw.dequantize().to(plan.device)
