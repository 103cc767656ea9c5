"""CpuKernels: the compiled CPU kernels (kernels/quant_*.cpp, decode.cpp) in bf16.

Every GGUF type (and dense bf16 / fp16 / fp32 weights) stays packed as the file stores
it; linear layers, norms, the gated activation, prompt and decode rows' attention, the
output head's estimate and whole decode steps run on the kernels. Each row's result is
exact up to float32 sums of bf16 activations and does not depend on the rows beside it.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from shoal.engine.backends import head_estimates
from shoal.engine.backends.base import Backend
from shoal.engine.backends.fused_decode import FusedDecoder, fusable
from shoal.engine.backends.packing import QuantLinear, pack, packed_type
from shoal.engine.models.layers.attention import Attend, AttentionGroup
from shoal.engine.models.layers.experts import (
    ClampedSwiGLU,
    GroupedRouter,
    LogitTopKRouter,
    MixtureOfExperts,
    Router,
    SharedExpert,
)
from shoal.engine.models.layers.head import ExactHead
from shoal.engine.models.layers.mlp import GatedMLP
from shoal.engine.models.layers.norm import RMSNorm
from shoal.engine.weights.quant import RawTensor

log = logging.getLogger(__name__)


class CpuKernels(Backend):
    """kernel: the compiled extension (kernels/build.py), with its fast packed paths."""

    name = "cpu-kernels"
    packs_weights = True
    attends_rows = True  # a row's result does not depend on how its prompt was split

    def __init__(self, kernel: ModuleType) -> None:
        super().__init__(torch.device("cpu"), torch.bfloat16, unpacker=kernel)
        self.kernel = kernel
        self.packed_rows = kernel.quant_dequantize_rows

    def packs(self, raw: RawTensor) -> bool:
        return packed_type(raw) is not None

    def pack(self, raw: RawTensor) -> tuple[int, torch.Tensor]:
        return pack(raw, self.kernel)

    def linear(self, weights: list[RawTensor], biases: list[RawTensor] | None,
               float_out: bool = False) -> nn.Module:
        if not all(packed_type(w) for w in weights):
            log.info("weights %s %s have no packed form: loaded dequantized",
                     sorted({w.quant for w in weights}), [tuple(w.shape) for w in weights])
            return super().linear(weights, biases, float_out)
        bias = torch.cat([b.dequantize() for b in biases]) if biases else None  # float32
        codes, packed = zip(*(pack(w, self.kernel) for w in weights))
        op = self.kernel.QuantLinear(list(codes), list(packed), [w.shape[0] for w in weights],
                                     weights[0].shape[1], bias)
        return QuantLinear(op, float_out)

    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                  sinks: torch.Tensor | None = None) -> Attend:
        return RowAttention(self.kernel.attend_rows, scale, sinks).attend

    def norm(self, weight: torch.Tensor, eps: float) -> RMSNorm:
        return RMSNorm(weight, eps, self.kernel.rms_norm_rows)

    def gated_mlp(self, gate_up: nn.Module, down: nn.Module, activation: str) -> GatedMLP:
        return GatedMLP(gate_up, down, activation, self.kernel.gated)

    def experts(self, router: Router | GroupedRouter | LogitTopKRouter,
                experts: list[GatedMLP] | list[ClampedSwiGLU],
                shared: SharedExpert | None, first_expert: int = 0) -> MixtureOfExperts:
        """Experts whose linears are all packed run in one compiled call per step
        (GroupedExperts: the same bits as the per-expert loop, without Python between
        experts)."""
        grouped = None
        packed = all(type(e.gate_up) is QuantLinear and type(e.down) is QuantLinear
                     for e in experts)
        first = experts[0]
        # Plain gated MLPs on this kernel's activation (silu or gelu_tanh, one for all), or
        # gpt-oss's clamped SwiGLU (one alpha and limit for all); any other keeps the loop.
        if packed and all(type(e) is GatedMLP and e.gated is self.kernel.gated
                          and e.gelu == first.gelu for e in experts):
            grouped = self.kernel.GroupedExperts([e.gate_up.op for e in experts],
                                                 [e.down.op for e in experts],
                                                 first.gelu).forward
        elif packed and all(type(e) is ClampedSwiGLU and e.alpha == first.alpha
                            and e.limit == first.limit for e in experts):
            grouped = self.kernel.GroupedExperts(
                [e.gate_up.op for e in experts], [e.down.op for e in experts], False,
                swiglu_alpha=first.alpha, swiglu_limit=first.limit).forward
        return MixtureOfExperts(router, experts, shared, first_expert, grouped)

    def head(self, raw: RawTensor, embedding, spare_bytes: int) -> nn.Module:
        if packed_type(raw) is None:  # a tied embedding would be dense (build_head)
            return ExactHead(self.linear([raw], None, float_out=True), tied=False)
        return head_estimates.packed_head(self.kernel, raw, embedding, spare_bytes)

    def splits_table(self, raw: RawTensor) -> bool:
        return head_estimates.splits_table(self.kernel, raw)

    def fuses_decode(self, model) -> bool:
        return fusable(model)

    def fused_decoder(self, model) -> FusedDecoder:
        return FusedDecoder(model, self.kernel)

    def describe(self) -> str:
        return self.kernel.quant_default_backend()


class RowAttention:
    """Each row of a group attends on its own (kernels attend_rows) to the keys its
    RowKeys name: prompt rows and generated rows take different kernels (the generated
    ones the fused decoder's arithmetic)."""

    def __init__(self, attend_rows, scale: float, sinks: torch.Tensor | None = None) -> None:
        self.attend_rows, self.scale = attend_rows, scale
        self.sinks = None if sinks is None else sinks.float().contiguous()  # [H]

    def attend(self, q: torch.Tensor, new_kv: torch.Tensor, kv_cache: torch.Tensor,
               group: AttentionGroup, sliding: bool) -> torch.Tensor:
        """q: [T, H, D] -> the group's [B * Tq, H * D] bf16 (its new k/v are in the cache)."""
        view = group.sliding if sliding and group.sliding is not None else group.full
        rows = slice(group.token_start, group.token_end)
        if rows.start > 0 or rows.stop < q.shape[0]:
            q = q[rows]
        keys = view.rows
        return self.attend_rows(q, kv_cache, keys.key_slots, keys.base, keys.position,
                                keys.lo, self.scale, keys.prompt, self.sinks)
