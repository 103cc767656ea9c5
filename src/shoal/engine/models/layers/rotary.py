"""Rotary position embeddings (Hugging Face half-split layout), tables precomputed once."""

from __future__ import annotations

import math

import torch
from torch import nn

from shoal.engine.models.config import YarnScaling


class RotaryTable(nn.Module):
    """cos / sin of position * inv_freq for positions 0 .. max_position - 1 (YaRN: both
    scaled by its attention factor, as transformers does).

    Computed in float32 exactly as transformers does, so fp32 logits match it bit for bit;
    rows are computed as positions reach them (in steps of GROW), not for the whole context
    at load: a 32k context's tables are tens of MB that short conversations never read.
    """

    GROW = 4096

    def __init__(self, head_dim: int, theta: float, max_position: int,
                 scaling_factor: float = 1.0, yarn: YarnScaling | None = None) -> None:
        super().__init__()
        # cos and sin are multiplied by attention_factor (YaRN's; 1.0 otherwise).
        self.attention_factor = 1.0
        if yarn is not None:
            self.inv_freq, self.attention_factor = yarn_frequencies(head_dim, theta, yarn)
        else:
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            self.inv_freq = 1.0 / (theta ** exponent) / scaling_factor  # [D/2]
        self.max_position = max_position
        self.cos = self.sin = torch.empty(0, head_dim // 2)
        self._extend(min(self.GROW, max_position))

    def _extend(self, size: int) -> None:
        # Each row depends only on its position: rows computed later equal rows computed now.
        positions = torch.arange(self.cos.shape[0], size, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [P, D/2]
        self.cos = torch.cat((self.cos, freqs.cos() * self.attention_factor))
        self.sin = torch.cat((self.sin, freqs.sin() * self.attention_factor))

    def lookup(self, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) shaped [T, 1, D] in dtype, ready to broadcast over heads.

        cos repeats over both halves; sin is negated on the first half so that
        apply_rotary needs one swap, two multiplies and an add. The model runner checks
        positions against max_position before the forward.
        """
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.cos.shape[0]:
            self._extend(min(self.max_position, -(-needed // self.GROW) * self.GROW))
        cos = self.cos[positions].to(dtype)  # [T, D/2]
        sin = self.sin[positions].to(dtype)
        return (torch.cat((cos, cos), dim=-1).unsqueeze(1),
                torch.cat((-sin, sin), dim=-1).unsqueeze(1))


def yarn_frequencies(head_dim: int, theta: float,
                     yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention factor) as transformers' _compute_yarn_parameters
    computes them, step for step (its float32 and float64 roundings included)."""
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn.magnitude(yarn.mscale) / yarn.magnitude(yarn.mscale_all_dim)
        else:
            attention_factor = yarn.magnitude()

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(yarn.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_share = 1 - ramp
    powers = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    inv_freq = (interpolated * (1 - extrapolation_share)
                + extrapolated * extrapolation_share)
    return inv_freq, float(attention_factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated in HF's half-split layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """apply_rotary written back into x (which may be a strided view, e.g. of a qkv output).

    Both operands are computed before the write, so writing over x is safe; it saves the
    separate copy a caller would need to put the rotated heads back beside v.
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)
    torch.addcmul(x * cos, swapped, signed_sin, out=x)
