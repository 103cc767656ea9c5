"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), top-k
experts, and a shared expert every token runs, scaled by sigmoid(shared_expert_gate . x)."""

from __future__ import annotations

from functools import partial

from shoal.engine.models.families.experts import gguf_expert_config, hf_expert_config
from shoal.engine.models.families.family import HF_CONFIG_KEYS, ModelFamily

QWEN2MOE = ModelFamily(
    name="qwen2moe",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("Qwen2MoeForCausalLM",),
    hf_model_types=("qwen2_moe",),
    gguf_architectures=("qwen2moe",),
    tensor_tables="qwen2moe",
    # transformers' Qwen2MoeConfig calls the q/k/v biases qkv_bias (default: present).
    hf_config_keys={**HF_CONFIG_KEYS, "qkv_bias": "qkv_bias"},
    config_defaults={"qkv_bias": True},
    # llama.cpp never renormalises Qwen2-MoE's top-k weights (its config.json says so too).
    gguf_config_extras=partial(gguf_expert_config, norm_topk_prob=False),
    hf_config_extras=partial(hf_expert_config, expert_size_key="moe_intermediate_size",
                             shared_size_key="shared_expert_intermediate_size"),
)
