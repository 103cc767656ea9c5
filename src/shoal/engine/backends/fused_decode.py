"""The fused decode path: a model's blocks run by the compiled kernel (decode.cpp).

Applies to steps of single-token decodes of llama-family and Gemma 3 models on the compiled
CPU kernels' backend (packed weights, bf16 activations), a float32, bf16 or int8 KV cache,
and no tensor-parallel shards. Everything else (prefill, other backends) stays on the
Python path.
SHOAL_FUSED_DECODE=0 turns it off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from shoal.engine.models.layers.attention import DecodeRows
from shoal.engine.backends.packing import QuantLinear

if TYPE_CHECKING:
    from shoal.engine.models.llama import LlamaModel

# Decode steps of up to this many rows run on the kernel; beyond it the per-op overhead it
# saves is a small share of a step.
FUSED_MAX_ROWS = 64


def enabled() -> bool:
    return os.environ.get("SHOAL_FUSED_DECODE", "1").strip().lower() not in ("0", "false", "no")


def fusable(model: LlamaModel) -> bool:
    """Whether a model whose layers the compiled kernels built can decode fused."""
    config, plan = model.config, model.plan
    if not (enabled() and model.fused_decode_family and plan.shard is None):
        return False
    if config.hidden_activation not in ("silu", "gelu_tanh") or config.head_dim > 512:
        return False
    if config.num_experts:  # the kernel's blocks have one dense MLP each
        return False
    return all(type(layer) is QuantLinear for block in model.blocks for layer in _linears(block))


def _linears(block) -> tuple:
    return block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down


def _norms(block) -> list[torch.Tensor]:
    """attn, mlp, post-attention, post-MLP, q and k norm weights; empty where absent."""
    none = torch.empty(0)

    def weight(norm) -> torch.Tensor:
        return none if norm is None else norm.weight

    attn = block.attn
    return [weight(block.attn_norm), weight(block.mlp_norm),
            weight(getattr(block, "post_attn_norm", None)),
            weight(getattr(block, "post_mlp_norm", None)),
            weight(attn.q_norm), weight(attn.k_norm)]


class FusedDecoder:
    """The kernel's Decoder over one model's blocks (it holds their weights)."""

    max_rows = FUSED_MAX_ROWS

    def __init__(self, model: LlamaModel, kernel) -> None:
        config = model.config
        norms, linears, sliding = [], [], []
        for offset, block in enumerate(model.blocks):
            norms += _norms(block)
            linears += [layer.op for layer in _linears(block)]
            sliding.append(config.layer_type(model.start + offset) == "sliding")
        window = config.sliding_window if any(sliding) else 0
        self._decoder = kernel.Decoder(
            norms, linears, sliding, config.num_heads, config.num_kv_heads, config.head_dim,
            config.scale, config.rms_eps, window or 0,
            config.hidden_activation == "gelu_tanh")

    def __call__(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor],
                 rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 slot_mapping: torch.Tensor, rows: DecodeRows) -> torch.Tensor:
        """hidden: [B, hidden] bf16; rope: the model's tables, (cos, signed sin) [B, 1, D]
        float32 each -> [B, hidden] bf16."""
        full = rope["global"]
        local = rope.get("local", full)
        tables = [t.squeeze(1).contiguous() for t in (*full, *local)]
        return self._decoder.forward(hidden, kv_caches, tables, slot_mapping, rows.tables,
                                     rows.context_lens, rows.block_size, rows.chained)
