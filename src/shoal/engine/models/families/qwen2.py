"""Qwen2 (Qwen2.5, Qwen2.5-Coder): the llama skeleton with q/k/v biases."""

from shoal.engine.models.families.family import ModelFamily

QWEN2 = ModelFamily(
    name="qwen2",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    tensor_tables="qwen2",
    # Qwen2's config.json has no attention_bias key: the biases are always there.
    config_defaults={"qkv_bias": True},
)
