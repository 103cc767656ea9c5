"""One decoder skeleton for llama / mistral / qwen2 (qkv bias) / qwen3 (q/k norm), and
their mixture-of-experts kin (mixtral, qwen2moe, qwen3moe, glm4moe, gpt-oss: the MLP routed
to experts, GLM-4.5's after dense leading layers, with partial RoPE; gpt-oss adds an output
bias, attention sinks, sliding-window layers and YaRN RoPE, each read from its tensors or
config).

A model instance holds a half-open layer range [start, end) with original layer indices;
the first stage embeds token ids, the last stage owns the final norm and output head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.layers.attention import (
    AttentionMetadata,
    SelfAttention,
    prompt_from_of,
)
from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.embedding import Embedding
from shoal.engine.models.layers.head import build_head
from shoal.engine.models.layers.linear import WeightPlan, build_linear
from shoal.engine.models.layers.norm import RMSNorm
from shoal.engine.models.layers.rotary import RotaryTable
from shoal.engine.models.moe import check_not_tensor_split, make_experts
from shoal.engine.parallel.tensor import RowParallel, shard_attention, shard_mlp
from shoal.engine.weights.quant import RawTensor

if TYPE_CHECKING:
    from shoal.engine.backends.fused_decode import FusedDecoder

Weights = dict[str, RawTensor]
# [2 * H_kv, slots, D]: key heads then value heads; latent attention's [1, slots, D]
# (kv/tensors.py)
KVCache = torch.Tensor


def make_norm(raw: RawTensor, config: ModelConfig, plan: WeightPlan,
              dtype: torch.dtype | None = None) -> RMSNorm:
    weight = raw.dequantize().to(device=plan.device, dtype=dtype or plan.compute_dtype)
    return plan.backend.norm(weight, config.rms_eps)


def make_attention(config: ModelConfig, index: int, weights: Weights,
                   plan: WeightPlan) -> SelfAttention:
    prefix = f"layers.{index}."
    parts = [weights[prefix + p + ".weight"] for p in "qkv"]
    biases = [weights[prefix + p + ".bias"] for p in "qkv"] if config.qkv_bias else None
    o_raw = weights[prefix + "o.weight"]
    # gpt-oss: a bias on o too, and a learned logit per head that joins each softmax's
    # denominator (an "attention sink": the head may attend to nothing).
    o_bias, sinks_raw = weights.get(prefix + "o.bias"), weights.get(prefix + "sinks.weight")
    num_heads, num_kv_heads = config.num_heads, config.num_kv_heads
    if plan.shard is not None:  # this rank's heads only; o sums over the ranks
        if o_bias is not None or sinks_raw is not None:
            raise UnsupportedModel("attention with an output bias or sinks cannot be split "
                                   "by tensor parallelism yet: split the model by layers")
        parts, biases, o_raw, heads = shard_attention(config, plan.shard, parts, biases, o_raw)
        num_heads, num_kv_heads = heads.num_heads, heads.num_kv_heads
    sinks = None if sinks_raw is None else sinks_raw.dequantize().to(plan.device)  # [H] f32
    q_norm = k_norm = None
    if config.qk_norm:  # applied to q / k in the attention dtype
        dtype = plan.backend.attention_dtype
        q_norm = make_norm(weights[prefix + "q_norm.weight"], config, plan, dtype)
        k_norm = make_norm(weights[prefix + "k_norm.weight"], config, plan, dtype)
    return SelfAttention(
        qkv=build_linear(parts, biases, plan),
        o=_row_parallel(build_linear([o_raw], None if o_bias is None else [o_bias], plan),
                        plan),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=config.head_dim,
        sliding=config.layer_type(index) == "sliding",
        attend=plan.backend.attention(num_heads, num_kv_heads, config.head_dim, config.scale,
                                      sinks),
        q_norm=q_norm, k_norm=k_norm, attention_dtype=_attention_cast(plan),
        rotary_dim=config.rotary_dim)


def _row_parallel(layer: nn.Module, plan: WeightPlan) -> nn.Module:
    if plan.shard is None:
        return layer
    if plan.reduce is None:
        raise ValueError("a tensor-parallel plan needs its ranks' all-reduce")
    return RowParallel(layer, plan.reduce)


def _attention_cast(plan: WeightPlan) -> torch.dtype | None:
    dtype = plan.backend.attention_dtype
    return None if dtype == plan.compute_dtype else dtype


def make_mlp(config: ModelConfig, index: int, weights: Weights, plan: WeightPlan) -> nn.Module:
    prefix = f"layers.{index}."
    gate, up, down = (weights[prefix + p + ".weight"] for p in ("gate", "up", "down"))
    if plan.shard is not None:  # this rank's MLP columns only; down sums over the ranks
        gate, up, down = shard_mlp(config, plan.shard, gate, up, down)
    gate_up = build_linear([gate, up], None, plan)
    down_layer = _row_parallel(build_linear([down], None, plan), plan)
    return plan.backend.gated_mlp(gate_up, down_layer, config.hidden_activation)


class LlamaBlock(Layer):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, index: int, weights: Weights, plan: WeightPlan):
        super().__init__()
        prefix = f"layers.{index}."
        self.attn_norm = make_norm(weights[prefix + "attn_norm.weight"], config, plan)
        self.attn = make_attention(config, index, weights, plan)
        self.mlp_norm = make_norm(weights[prefix + "mlp_norm.weight"], config, plan)
        self.mlp = (make_experts(config, index, weights, plan) if config.has_experts(index)
                    else make_mlp(config, index, weights, plan))

    def forward(self, h: torch.Tensor, rope, kv_cache: KVCache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden], or the rows `keep` selects (see LlamaModel)."""
        attended = self.attn(self.attn_norm(h), rope, kv_cache, meta, keep)
        h = (h if keep is None else h[keep]) + attended
        return h + self.mlp(self.mlp_norm(h), prompt_from_of(meta, keep))


