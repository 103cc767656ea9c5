"""BERT encoder for sentence embeddings: token ids -> one hidden state per token.

Structure (post-norm, bidirectional): embeddings (word + absolute position + token type 0)
-> LayerNorm, then per layer h = LN(h + attn(h)); h = LN(h + W2 gelu(W1 h)). A padded batch
carries a key mask so padding never influences real tokens. No KV cache: every request is
one full forward over its tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.families.bert import BERT
from shoal.engine.models.registry import family_of, hf_architecture_name
from shoal.engine.weights.quant import RawTensor
from shoal.engine.weights.safetensors import read_tensors

_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# Checkpoints saved from task heads (masked LM, classification) nest the encoder here.
_PREFIXES = ("bert.", "model.")


@dataclass(frozen=True)
class BertConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    max_position: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    gelu_approximate: str = "none"  # "none" (erf) or "tanh"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "vocab_size", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"bert config {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: Mapping) -> BertConfig:
        """The encoder's shape from a config.json dict; UnsupportedModel for variants."""
        name = hf_architecture_name(hf)
        if family_of(name) is not BERT:
            raise UnsupportedModel(f"{name!r} is not a BERT checkpoint")
        position = hf.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise UnsupportedModel(f"BERT position embeddings {position!r} are not supported")
        activation = hf.get("hidden_act", "gelu")
        if activation not in _ACTIVATIONS:
            raise UnsupportedModel(f"BERT activation {activation!r} is not supported")
        return cls(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf["intermediate_size"],
                   num_heads=hf["num_attention_heads"], vocab_size=hf["vocab_size"],
                   max_position=hf.get("max_position_embeddings", 512),
                   type_vocab_size=hf.get("type_vocab_size", 2),
                   layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                   gelu_approximate=_ACTIVATIONS[activation])


Tensors = dict[str, torch.Tensor]


def _linear(weights: Tensors, name: str) -> nn.Linear:
    weight = weights[name + ".weight"]  # [out, in]
    layer = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = nn.Parameter(weights[name + ".bias"], requires_grad=False)
    return layer


def _layer_norm(weights: Tensors, name: str, eps: float) -> nn.LayerNorm:
    weight = weights[name + ".weight"]
    norm = nn.LayerNorm(weight.shape[0], eps=eps, device="meta")
    norm.weight = nn.Parameter(weight, requires_grad=False)
    norm.bias = nn.Parameter(weights[name + ".bias"], requires_grad=False)
    return norm


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig, index: int, weights: Tensors) -> None:
        super().__init__()
        prefix = f"encoder.layer.{index}."
        attention = prefix + "attention."
        # q, k and v in one matmul: weight [3H, H]
        fused = {f"qkv.{kind}": torch.cat([weights[f"{attention}self.{part}.{kind}"]
                                           for part in ("query", "key", "value")])
                 for kind in ("weight", "bias")}
        self.qkv = _linear(fused, "qkv")
        self.attn_out = _linear(weights, attention + "output.dense")
        self.attn_norm = _layer_norm(weights, attention + "output.LayerNorm",
                                     config.layer_norm_eps)
        self.up = _linear(weights, prefix + "intermediate.dense")
        self.down = _linear(weights, prefix + "output.dense")
        self.mlp_norm = _layer_norm(weights, prefix + "output.LayerNorm", config.layer_norm_eps)
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.gelu_approximate = config.gelu_approximate

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        # h: [B, T, H]; key_mask: [B, 1, 1, T] bool, True where the key is a real token
        batch, length, hidden = h.shape
        qkv = self.qkv(h).view(batch, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, D]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        attended = attended.transpose(1, 2).reshape(batch, length, hidden)
        h = self.attn_norm(h + self.attn_out(attended))
        return self.mlp_norm(h + self.down(F.gelu(self.up(h),
                                                  approximate=self.gelu_approximate)))


class BertModel(nn.Module):
    """The encoder stack; forward returns the last hidden states [B, T, H]."""

    def __init__(self, config: BertConfig, weights: Tensors,
                 progress: Callable[[float], None] | None = None) -> None:
        super().__init__()
        self.config = config
        self.word = weights["embeddings.word_embeddings.weight"]            # [V, H]
        self.position = weights["embeddings.position_embeddings.weight"]    # [P, H]
        self.token_type = weights["embeddings.token_type_embeddings.weight"][0]  # [H]
        self.embed_norm = _layer_norm(weights, "embeddings.LayerNorm", config.layer_norm_eps)
        layers = []
        for index in range(config.num_layers):
            layers.append(BertLayer(config, index, weights))
            if progress is not None:
                progress((index + 1) / config.num_layers)
        self.layers = nn.ModuleList(layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # input_ids, attention_mask: [B, T]; the mask is True on real tokens
        length = input_ids.shape[1]
        h = F.embedding(input_ids, self.word) + self.position[:length] + self.token_type
        h = self.embed_norm(h)
        key_mask = attention_mask[:, None, None, :]  # [B, 1, 1, T]
        for layer in self.layers:
            h = layer(h, key_mask)
        return h

    def weight_bytes(self) -> int:
        tensors = [self.word, self.position, self.token_type, *self.parameters()]
        return sum(t.numel() * t.element_size() for t in tensors)


def _strip_prefix(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_bert(directory: Path, dtype: torch.dtype, device: str = "cpu",
              progress: Callable[[float], None] | None = None) -> BertModel:
    """A BertModel from a Hugging Face directory (config.json + *.safetensors)."""
    config = BertConfig.from_hf(json.loads((Path(directory) / "config.json").read_text()))
    wanted = ("embeddings.", "encoder.layer.")
    weights: Tensors = {}
    for name, raw in read_tensors(Path(directory)):
        name = _strip_prefix(name)
        if name.startswith(wanted) and not name.endswith("position_ids"):
            weights[name] = _materialise(raw, dtype, device)
    try:
        model = BertModel(config, weights, progress)
    except KeyError as error:
        raise UnsupportedModel(f"{directory}: BERT tensor {error} is missing") from None
    return model.eval()


def _materialise(raw: RawTensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    return raw.dequantize().to(device=device, dtype=dtype)
