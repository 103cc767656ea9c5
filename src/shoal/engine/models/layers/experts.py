"""Mixture-of-experts feed-forward: a float32 router picks each row's top-k experts, and the
rows are grouped by expert, so a step reads each chosen expert's weights once however many
rows chose it (prompt rows too) and never reads an expert no row chose.

Each expert is a GatedMLP over the linear layers of layers/linear.py: packed in the file's
GGUF types with bf16 compute on CPU, dense float32 in the reference mode. A row's result is
the sum of its experts' outputs in ascending expert order whatever else shares its step.
A backend may hand the whole grouping to one compiled call (grouped: the compiled kernels'
GroupedExperts, kernels/quant_experts.h), which gives the same bits without Python between
experts.
"""

from __future__ import annotations

from collections.abc import Callable

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


class GroupedRouter(Layer):
    """The routing of GLM-4.5 and DeepSeek-V2/V3 in float32, as transformers computes it.

    scoring "sigmoid" (GLM-4.5, DeepSeek-V3): scores = sigmoid(logits); the choice ranks
    scores + score_bias (e_score_correction_bias: it steers the choice, never the weights),
    groups ranked by the sum of their two best; the weights are the chosen scores.
    scoring "softmax" (DeepSeek-V2): scores = softmax(logits); groups ranked by their best
    score, the experts of the other groups scored 0 (topk_method group_limited_greedy).
    With groups > 1 only each row's groups_used best groups of experts compete; normalize
    rescales the k weights to sum to 1, and every weight is multiplied by scale
    (routed_scaling_factor). weight: float32 [experts, hidden], score_bias float32
    [experts]; forward as Router's.
    """

    def __init__(self, weight: torch.Tensor, top_k: int, normalize: bool,
                 scoring: str, groups: int = 1, groups_used: int = 1,
                 score_bias: torch.Tensor | None = None, scale: float = 1.0) -> None:
        super().__init__()
        if scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"unknown expert scoring {scoring!r}")
        self.weight, self.score_bias = weight, score_bias
        self.top_k, self.normalize, self.scoring = top_k, normalize, scoring
        self.groups, self.groups_used, self.scale = groups, groups_used, scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # [T, experts]
        if self.scoring == "sigmoid":
            scores = logits.sigmoid()
            choice = scores if self.score_bias is None else scores + self.score_bias
            if self.groups > 1:
                best_two = self._by_group(choice).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
                choice = choice.masked_fill(~self._kept(best_two), float("-inf"))
            experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, experts)
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.groups > 1:
                best = self._by_group(scores).max(dim=-1).values  # [T, G]
                scores = scores.masked_fill(~self._kept(best), 0.0)
            weights, experts = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, experts

    def _by_group(self, scores: torch.Tensor) -> torch.Tensor:
        # [T, G, experts / G] (sizes spelled out: a step may route no rows)
        return scores.view(scores.shape[0], self.groups, scores.shape[1] // self.groups)

    def _kept(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, G] group scores -> [T, experts] bool: the expert's group is among the row's
        groups_used best."""
        best = torch.topk(group_scores, k=self.groups_used, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()  # [T, G]
        per_group = self.weight.shape[0] // self.groups
        return mask.repeat_interleave(per_group, dim=1)

    def nbytes(self) -> int:
        bias = 0 if self.score_bias is None else self.score_bias.numel() * 4
        return self.weight.numel() * self.weight.element_size() + bias


class SharedExpert(Layer):
    """An expert every row runs: scaled by sigmoid(gate . x) per row where it has a gate
    (qwen2moe), added as it is where not (GLM-4.5, DeepSeek).

    gate: float32 [1, hidden] or None. forward(x [T, hidden]) -> float32 [T, hidden].
    """

    def __init__(self, mlp: GatedMLP, gate: torch.Tensor | None = None) -> None:
        super().__init__()
        self.mlp = mlp
        self.gate = gate

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        out = self.mlp(x, prompt_from).float()
        if self.gate is None:
            return out
        return torch.sigmoid(F.linear(x.float(), self.gate)) * out  # [T, 1] * [T, hidden]

    def nbytes(self) -> int:
        gate = 0 if self.gate is None else self.gate.numel() * self.gate.element_size()
        return _mlp_bytes(self.mlp) + gate


class MixtureOfExperts(Layer):
    """forward(x [T, hidden], prompt_from) -> [T, hidden] in x's dtype; rows from
    prompt_from on are prompt tokens (see QuantLinear), and stay so within each expert's
    group (a group keeps the rows' order).

    experts may be a contiguous share [first_expert, first_expert + len(experts)) of the
    router's (an expert-parallel rank's, parallel/experts.py): choices of other experts are
    left to the ranks holding them, and routed() is this share's part of the sum.

    grouped: (x, weights [T, k], chosen [T, k], prompt_from) -> float32 [T, hidden], the
    routed experts' weighted sum computed as the loop below does (the backend's compiled
    form; chosen are indices into experts, any outside them skipped); None runs the loop.
    """

    def __init__(self, router: Router | GroupedRouter | LogitTopKRouter,
                 experts: list[GatedMLP] | list[ClampedSwiGLU],
                 shared: SharedExpert | None = None, first_expert: int = 0,
                 grouped: Callable | None = None) -> None:
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.shared = shared
        self.first_expert = first_expert
        self.grouped = grouped

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        out = self.routed(x, prompt_from)
        if self.shared is not None:
            out += self.shared(x, prompt_from)
        return out.to(x.dtype)

    def routed(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        """The held experts' weighted outputs summed per row: float32 [T, hidden]."""
        weights, chosen = self.router(x)  # [T, k] each
        if self.grouped is not None:
            return self.grouped(x, weights, chosen - self.first_expert,
                                x.shape[0] if prompt_from is None else prompt_from)
        return self._expert_loop(x, weights, chosen, prompt_from)

    def _expert_loop(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                     prompt_from: int | None) -> torch.Tensor:
        """float32 [T, hidden]: each chosen expert over its rows, in ascending expert order."""
        top_k = chosen.shape[1]
        held = len(self.experts)
        # [T * k]: row r's choices at r*k .. r*k + k-1, as indices into self.experts; another
        # rank's experts all go to one bucket past the end, never run here.
        flat = chosen.reshape(-1) - self.first_expert
        flat = torch.where((flat >= 0) & (flat < held), flat, held)
        # (row, choice) pairs grouped by expert; within a group rows stay in ascending order.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=held + 1)[:held].tolist()
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
        return out

    def nbytes(self) -> int:
        held = self.router.nbytes() + sum(_mlp_bytes(expert) for expert in self.experts)
        return held + (self.shared.nbytes() if self.shared is not None else 0)


def _mlp_bytes(mlp: GatedMLP | ClampedSwiGLU) -> int:
    return mlp.gate_up.nbytes() + mlp.down.nbytes()
