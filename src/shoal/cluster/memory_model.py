"""What a rank of an instance holds once loaded, as placement counts it before it loads.

Before a model's first load: an estimate from its file headers (PlacementPolicy: weights at
about their file size, a runtime floor, tokenizer tables, the first KV grant), tried when
at most ESTIMATE_TOLERANCE over the room; afterwards what a whole copy held when measured
(ModelFacts.measured_bytes). placement.py chooses nodes with these figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.cluster.instances import Rank
from shoal.cluster.model_facts import ModelFacts
from shoal.engine.kv_budget import KV_GRANT_STEP_TOKENS

# Weights as a runner holds them, per byte of their files (packed GGUF stays near its size).
ESTIMATE_OVERHEAD_FACTOR = 1.05
# How far the estimate for a model never measured may exceed the room and still be tried:
# the estimate is within this of what the model then holds, and the runner's own pre-load
# guard (engine/kv_budget.check_weights_fit) decides.
ESTIMATE_TOLERANCE = 0.15


@dataclass(frozen=True)
class PlacementPolicy:
    """The estimate of what a rank holds once loaded, before it has measured itself.

    Fitted to runners of the catalogue's models after loading (private resident memory plus
    the first KV grant; within 5% for each: all-MiniLM 0.96, SmolLM2 0.97, Gemma 3 270M
    1.00, Qwen2.5-Coder-0.5B 1.03 of what each held): weights held at about their file size (packed GGUF
    blocks; a few tensors dequantized), a runtime floor, a generating model's sampler and
    grammar machinery, its tokenizer's tables per vocabulary entry, and its first KV grant.
    """

    overhead_factor: float = ESTIMATE_OVERHEAD_FACTOR
    kv_reservation_tokens: int = KV_GRANT_STEP_TOKENS
    kv_element_bytes: int = 2  # bf16 / fp16 cache
    # Bytes each KV row (a token's key or value of one head) holds beside its elements per
    # 16 channels: an int8 cache's bf16 scales.
    kv_scale_bytes: int = 0
    # A runner process (interpreter, torch's heap, buffers) before any weights; torch's
    # libraries' pages are shared and not counted (runner/memory.private_resident_bytes).
    floor_bytes: int = 72 * 2**20
    # What a generating runner adds (scheduler, sampler, grammar compiler, row buffers).
    generation_floor_bytes: int = 64 * 2**20
    # Tokenizer tables (the tokenizer's own, the grammar's) per vocabulary entry.
    vocab_entry_bytes: int = 448

    def __post_init__(self) -> None:
        if self.overhead_factor < 1.0:
            raise ValueError("overhead_factor must be >= 1.0")
        if (self.kv_reservation_tokens < 0 or self.kv_element_bytes < 1 or self.floor_bytes < 0
                or self.generation_floor_bytes < 0 or self.vocab_entry_bytes < 0):
            raise ValueError("KV reservation and floors must not be negative")
        if self.kv_scale_bytes < 0:
            raise ValueError("kv_scale_bytes must not be negative")

    @classmethod
    def for_kv_cache_dtype(cls, kv_cache_dtype: str) -> PlacementPolicy:
        """The policy whose KV reservation counts a node's --kv-cache-dtype (auto: bf16)."""
        element, scale = {"auto": (2, 0), "bfloat16": (2, 0), "float32": (4, 0),
                          "int8": (1, 2)}[kv_cache_dtype]
        return cls(kv_element_bytes=element, kv_scale_bytes=scale)


DEFAULT_POLICY = PlacementPolicy()


def rank_needed_bytes(facts: ModelFacts, rank: Rank,
                      policy: PlacementPolicy = DEFAULT_POLICY) -> int:
    """Memory placement counts for one rank of an instance."""
    experts = rank.experts
    return shard_bytes(facts, rank.layer_end - rank.layer_start, rank.tp_size, policy,
                       experts_held=None if experts is None else experts[1] - experts[0])


def bytes_to_find(facts: ModelFacts, needed: int, whole: bool) -> int:
    """The room a rank that counts `needed` bytes must find: all of it for a whole copy of
    a model whose size was measured, else its estimate less ESTIMATE_TOLERANCE."""
    if whole and facts.measured_bytes is not None:
        return needed
    return math.ceil(needed / (1 + ESTIMATE_TOLERANCE))


def shard_bytes(facts: ModelFacts, layers: int, tp_size: int = 1,
                policy: PlacementPolicy = DEFAULT_POLICY,
                experts_held: int | None = None) -> int:
    """Memory one rank needs for `layers` layers, holding its tensor share of each (the
    busiest rank's, when the split is uneven) and, for an expert rank, experts_held of each
    mixture-of-experts layer's experts (None: all). A whole copy of a model measured before
    counts what it held then (facts.measured_bytes)."""
    if (facts.measured_bytes is not None and layers == facts.n_layers and tp_size == 1
            and experts_held is None):
        return facts.measured_bytes
    model_bytes = facts.weight_bytes
    if experts_held is not None:
        model_bytes -= facts.expert_bytes * (facts.n_experts - experts_held) // facts.n_experts
    weights = math.ceil(model_bytes * layers / facts.n_layers
                        * tensor_share(facts, tp_size) * policy.overhead_factor)
    if not facts.generates:  # an embedding model keeps no KV and samples nothing
        return weights + policy.floor_bytes + facts.vocab_size * policy.vocab_entry_bytes
    kv_heads = kv_heads_per_rank(facts.n_kv_heads, tp_size)
    kv = (facts.kv_bytes_per_token_per_layer(policy.kv_element_bytes, kv_heads,
                                             policy.kv_scale_bytes)
          * layers * policy.kv_reservation_tokens)
    return (weights + kv + policy.floor_bytes + policy.generation_floor_bytes
            + facts.vocab_size * policy.vocab_entry_bytes)


def tensor_share(facts: ModelFacts, tp_size: int) -> float:
    """The largest fraction of a layer's weights one of tp_size tensor ranks holds."""
    if tp_size == 1:
        return 1.0
    groups = facts.n_kv_heads
    heads = (-(-groups // tp_size) / groups if groups >= tp_size else 1 / tp_size)
    width = facts.intermediate_size
    mlp = -(-width // tp_size) / width if width else 1 / tp_size
    return max(heads, mlp)


def kv_heads_per_rank(n_kv_heads: int, tp_size: int) -> int:
    """KV heads the busiest tensor rank holds: its share of the groups, or one replicated
    head when there are fewer KV heads than ranks."""
    if n_kv_heads >= tp_size:
        return -(-n_kv_heads // tp_size)
    if tp_size % n_kv_heads == 0:
        return 1
    raise ValueError(f"{n_kv_heads} KV heads cannot be split or replicated over {tp_size}")
