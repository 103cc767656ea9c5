"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k
norm) with each MLP replaced by top-k softmax routing over many small experts."""

from __future__ import annotations

from functools import partial

from shoal.engine.models.families.experts import gguf_expert_config, hf_expert_config
from shoal.engine.models.families.family import ModelFamily

QWEN3MOE = ModelFamily(
    name="qwen3moe",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    tensor_tables="qwen3moe",
    config_defaults={"qk_norm": True},
    # llama.cpp always renormalises Qwen3-MoE's top-k weights (as its config.json says).
    gguf_config_extras=partial(gguf_expert_config, norm_topk_prob=True),
    hf_config_extras=partial(hf_expert_config, expert_size_key="moe_intermediate_size"),
)
