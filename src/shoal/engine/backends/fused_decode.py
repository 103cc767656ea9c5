"""The fused decode path: a model's blocks run by the compiled kernel (decode.cpp).

Applies to steps of single-token decodes of llama-family and Gemma 3 models, and of the
mixture-of-experts ones among them with top-k softmax routing (qwen3moe, qwen2moe, mixtral:
their experts in the kernel's RoutedFeedForward), on the compiled CPU kernels' backend
(packed weights, bf16 activations), a float32, bf16 or int8 KV cache, and no tensor- or
expert-parallel shards. Everything else (prefill, other backends) stays on the Python path.
SHOAL_FUSED_DECODE=0 turns it off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from shoal.engine.models.layers.attention import DecodeRows
from shoal.engine.models.layers.experts import MixtureOfExperts, Router
from shoal.engine.models.layers.mlp import GatedMLP
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
    return all(_fusable_block(block) for block in model.blocks)


def _fusable_block(block) -> bool:
    attn, mlp = block.attn, block.mlp
    if not (type(attn.qkv) is QuantLinear and type(attn.o) is QuantLinear):
        return False
    if type(mlp) is MixtureOfExperts:
        return _fusable_experts(mlp)
    return _packed_gated_mlp(mlp)


def _packed_gated_mlp(mlp) -> bool:
    return (type(mlp) is GatedMLP and mlp.gated is not None
            and type(mlp.gate_up) is QuantLinear and type(mlp.down) is QuantLinear)


def _fusable_experts(mlp: MixtureOfExperts) -> bool:
    """Softmax top-k routing over every expert of the layer (no expert-parallel share), the
    experts in the kernel's GroupedExperts, a shared expert (if any) a packed gated MLP."""
    router = mlp.router
    return (type(router) is Router and mlp.grouped is not None and mlp.first_expert == 0
            and len(mlp.experts) == router.weight.shape[0]
            and (mlp.shared is None or _packed_gated_mlp(mlp.shared.mlp)))


def _linears(block) -> list:
    """qkv, o, gate_up, down: the last two None in a mixture-of-experts block."""
    attn, mlp = block.attn, block.mlp
    if type(mlp) is MixtureOfExperts:
        return [attn.qkv.op, attn.o.op, None, None]
    return [attn.qkv.op, attn.o.op, mlp.gate_up.op, mlp.down.op]


def _experts(block, kernel):
    """The kernel's RoutedFeedForward for a mixture-of-experts block, else None."""
    mlp = block.mlp
    if type(mlp) is not MixtureOfExperts:
        return None
    router, shared = mlp.router, mlp.shared
    # grouped is the bound forward of the kernel's GroupedExperts (cpu_kernels.experts).
    experts = mlp.grouped.__self__
    if shared is None:
        return kernel.RoutedFeedForward(router.weight, router.top_k, router.normalize, experts)
    return kernel.RoutedFeedForward(router.weight, router.top_k, router.normalize, experts,
                                    shared.mlp.gate_up.op, shared.mlp.down.op, shared.gate,
                                    shared.mlp.gelu)


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
        norms, linears, experts, sliding = [], [], [], []
        for offset, block in enumerate(model.blocks):
            norms += _norms(block)
            linears += _linears(block)
            experts.append(_experts(block, kernel))
            sliding.append(config.layer_type(model.start + offset) == "sliding")
        window = config.sliding_window if any(sliding) else 0
        self._decoder = kernel.Decoder(
            norms, linears, experts, sliding, config.num_heads, config.num_kv_heads, config.head_dim,
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
