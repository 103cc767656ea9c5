"""Llama (and Mistral, which shares its structure and GGUF layout): the decoder skeleton."""

from shoal.engine.models.families.family import ModelFamily

LLAMA = ModelFamily(
    name="llama",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_model_types=("llama", "mistral"),
    gguf_architectures=("llama", "mistral"),
    tensor_tables="llama",
    gguf_permuted_qk=True,
)
