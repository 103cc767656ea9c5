"""Tensor-parallel pieces of a decoder block.

A rank computes its heads (q, k, v rows of its shard) and its MLP columns (gate and up rows);
the output projection and the MLP's down projection then hold only their input columns, so
each produces a partial sum [T, hidden] that RowParallel adds up across the ranks. Norms,
embeddings and the output head are replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from shoal.engine.models.config import ModelConfig
from shoal.engine.models.layers.base import Layer
from shoal.engine.parallel.shard import (
    HeadShard,
    TensorShard,
    head_shard,
    take_columns,
    take_rows,
    take_vector,
)
from shoal.engine.weights.quant import RawTensor

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class RowParallel(Layer):
    """A layer holding some input columns: its output is summed over the ranks."""

    def __init__(self, inner: nn.Module, reduce: AllReduce) -> None:
        super().__init__()
        self.inner = inner
        self._reduce = reduce
        self.out_features = getattr(inner, "out_features", None)

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        return self._reduce(self.inner(x, prompt_from).contiguous())

    def nbytes(self) -> int:
        return self.inner.nbytes() if hasattr(self.inner, "nbytes") else 0


def rank_config(config: ModelConfig, shard: TensorShard) -> ModelConfig:
    """The model as one rank holds it: its heads, its KV heads, its MLP width (the KV cache
    and the attention are sized from this)."""
    heads = head_shard(config.num_heads, config.num_kv_heads, shard)
    start, end = shard.split(config.intermediate_size, "MLP width")
    return dataclasses.replace(config, num_heads=heads.num_heads,
                               num_kv_heads=heads.num_kv_heads, intermediate_size=end - start)


def shard_attention(config: ModelConfig, shard: TensorShard, qkv: list[RawTensor],
                    biases: list[RawTensor] | None, o: RawTensor
                    ) -> tuple[list[RawTensor], list[RawTensor] | None, RawTensor, HeadShard]:
    """This rank's q, k, v rows (and biases) and o columns, and the heads they make."""
    heads = head_shard(config.num_heads, config.num_kv_heads, shard)
    dim = config.head_dim
    q_rows = (heads.q_start * dim, heads.q_end * dim)
    kv_rows = (heads.kv_start * dim, heads.kv_end * dim)
    ranges = [q_rows, kv_rows, kv_rows]
    parts = [take_rows(raw, *rows) for raw, rows in zip(qkv, ranges)]
    sliced_biases = None
    if biases is not None:
        sliced_biases = [take_vector(raw, *rows) for raw, rows in zip(biases, ranges)]
    return parts, sliced_biases, take_columns(o, *q_rows), heads


def shard_mlp(config: ModelConfig, shard: TensorShard, gate: RawTensor, up: RawTensor,
              down: RawTensor) -> tuple[RawTensor, RawTensor, RawTensor]:
    start, end = shard.split(config.intermediate_size, "MLP width")
    return take_rows(gate, start, end), take_rows(up, start, end), take_columns(down, start, end)
