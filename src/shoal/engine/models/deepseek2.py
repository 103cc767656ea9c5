"""DeepSeek-V2 / V3 decoder: the llama block with multi-head latent attention in place of
self-attention (and the MoE feed-forward of models/moe.py after dense leading layers).

Latent attention, per token: q = q_b(norm(q_a(x))) (or q(x) without a q rank), and one
latent c = norm(kv_a(x)[:rank]) plus one rope key part kv_a(x)[rank:] shared by all heads;
kv_b(c) would give every head its key's nope part and its value. The KV cache holds only
[c | rotated rope key] (rank + rope elements per token and layer: 576 for V2-Lite and V3,
where the decompressed heads were 2 * H * (nope + rope) = 6,144 and 49,152), and attention
runs in the absorbed form, as llama.cpp's and vLLM's MLA do: head h's q_nope times its
key slice of kv_b (W_UK[h], [nope, rank]) lands in latent space, so
q_nope . (W_UK[h] c) = (q_nope W_UK[h]) . c, and the heads attend as one multi-query
attention with keys [c | rope key] and values c (the first rank elements of the same
cached row); each head's [rank] output then goes through its value slice W_UV[h]
([v, rank]) before o. Prompts attend the same way, so a row's result does not depend on
how its prompt was split or cached. The softmax scale stays the (nope + rope) heads' one.

The checkpoints store each rope part's dimensions as interleaved pairs (x0, x1), (x2, x3)
(llama.cpp rotates adjacent pairs); the loader reorders those weight rows to Hugging
Face's half-split layout (evens, then odds), which is what transformers' interleaved rope
outputs, so RoPE here is the skeleton's.
"""

from __future__ import annotations

import torch
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


class Absorbed(Layer):
    """kv_b split per head for the absorbed form, in the attention dtype:
    key_up [H, nope, rank] (W_UK) and value_up_t [H, rank, v] (W_UV transposed).

    exact_rows: generated rows are multiplied one at a time, so a row's bits do not depend
    on the rows beside it (torch's float32 bmm sums in another order for other row counts,
    which bf16 rounding after it can turn into a different token): where the backend's
    other layers promise that (Backend.attends_rows). Prompt rows go together.
    """

    def __init__(self, key_up: torch.Tensor, value_up_t: torch.Tensor,
                 exact_rows: bool = False) -> None:
        super().__init__()
        self.key_up, self.value_up_t, self.exact_rows = key_up, value_up_t, exact_rows

    def queries(self, q_nope: torch.Tensor, prompt_from: int | None) -> torch.Tensor:
        """[T, H, nope] -> [T, H, rank]: each head's query in latent space."""
        return self._per_head(q_nope, self.key_up, prompt_from)

    def values(self, out: torch.Tensor, prompt_from: int | None) -> torch.Tensor:
        """[rows, H, rank] attention outputs over latents -> [rows, H, v] head values."""
        return self._per_head(out, self.value_up_t, prompt_from)

    def _per_head(self, x: torch.Tensor, weight: torch.Tensor,
                  prompt_from: int | None) -> torch.Tensor:
        # x: [T, H, a], weight: [H, a, b] -> [T, H, b]
        alone = 0
        if self.exact_rows:
            alone = x.shape[0] if prompt_from is None else prompt_from
        parts = [torch.bmm(x[row:row + 1].transpose(0, 1), weight) for row in range(alone)]
        if alone < x.shape[0] or not parts:  # (a chunk may keep no rows)
            parts.append(torch.bmm(x[alone:].transpose(0, 1), weight))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [H, T, b]
        return out.transpose(0, 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.key_up, self.value_up_t))


