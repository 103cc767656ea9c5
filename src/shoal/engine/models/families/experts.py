"""Config readers shared by the mixture-of-experts families (qwen3moe, qwen2moe, mixtral).

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
