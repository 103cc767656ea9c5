"""Llama (and Mistral, which shares its structure and GGUF layout): the decoder skeleton."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shoal.engine.models.families.experts import gguf_expert_config
from shoal.engine.models.families.family import ModelFamily


def gguf_config_extras(read: Callable[[str, Any], Any], common: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp writes Mixtral as a "llama" file with experts (llama.expert_count): it is
    # the mixtral family, as its config.json says, whichever format it comes in.
    experts = gguf_expert_config(read, common, norm_topk_prob=True)
    return experts | ({"architecture": "mixtral"} if experts["num_experts"] else {})


LLAMA = ModelFamily(
    name="llama",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_model_types=("llama", "mistral"),
    gguf_architectures=("llama", "mistral"),
    tensor_tables="llama",
    gguf_permuted_qk=True,
    gguf_config_extras=gguf_config_extras,
)
