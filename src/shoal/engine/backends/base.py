"""Backend: how the engine's layers compute on one device.

A model's layers are built once at load, and each asks its plan's backend for the parts
that depend on how the arithmetic runs: a linear layer (packed or dense weights), a norm,
the gated MLP's activation, a mixture of experts, a group's attention over the paged
cache, the output head and the fused decode step. The backend answers with layers or with the callables they run,
resolved at load: a step's layers call them directly, with no dispatch of their own and
no test of the device. A new device or kernel family is one new subclass.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from shoal.engine.backends.packing import dense_values
from shoal.engine.backends.paged_attention import TorchPagedAttention
from shoal.engine.models.layers.attention import Attend
from shoal.engine.models.layers.experts import (
    GroupedRouter,
    MixtureOfExperts,
    Router,
    SharedExpert,
)
from shoal.engine.models.layers.linear import DenseLinear
from shoal.engine.models.layers.mlp import GatedMLP
from shoal.engine.models.layers.norm import RMSNorm
from shoal.engine.weights.quant import RawTensor

if TYPE_CHECKING:
    from shoal.engine.backends.fused_decode import FusedDecoder
    from shoal.engine.models.layers.embedding import Embedding
    from shoal.engine.models.llama import LlamaModel


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("" where unknown). torch's float32 x @ W.T of 2-4 rows
    reads W at a third of one row's speed on AMD CPUs, where W @ x.T keeps it; on Intel
    CPUs it is the other way round (a Xeon with AMX: 2-3 rows of x @ W.T cost what one
    row does, W @ x.T 2-3x that; 4, 16 and 32 rows about equal either way)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


class Backend(ABC):
    """Weights and arithmetic of one device and compute dtype.

    unpacker: the compiled extension wherever it built, to dequantize the GGUF types it
    knows at load (packing.dense_values), whatever the backend computes with.
    """

    name: str
    # Whether weight matrices stay as the file stores them (else dense compute_dtype).
    packs_weights = False
    # Whether each Python-path row attends on its own (the model runner then describes
    # every group by its rows' keys, layers/attention.py RowKeys), else groups attend
    # together over gathered, sliced or row-buffered keys (AttentionView).
    attends_rows = False

    def __init__(self, device: torch.device, compute_dtype: torch.dtype,
                 unpacker: ModuleType | None = None) -> None:
        self.device, self.compute_dtype, self.unpacker = device, compute_dtype, unpacker
        # torch's CPU attention kernels are ~8x slower in bfloat16 than in float32 for
        # small queries, so on CPU RoPE, scores and masks compute in float32; the KV cache
        # may still store bf16 (rounded as written, widened as read; int8: kv/quant.py).
        self.attention_dtype = torch.float32 if device.type == "cpu" else compute_dtype
        # Float32 CPU matmuls of some row counts run as W @ x.T (layers/linear.py), where
        # the CPU's x @ W.T is the slow one (AMD's: see cpu_vendor).
        self.streams_weight = (device.type == "cpu" and compute_dtype == torch.float32
                               and cpu_vendor() == "AuthenticAMD")
        # (type code, packed, vocab, width, ids [T]) -> float32 [T, width]: rows of a
        # packed table (an embedding's), where this backend packs weights.
        self.packed_rows: Callable | None = None

    # --- weights ---------------------------------------------------------------------
    def packs(self, raw: RawTensor) -> bool:
        """Whether this weight matrix stays packed (pack, packed_rows)."""
        return False

    def pack(self, raw: RawTensor) -> tuple[int, torch.Tensor]:
        """(type code, packed bytes) of a matrix that packs(raw) keeps packed."""
        raise NotImplementedError(f"the {self.name} backend keeps no weights packed")

    def dense(self, raw: RawTensor) -> torch.Tensor:
        """A weight's values [out, in] (or [D]) in the compute dtype on the device."""
        return dense_values(raw, self.unpacker).to(device=self.device,
                                                    dtype=self.compute_dtype)

    # --- layers ----------------------------------------------------------------------
    def dense_linear(self, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> DenseLinear:
        return DenseLinear(weight, bias, streams_weight=self.streams_weight)

    def linear(self, weights: list[RawTensor], biases: list[RawTensor] | None,
               float_out: bool = False) -> nn.Module:
        """One linear layer computing all `weights` at once (outputs concatenated in order);
        float_out: float32 results (the head's logits)."""
        return self.dense_linear(*self._dense_parts(weights, biases))

    def _dense_parts(self, weights: list[RawTensor], biases: list[RawTensor] | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = [dense_values(w, self.unpacker) for w in weights]  # float32 [out, in] each
        dense = parts[0] if len(parts) == 1 else torch.cat(parts)  # [sum(out), in]
        bias = None
        if biases:
            bias = torch.cat([b.dequantize() for b in biases]).to(  # [sum(out)]
                device=self.device, dtype=self.compute_dtype)
        return dense.to(device=self.device, dtype=self.compute_dtype), bias

    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                  sinks: torch.Tensor | None = None) -> Attend:
        """One layer's attention of a group over the paged cache (layers/attention.py);
        sinks: [H] float32 logits joining each head's softmax denominator (gpt-oss)."""
        return TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale, sinks).attend

    def latent_attention(self, num_heads: int, latent_dim: int, value_dim: int,
                         scale: float) -> Attend:
        """DeepSeek's absorbed latent attention (models/deepseek2.py): q [T, H, latent_dim]
        against one cached row per token [1, slots, latent_dim], whose first value_dim
        elements are the values; the output is [rows, H * value_dim]. torch's on every
        backend: the compiled row attention reads a key and a value row per KV head. A
        backend whose rows attend on their own keeps a decode's bits free of its batch."""
        return TorchPagedAttention(num_heads, 1, latent_dim, scale, latent_values=value_dim,
                                   exact_rows=self.attends_rows).attend

    def norm(self, weight: torch.Tensor, eps: float) -> RMSNorm:
        return RMSNorm(weight, eps)

    def gated_mlp(self, gate_up: nn.Module, down: nn.Module, activation: str) -> GatedMLP:
        return GatedMLP(gate_up, down, activation)

    def experts(self, router: Router | GroupedRouter, experts: list[GatedMLP],
                shared: SharedExpert | None, first_expert: int = 0) -> MixtureOfExperts:
        """A mixture-of-experts feed-forward: the router picks each row's experts in float32
        and rows are grouped by expert, so a step reads each chosen expert's weights once
        (each expert a gated_mlp of this backend's linears). experts are the router's
        [first_expert, first_expert + len(experts)): an expert-parallel rank's share."""
        return MixtureOfExperts(router, experts, shared, first_expert)

    @abstractmethod
    def head(self, raw: RawTensor, embedding: Embedding | None, spare_bytes: int
             ) -> nn.Module:
        """The output head [vocab, hidden] giving float32 logits (layers/head.build_head
        has taken a tied embedding's dense table already)."""

    def splits_table(self, raw: RawTensor) -> bool:
        """Whether head() splits this table (a tied embedding then waits for the split)."""
        return False

    # --- whole steps -----------------------------------------------------------------
    def fuses_decode(self, model: LlamaModel) -> bool:
        """Whether this model's decode steps may run as one compiled call."""
        return False

    def fused_decoder(self, model: LlamaModel) -> FusedDecoder:
        raise NotImplementedError(f"the {self.name} backend has no fused decoder")

    def describe(self) -> str:
        """The backend and its kernels' variant, for reports."""
        return self.name
