"""GLM-4.5 / 4.5-Air / 4.6 (Glm4MoeForCausalLM): llama-style attention with q/k/v biases,
optional q/k norm and RoPE on half of each head, dense leading layers, then sigmoid-scored
grouped routing over many small experts plus an always-on shared expert.

Real checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the
last decoder layer (config.json's model.layers.{num_hidden_layers}, counted in a GGUF
file's block_count): shoal does not use them, so they are never read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shoal.engine.models.families.experts import (
    gguf_grouped_expert_config,
    hf_grouped_expert_config,
)
from shoal.engine.models.families.family import ModelFamily

# transformers' default where the checkpoint does not say (GLM-4.5 rotates half of a head).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def gguf_config_extras(read: Callable[[str, Any], Any], common: dict[str, Any]) -> dict[str, Any]:
    nextn = int(read("nextn_predict_layers", 0) or 0)
    values = gguf_grouped_expert_config(read, common, scoring="sigmoid")
    # llama.cpp renormalises unless the file says otherwise (GLM-4.5's config.json does).
    values["norm_topk_prob"] = bool(read("expert_weights_norm", True))
    return values | dict(
        num_layers=common["num_layers"] - nextn,
        rotary_dim=int(read("rope.dimension_count", common["head_dim"])),
    )


def hf_config_extras(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor",
                      hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    values = hf_grouped_expert_config(hf, scoring="sigmoid", norm_topk_prob=True)
    values["first_dense_layers"] = int(hf.get("first_k_dense_replace", 1) or 0)
    return values | dict(
        qk_norm=bool(hf.get("use_qk_norm", False)),
        rotary_dim=int(common["head_dim"] * factor),
    )


GLM4MOE = ModelFamily(
    name="glm4moe",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("Glm4MoeForCausalLM",),
    hf_model_types=("glm4_moe",),
    gguf_architectures=("glm4moe",),
    tensor_tables="glm4moe",
    # Its post_attention_layernorm normalises the MLP's input, as llama's ffn_norm does.
    tensor_parts={"ATTN_POST_NORM": "mlp_norm"},
    gguf_config_extras=gguf_config_extras,
    hf_config_extras=hf_config_extras,
)
