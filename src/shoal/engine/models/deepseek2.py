"""DeepSeek-V2 / V3 decoder: the llama block with multi-head latent attention in place of
self-attention (and the MoE feed-forward of models/moe.py after dense leading layers).

Latent attention, per token: q = q_b(norm(q_a(x))) (or q(x) without a q rank), and one
latent c = norm(kv_a(x)[:rank]) plus one rope key part kv_a(x)[rank:] shared by all heads;
kv_b(c) gives every head its key's nope part and its value. The KV cache holds the
decompressed heads ([2 * H, slots, D], D = nope + rope): keys [nope | rope], values padded
from v_head_dim to D, so the paged attention and its backends serve it unchanged. That
costs 2 * H * D elements per token and layer where the latent is rank + rope (DeepSeek-V3:
2 * 128 * 192 = 49,152 against 576, 85x; V2-Lite: 6,144 against 576, 11x).

The checkpoints store each rope part's dimensions as interleaved pairs (x0, x1), (x2, x3)
(llama.cpp rotates adjacent pairs); the loader reorders those weight rows to Hugging
Face's half-split layout (evens, then odds), which is what transformers' interleaved rope
outputs, so RoPE here is the skeleton's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.errors import UnsupportedModel
from shoal.engine.kv.quant import stored
from shoal.engine.models.config import LatentAttention, ModelConfig
from shoal.engine.models.layers.attention import (
    Attend,
    AttentionMetadata,
    prompt_from_of,
)
from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.linear import WeightPlan, build_linear
from shoal.engine.models.layers.norm import RMSNorm
from shoal.engine.models.layers.rotary import apply_rotary, apply_rotary_
from shoal.engine.models.llama import (
    KVCache,
    LlamaBlock,
    LlamaModel,
    Weights,
    make_mlp,
    make_norm,
)
from shoal.engine.models.moe import make_experts
from shoal.engine.weights.quant import RawTensor

# transformers' (and DeepSeek's) q_a and kv_a norms keep RMSNorm's default epsilon.
LATENT_NORM_EPS = 1e-6


class LatentSelfAttention(Layer):
    """x [T, hidden] -> [T, hidden] (or the kept rows): DeepSeek's multi-head latent
    attention over the paged cache of decompressed heads (see the module docstring).

    x_proj: x -> [q_in | latent | rope key] in one matmul ([T, Q + rank + rope], Q the q
    rank or H * D); q_b None where q comes straight from x_proj.
    """

    def __init__(self, x_proj: nn.Module, q_a_norm: RMSNorm | None, q_b: nn.Module | None,
                 kv_a_norm: RMSNorm, kv_b: nn.Module, o: nn.Module, latent: LatentAttention,
                 num_heads: int, attend: Attend,
                 attention_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.x_proj, self.q_a_norm, self.q_b = x_proj, q_a_norm, q_b
        self.kv_a_norm, self.kv_b, self.o = kv_a_norm, kv_b, o
        self.latent, self.num_heads = latent, num_heads
        self.attend, self.attention_dtype = attend, attention_dtype
        q_width = latent.q_lora_rank or num_heads * latent.qk_head_dim
        self.split = [q_width, latent.kv_lora_rank, latent.qk_rope_head_dim]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        tokens, heads, latent = x.shape[0], self.num_heads, self.latent
        nope, dim, v_dim = latent.qk_nope_head_dim, latent.qk_head_dim, latent.v_head_dim
        q, kv_latent, rope_key = self.x_proj(x, meta.prompt_from).split(self.split, dim=-1)
        if self.q_b is not None:
            q = self.q_b(self.q_a_norm(q.contiguous()), meta.prompt_from)
        kv = self.kv_b(self.kv_a_norm(kv_latent.contiguous()), meta.prompt_from)
        q = q.reshape(tokens, heads, dim)                                # [T, H, nope + rope]
        kv = kv.view(tokens, heads, nope + v_dim)                        # [T, H, nope + v]
        rope_key = rope_key.reshape(tokens, 1, latent.qk_rope_head_dim)  # [T, 1, rope]
        if self.attention_dtype is not None:
            q, kv, rope_key = (t.to(self.attention_dtype) for t in (q, kv, rope_key))
        apply_rotary_(q[..., nope:], *rope)
        rope_key = apply_rotary(rope_key, *rope).expand(tokens, heads, -1)
        keys = torch.cat((kv[..., :nope], rope_key), dim=-1)             # [T, H, D]
        values = F.pad(kv[..., nope:], (0, dim - v_dim))                 # [T, H, D]
        new_kv = stored(torch.cat((keys, values), dim=1), kv_cache.dtype)  # [T, 2 H, D]
        kv_cache.index_copy_(1, meta.slot_mapping, new_kv.transpose(0, 1))
        outputs = [self.attend(q, new_kv, kv_cache, group, False) for group in meta.groups]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [rows, H * D]
        if keep is not None:
            out = out[keep]
        rows = out.shape[0]  # (spelled out: a chunk may keep no rows)
        out = out.view(rows, heads, dim)[..., :v_dim].reshape(rows, heads * v_dim)
        return self.o(out.to(x.dtype), prompt_from_of(meta, keep))


def make_latent_attention(config: ModelConfig, index: int, weights: Weights,
                          plan: WeightPlan) -> LatentSelfAttention:
    if plan.shard is not None:
        raise UnsupportedModel("latent attention cannot be split by tensor parallelism yet: "
                               "split the model by layers (pipeline)")
    latent, heads = config.latent_attention, config.num_heads
    prefix = f"layers.{index}."
    nope, dim = latent.qk_nope_head_dim, latent.qk_head_dim
    kv_a = _rope_rows_half_split(weights[prefix + "kv_a.weight"],
                                 latent.kv_lora_rank + latent.qk_rope_head_dim,
                                 latent.kv_lora_rank)
    q_b = q_a_norm = None
    if latent.q_lora_rank:
        q_in = weights[prefix + "q_a.weight"]
        q_a_norm = _latent_norm(weights[prefix + "q_a_norm.weight"], plan)
        q_b = build_linear([_rope_rows_half_split(weights[prefix + "q_b.weight"], dim, nope)],
                           None, plan)
    else:
        q_in = _rope_rows_half_split(weights[prefix + "q.weight"], dim, nope)
    return LatentSelfAttention(
        x_proj=build_linear([q_in, kv_a], None, plan), q_a_norm=q_a_norm, q_b=q_b,
        kv_a_norm=_latent_norm(weights[prefix + "kv_a_norm.weight"], plan),
        kv_b=build_linear([_kv_b(weights, prefix, latent, heads)], None, plan),
        o=build_linear([weights[prefix + "o.weight"]], None, plan),
        latent=latent, num_heads=heads,
        attend=plan.backend.attention(heads, heads, dim, config.scale),
        attention_dtype=(None if plan.backend.attention_dtype == plan.compute_dtype
                         else plan.backend.attention_dtype))


def _latent_norm(raw: RawTensor, plan: WeightPlan) -> RMSNorm:
    weight = raw.dequantize().to(device=plan.device, dtype=plan.compute_dtype)
    return plan.backend.norm(weight, LATENT_NORM_EPS)


def _rope_rows_half_split(raw: RawTensor, block: int, nope: int) -> RawTensor:
    """Rows of each `block` (a head: nope then rope rows; kv_a: the latent then the rope
    key) with the rope rows' interleaved pairs reordered evens first, then odds."""
    rope = torch.arange(nope, block)
    within = torch.cat((torch.arange(nope), rope[0::2], rope[1::2]))
    blocks = raw.shape[0] // block
    order = (torch.arange(blocks)[:, None] * block + within[None, :]).reshape(-1)
    return raw.rows(order)


