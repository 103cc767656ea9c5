"""ModelConfig: the shape and family flags of one decoder, read from GGUF or config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LayerType = Literal["full", "sliding"]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (transformers' _compute_yarn_parameters): frequencies blended
    between interpolated (divided by factor) and original across the dimensions whose
    rotations over original_max_position lie between beta_slow and beta_fast; cos and sin
    scaled by attention_factor (None: 0.1 ln(factor) + 1, or with DeepSeek's mscale and
    mscale_all_dim the ratio of the two magnitudes, which squares into its softmax scale).
    truncate rounds the blend's bounds to whole dimensions."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position < 1:
            raise ValueError("yarn scaling needs a positive factor and original context")

    def magnitude(self, mscale: float = 1.0) -> float:
        """YaRN's get_mscale: 0.1 * mscale * ln(factor) + 1 (1 without scaling up)."""
        return 1.0 if self.factor <= 1 else 0.1 * mscale * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention: q from x (q_lora_rank 0) or through a rank
    q_lora_rank bottleneck; keys and values from one kv_lora_rank latent per token plus a
    qk_rope_head_dim key part shared by every head (the only part RoPE turns)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        if min(self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim) < 1 \
                or self.q_lora_rank < 0 or self.qk_nope_head_dim < 0:
            raise ValueError("latent attention needs positive ranks and head sizes")
        if self.v_head_dim > self.qk_head_dim:
            raise ValueError("latent attention's value heads must not exceed its key heads")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cached_dim(self) -> int:
        """A token's cache row: the latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward path needs to know about a checkpoint.

    architecture is the canonical name of the model family (engine/models/families/).
    layer_types gives each layer's attention kind; sliding layers attend to the last
    sliding_window positions and use rope_local_theta.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] = ()
    rope_local_theta: float | None = None
    # Linear RoPE scaling of global layers (positions divided by this factor).
    rope_scaling_factor: float = 1.0
    # Dimensions of each q/k head that RoPE rotates: GLM's first rotary_dim (its partial
    # rotary), DeepSeek's last (its rope part, latent_attention); None: all.
    rotary_dim: int | None = None
    rope_yarn: YarnScaling | None = None
    # DeepSeek's latent attention (models/deepseek2.py); head_dim is then its query heads'
    # size (nope + rope), and the KV cache holds one row per token (kv_cache_rows).
    latent_attention: LatentAttention | None = None
    # Attention logits are multiplied by this; None means head_dim ** -0.5.
    attention_scale: float | None = None
    hidden_activation: Literal["silu", "gelu_tanh"] = "silu"
    final_logit_softcap: float | None = None
    # Mixture of experts (layers/experts.py); num_experts 0: every layer has a dense MLP.
    # Each token's router picks num_experts_per_token experts of expert_intermediate_size;
    # norm_topk_prob renormalises their probabilities to sum to 1. A shared expert (qwen2moe)
    # runs on every token, gated.
    num_experts: int = 0
    num_experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # The first first_dense_layers layers have a dense MLP of intermediate_size (GLM-4.5,
    # DeepSeek's first_k_dense_replace); the rest route to experts.
    first_dense_layers: int = 0
    # How the router scores experts (layers/experts.py GroupedRouter): "softmax" (the
    # default Router) or "sigmoid" (GLM-4.5, DeepSeek-V3: the score plus a per-expert bias
    # chooses, the score alone weighs). With expert_groups > 1 each token first keeps its
    # expert_groups_used best groups of experts. The chosen weights are multiplied by
    # routed_scaling_factor.
    expert_scoring: Literal["softmax", "sigmoid"] = "softmax"
    expert_groups: int = 1
    expert_groups_used: int = 1
    routed_scaling_factor: float = 1.0
    # gpt-oss's experts: the router takes the top k of its logits and a softmax over those k
    # (layers/experts.py LogitTopKRouter), and each expert's activation is the clamped SwiGLU
    # (up clamped to +-swiglu_limit, gate to at most it; (up + 1) * gate * sigmoid(alpha gate)).
    router_softmax_after_topk: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must name one kind per layer")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")
        if self.num_experts:
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                raise ValueError("num_experts_per_token must be within 1..num_experts")
            if self.expert_intermediate_size < 1:
                raise ValueError("a mixture-of-experts model needs expert_intermediate_size")
            if self.expert_groups < 1 or self.num_experts % self.expert_groups:
                raise ValueError("num_experts must be a multiple of expert_groups")
            if not 1 <= self.expert_groups_used <= self.expert_groups:
                raise ValueError("expert_groups_used must be within 1..expert_groups")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ValueError("rotary_dim must be even and within 1..head_dim")

    def has_experts(self, layer_index: int) -> bool:
        """Whether the layer's feed-forward routes to experts (else a dense MLP)."""
        return bool(self.num_experts) and layer_index >= self.first_dense_layers

    def layer_type(self, layer_index: int) -> LayerType:
        return self.layer_types[layer_index] if self.layer_types else "full"

    @property
    def kv_cache_rows(self) -> int:
        """Rows one token fills in a layer's KV cache (kv/tensors.py): a key and a value per
        KV head, or latent attention's one row, which its keys and values both read."""
        return 1 if self.latent_attention is not None else 2 * self.num_kv_heads

    @property
    def kv_row_dim(self) -> int:
        """Elements of one cache row: a head's size, or the latent's and rope key's."""
        latent = self.latent_attention
        return latent.cached_dim if latent is not None else self.head_dim

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5
