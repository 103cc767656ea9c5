"""ModelConfig: the shape and family flags of one decoder, read from GGUF or config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerType = Literal["full", "sliding"]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (transformers' _compute_yarn_parameters): frequencies blended
    between interpolated (divided by factor) and original across the dimensions whose
    rotations over original_max_position lie between beta_slow and beta_fast; cos and sin
    scaled by attention_factor (None: 0.1 ln(factor) + 1). truncate rounds the blend's
    bounds to whole dimensions."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position < 1:
            raise ValueError("YaRN scaling needs a positive factor and original context")


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
    # YaRN scaling of every layer's RoPE (gpt-oss); None: none.
    rope_yarn: YarnScaling | None = None
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

    def layer_type(self, layer_index: int) -> LayerType:
        return self.layer_types[layer_index] if self.layer_types else "full"

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5
