"""The mixture-of-experts feed-forward of one decoder layer, built from its canonical tensors
(layers.{i}.router, layers.{i}.experts.{e}.gate/up/down, a shared expert with its gate
(qwen2moe) or without (GLM-4.5, DeepSeek), the sigmoid routers' per-expert score bias
layers.{i}.router_score_bias, and gpt-oss's router and expert biases): all experts, or an
expert-parallel rank's range of them (parallel/experts.py)."""

from __future__ import annotations

import torch

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.layers.experts import (
    ClampedSwiGLU,
    GroupedRouter,
    LogitTopKRouter,
    MixtureOfExperts,
    Router,
    SharedExpert,
)
from shoal.engine.models.layers.linear import WeightPlan, build_linear
from shoal.engine.models.layers.mlp import GatedMLP
from shoal.engine.parallel.experts import ExpertParallel
from shoal.engine.weights.quant import RawTensor


def make_experts(config: ModelConfig, index: int, weights: dict[str, RawTensor],
                 plan: WeightPlan) -> MixtureOfExperts | ExpertParallel:
    check_not_tensor_split(config, plan)
    prefix = f"layers.{index}."
    router = _router(config, prefix, weights, plan)
    first, end = plan.experts if plan.experts is not None else (0, config.num_experts)
    make_expert = _gated_mlp if config.swiglu_limit is None else _clamped_swiglu
    experts = [make_expert(weights, f"{prefix}experts.{e}.", config, plan)
               for e in range(first, end)]
    shared = None
    if config.shared_expert_intermediate_size:
        gate = weights.get(prefix + "shared_expert_gate.weight")
        shared = SharedExpert(_gated_mlp(weights, prefix + "shared_expert.", config, plan),
                              None if gate is None else _float32(gate, plan).reshape(1, -1))
    if plan.experts is None:
        return plan.backend.experts(router, experts, shared)
    if plan.reduce is None:
        raise ValueError("an expert-parallel plan needs its ranks' all-reduce")
    # This rank's experts; their partial sum is summed over the ranks, then the shared
    # expert (run on every rank) added once.
    return ExpertParallel(plan.backend.experts(router, experts, None, first_expert=first),
                          shared, plan.reduce)


def check_not_tensor_split(config: ModelConfig, plan: WeightPlan) -> None:
    """Refuses a tensor-parallel plan for a model with experts (before any layer is built:
    GLM's and DeepSeek's dense leading layers come first)."""
    if plan.shard is not None and config.num_experts:
        raise UnsupportedModel("mixture-of-experts layers cannot be split by tensor "
                               "parallelism yet: split the model by layers (pipeline) or "
                               "by experts (expert)")


def _router(config: ModelConfig, prefix: str, weights: dict[str, RawTensor],
            plan: WeightPlan) -> Router | GroupedRouter | LogitTopKRouter:
    weight = _float32(weights[prefix + "router.weight"], plan)
    if config.router_softmax_after_topk:
        return LogitTopKRouter(weight, _float32(weights[prefix + "router.bias"], plan),
                               config.num_experts_per_token)
    bias = weights.get(prefix + "router_score_bias.bias")
    if (config.expert_scoring == "softmax" and config.expert_groups == 1 and bias is None
            and config.routed_scaling_factor == 1.0):
        return Router(weight, config.num_experts_per_token, config.norm_topk_prob)
    return GroupedRouter(weight, config.num_experts_per_token, config.norm_topk_prob,
                         config.expert_scoring, config.expert_groups, config.expert_groups_used,
                         None if bias is None else _float32(bias, plan).reshape(-1),
                         config.routed_scaling_factor)


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
