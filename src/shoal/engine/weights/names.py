"""Canonical tensor names shared by the GGUF and safetensors readers, and stage filtering.

Global: embed.weight, norm.weight, lm_head.weight. Per layer i: layers.{i}.<part>.weight
(and .bias) with part one of attn_norm, q, k, v, o, q_norm, k_norm, post_attn_norm,
mlp_norm, post_mlp_norm, gate, up, down.
"""

from __future__ import annotations

from shoal.engine.models.config import ModelConfig

LayerRange = tuple[int, int]


def check_layer_range(layer_range: LayerRange | None, num_layers: int) -> LayerRange:
    """The half-open range [start, end), defaulting to the whole model."""
    if layer_range is None:
        return 0, num_layers
    start, end = layer_range
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not within 0..{num_layers}")
    return start, end


def in_stage(name: str, layer: int | None, start: int, end: int, config: ModelConfig) -> bool:
    """Whether the stage holding layers [start, end) needs this tensor."""
    if layer is not None:
        return start <= layer < end
    first, last = start == 0, end == config.num_layers
    if name == "embed.weight":
        # The last stage of a tied model reuses the embedding as its output head.
        return first or (last and config.tie_embeddings)
    return last  # norm.weight, lm_head.weight
