"""Gated MLP: down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.models.layers.base import Layer


class GatedMLP(Layer):
    """gated(gate_up, gelu): the backend's one pass over gate/up that replaces split,
    activation and product (the compiled kernels' gated, bf16); None computes them with
    torch ops."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, activation: str,
                 gated: Callable | None = None) -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {activation!r}")
        self.gate_up, self.down = gate_up, down
        self.gelu = activation == "gelu_tanh"
        self.gated = gated

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        gate_up = self.gate_up(x, prompt_from)  # [T, 2 * intermediate]: gate, then up
        if self.gated is not None:
            return self.down(self.gated(gate_up, self.gelu), prompt_from)
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, intermediate]
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(act * up, prompt_from)