class LatentSelfAttention(Layer):
    """x [T, hidden] -> [T, hidden] (or the kept rows): DeepSeek's multi-head latent
    attention in the absorbed form over a cache of latents (see the module docstring).

    x_proj: x -> [q_in | latent | rope key] in one matmul ([T, Q + rank + rope], Q the q
    rank or H * D); q_b None where q comes straight from x_proj. attend: the backend's
    latent_attention (q [T, H, rank + rope] -> [rows, H * rank]).
    """

    def __init__(self, x_proj: nn.Module, q_a_norm: RMSNorm | None, q_b: nn.Module | None,
                 kv_a_norm: RMSNorm, absorbed: Absorbed, o: nn.Module,
                 latent: LatentAttention, num_heads: int, attend: Attend,
                 attention_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.x_proj, self.q_a_norm, self.q_b = x_proj, q_a_norm, q_b
        self.kv_a_norm, self.absorbed, self.o = kv_a_norm, absorbed, o
        self.latent, self.num_heads = latent, num_heads
        self.attend, self.attention_dtype = attend, attention_dtype
        q_width = latent.q_lora_rank or num_heads * latent.qk_head_dim
        self.split = [q_width, latent.kv_lora_rank, latent.qk_rope_head_dim]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        tokens, heads, latent = x.shape[0], self.num_heads, self.latent
        nope, rank = latent.qk_nope_head_dim, latent.kv_lora_rank
        q, kv_latent, rope_key = self.x_proj(x, meta.prompt_from).split(self.split, dim=-1)
        if self.q_b is not None:
            q = self.q_b(self.q_a_norm(q.contiguous()), meta.prompt_from)
        kv_latent = self.kv_a_norm(kv_latent.contiguous())              # [T, rank]
        q = q.reshape(tokens, heads, latent.qk_head_dim)                 # [T, H, nope + rope]
        rope_key = rope_key.reshape(tokens, 1, latent.qk_rope_head_dim)  # [T, 1, rope]
        if self.attention_dtype is not None:
            q, kv_latent, rope_key = (t.to(self.attention_dtype)
                                      for t in (q, kv_latent, rope_key))
        apply_rotary_(q[..., nope:], *rope)
        row = torch.cat((kv_latent.unsqueeze(1), apply_rotary(rope_key, *rope)), dim=-1)
        new_kv = stored(row, kv_cache.dtype)                           # [T, 1, rank + rope]
        kv_cache.index_copy_(1, meta.slot_mapping, new_kv.transpose(0, 1))
        q = torch.cat((self.absorbed.queries(q[..., :nope], meta.prompt_from),
                       q[..., nope:]), dim=-1)
        outputs = [self.attend(q, new_kv, kv_cache, group, False) for group in meta.groups]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [rows, H * rank]
        if keep is not None:
            out = out[keep]
        rows = out.shape[0]  # (spelled out: a chunk may keep no rows)
        out = self.absorbed.values(out.view(rows, heads, rank),        # [rows, H, v]
                                   prompt_from_of(meta, keep))
        out = out.reshape(rows, heads * latent.v_head_dim)
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
        absorbed=_absorbed(_kv_b(weights, prefix, latent, heads), latent, heads, plan),
        o=build_linear([weights[prefix + "o.weight"]], None, plan),
        latent=latent, num_heads=heads,
        attend=plan.backend.latent_attention(heads, latent.cached_dim, latent.kv_lora_rank,
                                             config.scale),
        attention_dtype=(None if plan.backend.attention_dtype == plan.compute_dtype
                         else plan.backend.attention_dtype))


def _absorbed(kv_b: RawTensor, latent: LatentAttention, heads: int,
              plan: WeightPlan) -> Absorbed:
    """kv_b [H * (nope + v), rank] as each head's W_UK and W_UV, with the compute dtype's
    values (what kv_b as a linear layer would multiply by) held in the attention dtype."""
    nope, v_dim = latent.qk_nope_head_dim, latent.v_head_dim
    whole = plan.backend.dense(kv_b).to(plan.backend.attention_dtype)
    whole = whole.view(heads, nope + v_dim, latent.kv_lora_rank)
    return Absorbed(key_up=whole[:, :nope].contiguous(),
                    value_up_t=whole[:, nope:].transpose(1, 2).contiguous(),
                    exact_rows=plan.backend.attends_rows)


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
    row_attention = False  # its attention is torch's on every backend (latent_attention)

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        if config.latent_attention is None:
            raise UnsupportedModel("a DeepSeek model needs its latent attention's shape")
        super().__init__(config, *args, **kwargs)
