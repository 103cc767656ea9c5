"""Gemma 3 text decoder.

Differences from the llama skeleton: four norms per block (post-attention and post-MLP norms
on the branch outputs), gelu-tanh MLP, q/k RMSNorm, embeddings scaled by sqrt(hidden),
sliding-window layers with their own (local) RoPE base. Norm weights arrive with Gemma's +1
already folded in (GGUF stores them so; the safetensors reader adds it).
"""

from __future__ import annotations

import torch

from shoal.engine.models.config import ModelConfig
from shoal.engine.models.layers.attention import AttentionMetadata, prompt_from_of
from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.linear import WeightPlan
from shoal.engine.models.layers.rotary import RotaryTable
from shoal.engine.models.llama import (
    KVCache,
    LlamaModel,
    Weights,
    make_attention,
    make_mlp,
    make_norm,
)


class Gemma3Block(Layer):
    def __init__(self, config: ModelConfig, index: int, weights: Weights, plan: WeightPlan):
        super().__init__()
        prefix = f"layers.{index}."

        def norm(part: str):
            return make_norm(weights[prefix + part + ".weight"], config, plan)

        self.attn_norm, self.post_attn_norm = norm("attn_norm"), norm("post_attn_norm")
        self.mlp_norm, self.post_mlp_norm = norm("mlp_norm"), norm("post_mlp_norm")
        self.attn = make_attention(config, index, weights, plan)
        self.mlp = make_mlp(config, index, weights, plan)

    def forward(self, h: torch.Tensor, rope, kv_cache: KVCache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden], or the rows `keep` selects (see LlamaModel)."""
        attended = self.post_attn_norm(self.attn(self.attn_norm(h), rope, kv_cache, meta, keep))
        h = (h if keep is None else h[keep]) + attended
        return h + self.post_mlp_norm(self.mlp(self.mlp_norm(h), prompt_from_of(meta, keep)))


class Gemma3Model(LlamaModel):
    block_class = Gemma3Block

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        # Sliding layers use the local base without scaling; global layers use rope_theta.
        local_theta = config.rope_local_theta or config.rope_theta
        self.local_rotary = RotaryTable(config.head_dim, local_theta, config.max_position)

    def embedding_scale(self) -> float | None:
        return self.config.hidden_size ** 0.5

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple]:
        dtype = self.attention_dtype
        return {"global": self.rotary.lookup(positions, dtype),
                "local": self.local_rotary.lookup(positions, dtype)}

    def rope_for_layer(self, index: int, tables: dict[str, tuple]) -> tuple:
        return tables["local" if self.config.layer_type(index) == "sliding" else "global"]
