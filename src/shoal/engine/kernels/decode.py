"""The fused decode path: a llama-family model's blocks run by the compiled kernel.

Applies to steps of single-token decodes on CPU, with bf16 activations and a float32 KV
cache, without tensor-parallel shards, q/k norms or sliding layers. Quantized layers
multiply with their int4 / int8 weights up to QUANT_MAX_ROWS rows and with their dense copy
beyond, as on the Python path; without dense copies the kernel takes at most QUANT_MAX_ROWS
rows. Everything else (prefill, other families, fp32) stays on the Python path.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from shoal.engine.models.layers.attention import DecodeRows
from shoal.engine.models.layers.linear import QUANT_MAX_ROWS, DenseLinear, Int4Linear, Int8Linear

if TYPE_CHECKING:
    from shoal.engine.models.llama import LlamaModel


# Decode steps of up to this many rows run on the kernel (given dense copies). Beyond it the
# per-op overhead it saves is a small share of a step.
FUSED_MAX_ROWS = 32


def fusable(model: LlamaModel) -> bool:
    config, plan = model.config, model.plan
    if not (model.fused_decode_family and plan.device.type == "cpu" and plan.shard is None
            and plan.compute_dtype == torch.bfloat16 and model.attention_dtype == torch.float32):
        return False
    if config.qk_norm or "sliding" in config.layer_types or config.hidden_activation != "silu":
        return False
    linears = [layer for block in model.blocks for layer in _linears(block)]
    return bool(linears) and all(type(layer) in _KINDS for layer in linears)


# The kernel's LinearKind of each linear layer class (decode.cpp).
_KINDS = {Int4Linear: 0, Int8Linear: 1, DenseLinear: 2}


def _linears(block) -> tuple:
    return block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down


def _linear_tensors(layer) -> tuple[torch.Tensor | None, ...]:
    """(weight, scales, bias, prepacked dense copy) in the kernel's order for its kind."""
    if isinstance(layer, Int4Linear):
        return layer.packed, layer.scales_and_zeros, layer.bias, _dense_copy(layer)
    if isinstance(layer, Int8Linear):
        return layer.q, layer.scale, layer.bias, _dense_copy(layer)
    return layer.weight, None, layer.bias, None


def _dense_copy(layer) -> torch.Tensor | None:
    return None if layer.dense is None else layer.dense.packed


class FusedDecoder:
    """The kernel's LlamaDecoder over one model's blocks (it holds their weight tensors)."""

    def __init__(self, kernel: ModuleType, model: LlamaModel) -> None:
        norms: list[torch.Tensor] = []
        linears: list[torch.Tensor] = []
        kinds: list[int] = []
        none = torch.empty(0)
        dense_everywhere = True
        for block in model.blocks:
            norms += [block.attn_norm.weight, block.mlp_norm.weight]
            for layer in _linears(block):
                kinds.append(_KINDS[type(layer)])
                tensors = _linear_tensors(layer)
                dense_everywhere &= type(layer) is DenseLinear or tensors[3] is not None
                linears += [none if t is None else t for t in tensors]
        # The most rows a step may have to run here.
        self.max_rows = FUSED_MAX_ROWS if dense_everywhere else QUANT_MAX_ROWS
        config = model.config
        self._decoder = kernel.LlamaDecoder(norms, linears, kinds, config.num_heads,
                                            config.num_kv_heads, config.head_dim,
                                            config.scale, config.rms_eps, QUANT_MAX_ROWS)

    def __call__(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor],
                 rope: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                 rows: DecodeRows) -> torch.Tensor:
        """hidden: [B, hidden] bf16; rope: (cos, signed sin) [B, 1, D] float32 -> [B, hidden]."""
        cos, sin = rope
        return self._decoder.forward(hidden, kv_caches, cos.squeeze(1), sin.squeeze(1),
                                     slot_mapping, rows.tables, rows.context_lens,
                                     rows.block_size)
