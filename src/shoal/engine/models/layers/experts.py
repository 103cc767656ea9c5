"""Mixture-of-experts feed-forward: a float32 router picks each row's top-k experts, and the
rows are grouped by expert, so a step reads each chosen expert's weights once however many
rows chose it (prompt rows too) and never reads an expert no row chose.

Each expert is a GatedMLP over the linear layers of layers/linear.py: packed in the file's
GGUF types with bf16 compute on CPU, dense float32 in the reference mode. A row's result is
the sum of its experts' outputs in ascending expert order whatever else shares its step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.mlp import GatedMLP


class Router(Layer):
    """Top-k softmax routing in float32 (bf16 rounding of the logits must not flip a choice).

    weight: float32 [experts, hidden]. forward(x [T, hidden]) -> (weights [T, k] float32,
    experts [T, k] int64); normalize rescales each row's k weights to sum to 1.
    """

    def __init__(self, weight: torch.Tensor, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = weight
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x.float(), self.weight), dim=-1)  # [T, experts]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class LogitTopKRouter(Layer):
    """gpt-oss's routing, in float32: the top k of the router's logits (bias included), then
    a softmax over those k alone (transformers' GptOssTopKRouter).

    weight: float32 [experts, hidden], bias: float32 [experts]. forward(x [T, hidden]) ->
    (weights [T, k] float32, experts [T, k] int64), as Router's.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight, self.bias)  # [T, experts]
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts

    def nbytes(self) -> int:
        return (self.weight.numel() + self.bias.numel()) * self.weight.element_size()


class ClampedSwiGLU(Layer):
    """gpt-oss's expert: down((up + 1) * gate * sigmoid(alpha * gate)) with gate clamped to
    at most limit and up to [-limit, limit]; both projections carry biases (in the linears).
    The activation runs in float32 and rounds once to x's dtype.

    gate_up: [T, hidden] -> [T, 2 * size] (gate, then up); down: [T, size] -> [T, hidden].
    """

    def __init__(self, gate_up: nn.Module, down: nn.Module, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        gate_up = self.gate_up(x, prompt_from)
        gate, up = gate_up.float().chunk(2, dim=-1)  # each [T, size]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.down(((up + 1) * glu).to(x.dtype), prompt_from)


class SharedExpert(Layer):
    """An expert every row runs (qwen2moe), scaled by sigmoid(gate . x) per row.

    gate: float32 [1, hidden]. forward(x [T, hidden]) -> float32 [T, hidden].
    """

    def __init__(self, mlp: GatedMLP, gate: torch.Tensor) -> None:
        super().__init__()
        self.mlp = mlp
        self.gate = gate

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        scale = torch.sigmoid(F.linear(x.float(), self.gate))  # [T, 1]
        return scale * self.mlp(x, prompt_from).float()

    def nbytes(self) -> int:
        return _mlp_bytes(self.mlp) + self.gate.numel() * self.gate.element_size()


class MixtureOfExperts(Layer):
    """forward(x [T, hidden], prompt_from) -> [T, hidden] in x's dtype; rows from
    prompt_from on are prompt tokens (see QuantLinear), and stay so within each expert's
    group (a group keeps the rows' order)."""

    def __init__(self, router: Router | LogitTopKRouter,
                 experts: list[GatedMLP] | list[ClampedSwiGLU],
                 shared: SharedExpert | None = None) -> None:
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.shared = shared

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        weights, chosen = self.router(x)  # [T, k] each
        top_k = chosen.shape[1]
        flat = chosen.reshape(-1)  # [T * k]: row r's choices at r*k .. r*k + k-1
        # (row, choice) pairs grouped by expert; within a group rows stay in ascending order.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        flat_weights = weights.reshape(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, hidden]
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            rows = pairs // top_k
            local_prompt_from = (None if prompt_from is None
                                 else int(torch.searchsorted(rows, prompt_from)))
            y = self.experts[expert](x[rows], local_prompt_from)  # [count, hidden]
            out.index_add_(0, rows, y.float() * flat_weights[pairs, None])
        if self.shared is not None:
            out += self.shared(x, prompt_from)
        return out.to(x.dtype)

    def nbytes(self) -> int:
        held = self.router.nbytes() + sum(_mlp_bytes(expert) for expert in self.experts)
        return held + (self.shared.nbytes() if self.shared is not None else 0)


def _mlp_bytes(mlp: GatedMLP | ClampedSwiGLU) -> int:
    return mlp.gate_up.nbytes() + mlp.down.nbytes()
