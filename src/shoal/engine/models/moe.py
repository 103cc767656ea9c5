"""The mixture-of-experts feed-forward of one decoder layer, built from its canonical tensors
(layers.{i}.router, layers.{i}.experts.{e}.gate/up/down, and qwen2moe's shared expert): all
experts, or an expert-parallel rank's range of them (parallel/experts.py)."""

from __future__ import annotations

import torch

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.layers.experts import MixtureOfExperts, Router, SharedExpert
from shoal.engine.models.layers.linear import WeightPlan, build_linear
from shoal.engine.models.layers.mlp import GatedMLP
from shoal.engine.parallel.experts import ExpertParallel
from shoal.engine.weights.quant import RawTensor


def make_experts(config: ModelConfig, index: int, weights: dict[str, RawTensor],
                 plan: WeightPlan) -> MixtureOfExperts | ExpertParallel:
    if plan.shard is not None:
        raise UnsupportedModel("mixture-of-experts layers cannot be split by tensor "
                               "parallelism yet: split the model by layers (pipeline) or "
                               "by experts (expert)")
    prefix = f"layers.{index}."
    router = Router(_float32(weights[prefix + "router.weight"], plan),
                    config.num_experts_per_token, config.norm_topk_prob)
    first, end = plan.experts if plan.experts is not None else (0, config.num_experts)
    experts = [_gated_mlp(weights, f"{prefix}experts.{e}.", config, plan)
               for e in range(first, end)]
    shared = None
    if config.shared_expert_intermediate_size:
        gate = _float32(weights[prefix + "shared_expert_gate.weight"], plan).reshape(1, -1)
        shared = SharedExpert(_gated_mlp(weights, prefix + "shared_expert.", config, plan), gate)
    if plan.experts is None:
        return plan.backend.experts(router, experts, shared)
    if plan.reduce is None:
        raise ValueError("an expert-parallel plan needs its ranks' all-reduce")
    # This rank's experts; their partial sum is summed over the ranks, then the shared
    # expert (run on every rank) added once.
    return ExpertParallel(plan.backend.experts(router, experts, None, first_expert=first),
                          shared, plan.reduce)


def _gated_mlp(weights: dict[str, RawTensor], prefix: str, config: ModelConfig,
               plan: WeightPlan) -> GatedMLP:
    gate, up, down = (weights[prefix + p + ".weight"] for p in ("gate", "up", "down"))
    return plan.backend.gated_mlp(build_linear([gate, up], None, plan),
                                  build_linear([down], None, plan), config.hidden_activation)


def _float32(raw: RawTensor, plan: WeightPlan) -> torch.Tensor:
    # Router and shared-expert gate are small ([experts, hidden], [1, hidden]) and decide
    # which weights are read: kept in float32 whatever the compute dtype.
    return raw.dequantize().to(plan.device)
