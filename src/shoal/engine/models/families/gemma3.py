"""Gemma 3 text decoders: its own model file (models/gemma3.py), config and tokenizer quirks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shoal.engine.models.families.family import ModelFamily

# Every sixth layer attends globally, the others to a sliding window (Gemma 3's default
# where the checkpoint does not list its layer types).
GLOBAL_LAYER_EVERY = 6
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_LOCAL_ROPE_THETA = 10000.0

# Gemma's turn format: a system message is folded into the first user turn, "assistant" is
# spelled "model", and the prompt starts with <bos>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system_prefix = messages[0]['content'] | trim + '\\n\\n' %}"
    "{% set turns = messages[1:] %}"
    "{% else %}{% set system_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (system_prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def _default_layer_types(num_layers: int, every: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(num_layers))


def gguf_config_extras(read: Callable[[str, Any], Any], common: dict[str, Any]) -> dict[str, Any]:
    # Which layers slide and the local RoPE base are not in the GGUF metadata; these are
    # Gemma 3's defaults, as transformers fills them too.
    return dict(
        sliding_window=int(read("attention.sliding_window", DEFAULT_SLIDING_WINDOW)),
        layer_types=_default_layer_types(common["num_layers"], GLOBAL_LAYER_EVERY),
        rope_local_theta=DEFAULT_LOCAL_ROPE_THETA,
        attention_scale=common["head_dim"] ** -0.5,
    )


def hf_config_extras(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    types = hf.get("layer_types")
    layer_types = (
        tuple("sliding" if t == "sliding_attention" else "full" for t in types) if types
        else _default_layer_types(common["num_layers"],
                                  hf.get("sliding_window_pattern", GLOBAL_LAYER_EVERY)))
    # transformers 5 nests the local RoPE base under rope_parameters["sliding_attention"].
    local = (hf.get("rope_parameters") or {}).get("sliding_attention", {})
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq",
                                                 DEFAULT_LOCAL_ROPE_THETA))
    return dict(
        sliding_window=hf.get("sliding_window", DEFAULT_SLIDING_WINDOW),
        layer_types=layer_types,
        rope_local_theta=float(local_theta),
        attention_scale=float(hf.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )


GEMMA3 = ModelFamily(
    name="gemma3",
    model="shoal.engine.models.gemma3:Gemma3Model",
    hf_architectures=("Gemma3ForCausalLM",),
    hf_model_types=("gemma3", "gemma3_text"),
    gguf_architectures=("gemma3",),
    tensor_tables="gemma3",
    config_defaults={"tie_embeddings": True, "qk_norm": True, "hidden_activation": "gelu_tanh"},
    gguf_config_extras=gguf_config_extras,
    hf_config_extras=hf_config_extras,
    supports_sliding_window=True,
    hf_norm_offset=1.0,
    sentencepiece_style="gemma",
    default_chat_template=GEMMA_TEMPLATE,
)
