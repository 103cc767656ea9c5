"""Config readers shared by the mixture-of-experts families (qwen3moe, qwen2moe, mixtral;
glm4moe and deepseek2 with their grouped routing).

GGUF files say the expert shape under llama.cpp's keys (expert_count, expert_used_count,
expert_feed_forward_length, expert_shared_feed_forward_length); whether the top-k weights
are renormalised is fixed per family in llama.cpp, so it is the family's default here unless
the file says expert_weights_norm. config.json names differ by family: the family passes
its keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shoal.engine.errors import UnsupportedModel


def gguf_expert_config(read: Callable[[str, Any], Any], common: dict[str, Any],
                       norm_topk_prob: bool) -> dict[str, Any]:
    """The expert fields of a GGUF file (num_experts 0 when it has none)."""
    return dict(
        num_experts=int(read("expert_count", 0) or 0),
        num_experts_per_token=int(read("expert_used_count", 0) or 0),
        expert_intermediate_size=int(read("expert_feed_forward_length",
                                          common["intermediate_size"])),
        shared_expert_intermediate_size=int(read("expert_shared_feed_forward_length", 0) or 0),
        norm_topk_prob=bool(read("expert_weights_norm", norm_topk_prob)),
    )


def hf_expert_config(hf: Mapping[str, Any], common: dict[str, Any], *, expert_size_key: str,
                     norm_topk_prob: bool | None = None,
                     shared_size_key: str | None = None) -> dict[str, Any]:
    """The expert fields of a config.json; norm_topk_prob None reads the file's own flag
    (transformers' default: False). The expert count is num_experts (Qwen) or
    num_local_experts (Mixtral, and transformers 5's own saves of either)."""
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
        # Released checkpoints route every layer; the gguf tables these families name
        # have no dense MLP tensors for a layer that does not.
        raise UnsupportedModel("mixture-of-experts layers mixed with dense MLP layers "
                               "(mlp_only_layers, decoder_sparse_step) are not supported")
    return dict(
        num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
        num_experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf[expert_size_key]),
        shared_expert_intermediate_size=(int(hf.get(shared_size_key) or 0)
                                         if shared_size_key else 0),
        norm_topk_prob=(bool(hf.get("norm_topk_prob", False)) if norm_topk_prob is None
                        else norm_topk_prob),
    )


# GGUF expert_gating_func values (gguf.ExpertGatingFuncType): 1 softmax, 2 sigmoid.
_GATING = {1: "softmax", 2: "sigmoid"}


def gguf_grouped_expert_config(read: Callable[[str, Any], Any], common: dict[str, Any],
                               scoring: str) -> dict[str, Any]:
    """The expert fields of GLM-4.5's and DeepSeek's GGUF files: shared experts counted in
    experts (expert_shared_count), leading dense layers, grouped routing, the weights'
    scale; scoring where the file does not say expert_gating_func."""
    experts = gguf_expert_config(read, common, norm_topk_prob=False)
    gating = int(read("expert_gating_func", 0) or 0)
    if gating and gating not in _GATING:
        raise UnsupportedModel(f"expert gating function {gating} is not supported")
    shared = int(read("expert_shared_count", 0) or 0)
    return experts | dict(
        shared_expert_intermediate_size=shared * experts["expert_intermediate_size"],
        first_dense_layers=int(read("leading_dense_block_count", 0) or 0),
        expert_scoring=_GATING.get(gating, scoring),
        expert_groups=int(read("expert_group_count", 1) or 1),
        expert_groups_used=int(read("expert_group_used_count", 1) or 1),
        routed_scaling_factor=float(read("expert_weights_scale", 1.0) or 1.0),
    )


def hf_grouped_expert_config(hf: Mapping[str, Any], scoring: str,
                             norm_topk_prob: bool) -> dict[str, Any]:
    """The same fields from GLM-4.5's and DeepSeek's config.json (n_routed_experts,
    n_shared_experts of moe_intermediate_size each, first_k_dense_replace, n_group,
    topk_group, routed_scaling_factor); norm_topk_prob where the file does not say."""
    size = int(hf["moe_intermediate_size"])
    return dict(
        num_experts=int(hf["n_routed_experts"]),
        num_experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=size,
        shared_expert_intermediate_size=size * int(hf.get("n_shared_experts") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", norm_topk_prob)),
        first_dense_layers=int(hf.get("first_k_dense_replace") or 0),
        expert_scoring=scoring,
        expert_groups=int(hf.get("n_group") or 1),
        expert_groups_used=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )
