"""Self-attention over a paged KV cache.

The model runner describes one step with AttentionMetadata: the KV slot of every new token,
and groups of tokens that attend together (a batch of decodes padded to the longest context,
or one request's prefill chunk). Each layer writes its new k/v into the cache slots, then
each group attends as its backend does (Backend.attention): torch gathers, slices or reads from
the row buffer the group's keys and values and runs scaled_dot_product_attention with the group's mask
(backends/paged_attention.py); the compiled kernels attend each row on its own (RowKeys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shoal.engine.kv.quant import stored
from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.norm import RMSNorm
from shoal.engine.models.layers.rotary import apply_rotary, apply_rotary_


@dataclass
class RowKeys:
    """Each row's own keys, for the compiled row attention (kernels attend_rows): row r is
    position position[r] of a request whose key slots are key_slots[base[r] ..], and it
    attends to positions [lo[r], position[r]] in order. Prompt rows and generated rows
    take different kernels (the generated ones the fused decoder's arithmetic)."""

    key_slots: torch.Tensor  # [N] int64: each member's slots for positions 0 .., concatenated
    base: torch.Tensor       # [rows] int64
    position: torch.Tensor   # [rows] int64
    lo: torch.Tensor         # [rows] int64
    prompt: bool


@dataclass
class AttentionView:
    """Which keys one group attends to.

    gather: [B * L] KV slots to read, row-major [B, L] (padding repeats a real slot and is
    masked), or None to use the group's own new k/v (a prefill chunk starting at position 0).
    span: (first, end) when those slots are one consecutive run (one request whose blocks
    are consecutive): the cache is sliced, a view, instead of gathered.
    mask: [B, 1, Tq, L] additive (0 = attend, -inf = masked) in the attention dtype, built
    once per step so no layer converts it; None when every key is visible (or is_causal).
    """

    gather: torch.Tensor | None
    mask: torch.Tensor | None
    is_causal: bool = False
    span: tuple[int, int] | None = None
    # (first, row_len, lo, end): a decode group read from the row buffer (kv/row_buffer.py),
    # row b's keys at positions [lo, end) being slots first + b * row_len + [lo, end).
    buffered: tuple[int, int, int, int] | None = None
    # Set when each row attends on its own through the compiled kernel (the others unused).
    rows: RowKeys | None = None


@dataclass
class RowBufferWrite:
    """What a decode group writes into its row buffer rows before attending (each layer).

    append: [B] the row buffer slot of each member's new token. Otherwise rebuild: [B * row_len]
    cache slots copied, row-major, into row buffer slots first, first + 1, ...
    """

    first: int
    append: torch.Tensor | None = None
    rebuild: torch.Tensor | None = None


@dataclass
class AttentionGroup:
    """Rows token_start .. token_start + batch * query_len - 1 of the flat token batch."""

    token_start: int
    batch: int
    query_len: int
    full: AttentionView
    sliding: AttentionView | None = None
    row_buffer_write: RowBufferWrite | None = None

    @property
    def token_end(self) -> int:
        return self.token_start + self.batch * self.query_len


@dataclass(frozen=True)
class DecodeRows:
    """A step of B single-token decodes run by the compiled kernel (backends/fused_decode.py), and
    how it reads the paged KV cache.

    tables: [B, W] int64 block ids of each row (padded with 0 past its blocks);
    context_lens: [B] int64 keys each row attends to, its new token included;
    chained: some rows are consecutive positions of one request (guesses to verify), each
    reading the keys the rows before it write in the same step.
    """

    tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    chained: bool = False


@dataclass
class AttentionMetadata:
    """One forward step's attention inputs, shared by every layer."""

    positions: torch.Tensor     # [T] position of each new token
    slot_mapping: torch.Tensor  # [T] KV slot each new token writes
    groups: list[AttentionGroup]
    logits_indices: torch.Tensor  # [S] rows whose logits are sampled
    # Set when the step runs on the compiled decode kernel (groups is then empty).
    decode: DecodeRows | None = None
    # Rows from this one on are prompt tokens (None: none are); the earlier rows are
    # generated tokens. Linear layers give each kind its own arithmetic (kernels/quant.h).
    prompt_from: int | None = None
    logits_prompt_from: int | None = None  # the same for the rows of logits_indices


def prompt_from_of(meta: AttentionMetadata, keep: torch.Tensor | None) -> int | None:
    """The first prompt row among the rows a layer computes: all of the step's, or where a
    model's last layer keeps only the rows whose logits are sampled (keep is
    meta.logits_indices), among those."""
    return meta.prompt_from if keep is None else meta.logits_prompt_from


# attend(q [T, H, D], new_kv [T, 2 H_kv, W], kv_cache [2 H_kv, slots, W], group, sliding)
# -> [group's rows, H * D]: one group's attention output, reading its keys as the group's
# view says (its sliding view on a sliding layer, where it has one).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionGroup, bool],
                  torch.Tensor]


class SelfAttention(Layer):
    """Fused qkv projection, optional q/k RMSNorm, RoPE, paged attention, output projection.

    The KV cache of a layer is one tensor [2 * H_kv, slots, W]: key heads, then value heads
    (W = D, or for int8 D values and their scales, kv/quant.py).
    """

    def __init__(self, qkv: nn.Module, o: nn.Module, num_heads: int, num_kv_heads: int,
                 head_dim: int, sliding: bool, attend: Attend,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                 attention_dtype: torch.dtype | None = None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        # RoPE turns each head's first rotary_dim dimensions (GLM: half), the rest pass.
        self.rotary_dim = rotary_dim or head_dim
        self.attend = attend  # the backend's, for this layer's heads (Backend.attention)
        self.attention_dtype = attention_dtype  # None: attend in the compute dtype
        self.qkv, self.o = qkv, o
        self.q_norm, self.k_norm = q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding = sliding

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], or [len(keep), hidden]: every row's keys and values
        go to the cache, the output projection runs on the kept rows only."""
        # x: [T, hidden] -> qkv: [T, (H + 2 H_kv) * D]
        tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x, meta.prompt_from).view(tokens, heads + 2 * kv_heads, dim)
        if self.attention_dtype is not None:
            # One cast of the few new rows; the cache, RoPE and attention all use this dtype.
            qkv = qkv.to(self.attention_dtype)
        if self.q_norm is not None:
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # [T, H|H_kv, D]
            q = self._rotate(self.q_norm(q), rope)
            new_kv = torch.cat((self._rotate(self.k_norm(k), rope), v), dim=1)
        else:
            # Rotate q and k heads in place, so k sits beside v: new_kv is a view.
            apply_rotary_(qkv[:, :heads + kv_heads, :self.rotary_dim], *rope)
            q, new_kv = qkv[:, :heads], qkv[:, heads:]  # [T, H, D], [T, 2 H_kv, D]
        # Attend to the keys and values as the cache holds them (rounded or quantized),
        # whether they come from this chunk or from the cache: a token's result then does
        # not depend on how its prompt was split or cached. new_kv: [T, 2 H_kv, W]
        new_kv = stored(new_kv, kv_cache.dtype)
        kv_cache.index_copy_(1, meta.slot_mapping, new_kv.transpose(0, 1))
        outputs = [self.attend(q, new_kv, kv_cache, group, self.sliding)
                   for group in meta.groups]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        if keep is not None:
            out = out[keep]
        return self.o(out.to(x.dtype), prompt_from_of(meta, keep))

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, *rope)
        turned, passed = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((apply_rotary(turned, *rope), passed), dim=-1)
