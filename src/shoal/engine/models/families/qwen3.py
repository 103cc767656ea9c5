"""Qwen3: the llama skeleton with RMSNorm on each head's q and k."""

from shoal.engine.models.families.family import ModelFamily

QWEN3 = ModelFamily(
    name="qwen3",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    tensor_tables="qwen3",
    config_defaults={"qk_norm": True},
)
