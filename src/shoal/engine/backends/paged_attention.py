"""Paged attention with torch's scaled_dot_product_attention (TorchBackend's).

A group reads its keys and values one of four ways, as the model runner's AttentionView
says: its rows in the row buffer (decodes, kv/row_buffer.py), a slice of the cache (one
request whose blocks are consecutive), a gather from the cache, or its own new k/v (a
prefill chunk starting at position 0). A bf16 or int8 cache is widened to the attention dtype as it is read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.engine.kv.quant import widened
from shoal.engine.models.layers.attention import AttentionGroup, RowBufferWrite


class TorchPagedAttention:
    """One layer's heads; attend is the layer's Attend (layers/attention.py). sinks: [H]
    float32 logits that join each head's softmax denominator (gpt-oss), or None.

    latent_values: latent attention's single cache row per token (kv/tensors.py), read
    by one KV head as its key and, in its first latent_values elements, as its value; the
    output is then [rows, H * latent_values]. None: a key and a value row per KV head.
    exact_rows (latent attention): each decode of a batch attends to its own keys alone,
    unpadded, so its bits are those it has decoding alone (torch's attention over masked
    padding sums in another order).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sinks: torch.Tensor | None = None, latent_values: int | None = None,
                 exact_rows: bool = False) -> None:
        if latent_values is not None and (num_kv_heads != 1 or sinks is not None):
            raise ValueError("latent attention reads one KV head and has no sinks")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sinks = sinks
        self.latent_values, self.exact_rows = latent_values, exact_rows
        self.cache_rows = 1 if latent_values is not None else 2 * num_kv_heads
        self.value_dim = head_dim if latent_values is None else latent_values

    def attend(self, q: torch.Tensor, new_kv: torch.Tensor, kv_cache: torch.Tensor,
               group: AttentionGroup, sliding: bool) -> torch.Tensor:
        view = group.sliding if sliding and group.sliding is not None else group.full
        batch, query_len = group.batch, group.query_len
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        cache_rows = self.cache_rows
        width = kv_cache.shape[-1]  # a cache row: D elements, or int8 values and scales
        rows = slice(group.token_start, group.token_end)
        if rows.start > 0 or rows.stop < q.shape[0]:
            q = q[rows]
        # q: [B, H, Tq, D]; for decodes (Tq = 1) a view of [B, H, D] without a transpose
        q = q.unsqueeze(2) if query_len == 1 else \
            q.view(batch, query_len, heads, dim).transpose(1, 2)
        # kv: [B, R, L, W] (R = 2 H_kv, or latent attention's 1): row-buffer rows, a slice of
        # the cache, a gather from it, or the group's own new k/v (the cache is
        # [R, slots, W], new_kv [T, R, W])
        if group.row_buffer_write is not None:
            _write_row_buffer(kv_cache, group.row_buffer_write, new_kv[rows])
        if view.buffered is not None:
            first, row_len, lo, end = view.buffered
            rows_kv = kv_cache[:, first:first + batch * row_len]
            kv = rows_kv.view(cache_rows, batch, row_len, width)[:, :, lo:end].transpose(0, 1)
        elif view.span is not None:
            kv = kv_cache[:, view.span[0]:view.span[1]].unsqueeze(0)
        elif view.gather is not None:
            kv = kv_cache.index_select(1, view.gather).view(cache_rows, batch, -1, width)
            kv = kv.transpose(0, 1)
        else:
            kv = new_kv[rows].view(batch, -1, cache_rows, width).transpose(1, 2)
        # A bf16 cache read for float32 attention, or the few int8 rows this group reads
        # dequantized: kv [B, R, L, D]
        kv = widened(kv, q.dtype, dim)
        if self.latent_values is not None:
            attend = _attend_latent_rows if self.exact_rows else _attend_latent
            out = attend(q, kv, self.latent_values, view.mask, view.is_causal, self.scale)
        elif self.sinks is not None:
            out = _attend_with_sinks(q, kv[:, :kv_heads], kv[:, kv_heads:], view.mask,
                                     view.is_causal, self.scale, self.sinks)
        else:
            out = F.scaled_dot_product_attention(
                q, kv[:, :kv_heads], kv[:, kv_heads:], attn_mask=view.mask,
                is_causal=view.is_causal, scale=self.scale, enable_gqa=True)
        # out: [B, H, Tq, Dv] -> [B * Tq, H * Dv] (for Tq = 1, H and Dv merge as they are)
        if query_len == 1:
            return out.reshape(batch, heads * self.value_dim)
        return out.transpose(1, 2).reshape(batch * query_len, heads * self.value_dim)


def _attend_latent(q: torch.Tensor, kv: torch.Tensor, values: int, mask: torch.Tensor | None,
                   is_causal: bool, scale: float) -> torch.Tensor:
    """Multi-query attention over latent rows: q [B, H, Tq, D], kv [B, 1, L, D] (keys all
    of a row, values its first `values` elements) -> [B, H, Tq, values]."""
    keys, vals = kv, kv[..., :values]
    if q.shape[2] == 1:
        # A decode's H queries share the one KV head: as H query rows of one head they
        # read the keys once, where enable_gqa would copy them for every head.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask,
                                             scale=scale)  # [B, 1, H, values]
        return out.transpose(1, 2)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=True)


def _attend_latent_rows(q: torch.Tensor, kv: torch.Tensor, values: int,
                        mask: torch.Tensor | None, is_causal: bool,
                        scale: float) -> torch.Tensor:
    """_attend_latent with each decode of a padded batch over its visible keys only (a
    decode's keys are a prefix of its row: the model runner pads after them)."""
    if q.shape[2] > 1 or mask is None or q.shape[0] == 1:
        return _attend_latent(q, kv, values, mask, is_causal, scale)
    visible = (mask[:, 0, 0] == 0).sum(dim=-1).tolist()  # [B] keys each row sees
    return torch.cat([_attend_latent(q[b:b + 1], kv[b:b + 1, :, :length], values, None,
                                     False, scale)
                      for b, length in enumerate(visible)])


def _write_row_buffer(kv_cache: torch.Tensor, write: RowBufferWrite, new_kv: torch.Tensor) -> None:
    """new_kv: [B, 2 H_kv, W], the group's new keys and values (already in paged slots)."""
    if write.append is not None:
        kv_cache.index_copy_(1, write.append, new_kv.transpose(0, 1))
        return
    rows = kv_cache.index_select(1, write.rebuild)  # [2 H_kv, B * row_len, D]
    kv_cache[:, write.first:write.first + rows.shape[1]].copy_(rows)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None, is_causal: bool, scale: float,
                       sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, the sink, with no value: the
    operations of transformers' eager gpt-oss attention, in its order (float32 results
    equal to it). q: [B, H, Tq, D], k / v: [B, H_kv, L, D], mask [B, 1, Tq, L] additive."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, H, Tq, L]
    if is_causal:
        query_len, length = scores.shape[-2:]
        hidden = torch.ones(query_len, length, dtype=torch.bool, device=q.device).triu(
            length - query_len + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # the sink's share is dropped
    return torch.matmul(probs.to(v.dtype), v)