class LlamaModel(Layer):
    """Layers [start, end) of a llama-family decoder.

    forward(inputs, meta, kv_caches): inputs are token ids [T] on the first stage and hidden
    states [T, hidden] otherwise; returns hidden states [T, hidden] (before the final norm).
    compute_logits(hidden) applies the final norm and head (last stage only).
    """

    block_class: type[nn.Module] = LlamaBlock
    # Whether the compiled decode kernel (kernels/decode.cpp) implements this family's block.
    fused_decode_family = True
    # Whether its attention is the backend's Backend.attention, which attends row by row
    # where the backend does (Backend.attends_rows); else always views of the keys.
    row_attention = True

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int], weights: Weights,
                 plan: WeightPlan, progress: Callable[[float], None] | None = None) -> None:
        super().__init__()
        check_not_tensor_split(config, plan)
        self.config, self.plan = config, plan
        self.start, self.end = layer_range
        file_bytes = _file_bytes(weights)  # this stage's tensors as the file stores them
        self.has_embedding = self.start == 0
        self.has_head = self.end == config.num_layers
        # The embedding's table is the head's when there is no lm_head of its own; a tied
        # Q8_0 table that the head will split is never packed (it would be dropped).
        tied = "lm_head.weight" not in weights
        split_by_head = (self.has_embedding and self.has_head and tied
                         and plan.backend.splits_table(weights["embed.weight"]))
        self.embedding = (Embedding(weights["embed.weight"], plan, self.embedding_scale(),
                                    split_by_head=split_by_head)
                          if self.has_embedding else None)
        blocks = []
        for i in range(self.start, self.end):
            blocks.append(self.block_class(config, i, weights, plan))
            if progress is not None:
                progress((i - self.start + 1) / (self.end - self.start))
        self.blocks = nn.ModuleList(blocks)
        self.norm = self.head = None
        if self.has_head:
            self.norm = make_norm(weights["norm.weight"], config, plan)
            head_raw = weights.get("lm_head.weight") or weights["embed.weight"]
            head_bytes = 0 if tied else _file_bytes({"head": head_raw})
            spare = int(MEMORY_FACTOR * file_bytes) - _held_bytes(self) - head_bytes
            self.head = build_head(head_raw, plan, self.embedding if tied else None, spare)
        self.rotary = RotaryTable(config.rotary_dim or config.head_dim, config.rope_theta,
                                  config.max_position, config.rope_scaling_factor,
                                  config.rope_yarn)
        # q and k are rotated in the attention dtype (float32 on CPU).
        self.attention_dtype = plan.backend.attention_dtype
        # Whether decode steps may run as one compiled call (off: always the Python path).
        self.fused_decode_allowed = plan.backend.fuses_decode(self)
        self._fused: FusedDecoder | None = None

    def fused_decoder(self) -> FusedDecoder | None:
        """The backend's fused decode step over this model's blocks (backends/fused_decode.py's
        FusedDecoder), or None where it does not apply. Asked once per step."""
        if not self.fused_decode_allowed:
            return None
        if self._fused is None:
            self._fused = self.plan.backend.fused_decoder(self)
        return self._fused

    def embedding_scale(self) -> float | None:
        return None

    def rope_for_layer(self, index: int, tables: dict[str, tuple]) -> tuple:
        return tables["global"]

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple]:
        return {"global": self.rotary.lookup(positions, self.attention_dtype)}

    def forward(self, inputs: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        h = self.embedding(inputs) if self.has_embedding else inputs.to(self.plan.compute_dtype)
        tables = self.rope_tables(meta.positions)
        if meta.decode is not None:
            return self._fused(h, kv_caches, tables, meta.slot_mapping, meta.decode)
        last = len(self.blocks) - 1
        for offset, block in enumerate(self.blocks):
            rope = self.rope_for_layer(self.start + offset, tables)
            keep = self._rows_to_sample(meta, h.shape[0]) if offset == last else None
            h = block(h, rope, kv_caches[offset], meta, keep)
        return h

    def _rows_to_sample(self, meta: AttentionMetadata, rows: int) -> torch.Tensor | None:
        """Past the last layer's attention only the rows whose logits are sampled matter
        (every row's keys and values are cached by then): its output projection and MLP
        run on meta.logits_indices alone, and forward returns those rows, in that order.
        A 500-token prompt then skips ~1/L of its work. Each row's arithmetic does not
        depend on the rows beside it, so the kept rows' bits are the same."""
        if not self.has_head or meta.logits_indices.shape[0] == rows:
            return None
        return meta.logits_indices

    def compute_logits(self, hidden: torch.Tensor,
                       prompt_from: int | None = None) -> torch.Tensor:
        """hidden: [S, hidden] -> float32 logits [S, vocab]; rows from prompt_from on are
        prompt tokens' (see QuantLinear)."""
        logits = self.head(self.norm(hidden), prompt_from).float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def weight_bytes(self) -> int:
        """Bytes of the weights this model holds (a tied head shares the embedding's)."""
        return _held_bytes(self)


# A loaded model holds at most this many times its tensors' file bytes (packed weights are
# the file's bits in another layout; the head's estimate takes what is left of the margin).
MEMORY_FACTOR = 1.2


def _file_bytes(weights: Weights) -> int:
    return sum(raw.data.nbytes if hasattr(raw.data, "nbytes") else 0
               for raw in weights.values())


def _held_bytes(module: nn.Module) -> int:
    """Sum of nbytes() over the modules that hold tensors, each counted once: a module that
    reports its bytes covers its children."""
    if hasattr(module, "nbytes"):
        return module.nbytes()
    if isinstance(module, RMSNorm):
        return module.weight.numel() * module.weight.element_size()
    return sum(_held_bytes(child) for child in module.children())