def _kv_b(weights: Weights, prefix: str, latent: LatentAttention, heads: int) -> RawTensor:
    """kv_b [H * (nope + v), rank]; newer GGUF files split it into k_b [H, rank, nope]
    (stored transposed, for llama.cpp's absorbed attention) and v_b [H, v, rank]."""
    whole = weights.get(prefix + "kv_b.weight")
    if whole is not None:
        return whole
    k_b = weights[prefix + "k_b.weight"].dequantize().transpose(1, 2)  # [H, nope, rank]
    v_b = weights[prefix + "v_b.weight"].dequantize()                  # [H, v, rank]
    joined = torch.cat((k_b, v_b), dim=1).reshape(-1, latent.kv_lora_rank)
    return RawTensor(tuple(joined.shape), "dense", joined.contiguous())


class DeepseekBlock(LlamaBlock):
    """Pre-norm block with latent attention; forward is the llama block's."""

    def __init__(self, config: ModelConfig, index: int, weights: Weights, plan: WeightPlan):
        Layer.__init__(self)
        prefix = f"layers.{index}."
        self.attn_norm = make_norm(weights[prefix + "attn_norm.weight"], config, plan)
        self.attn = make_latent_attention(config, index, weights, plan)
        self.mlp_norm = make_norm(weights[prefix + "mlp_norm.weight"], config, plan)
        self.mlp = (make_experts(config, index, weights, plan) if config.has_experts(index)
                    else make_mlp(config, index, weights, plan))


class DeepseekModel(LlamaModel):
    block_class = DeepseekBlock
    fused_decode_family = False  # the compiled decode kernel has no latent attention

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        if config.latent_attention is None:
            raise UnsupportedModel("a DeepSeek model needs its latent attention's shape")
        super().__init__(config, *args, **kwargs)
