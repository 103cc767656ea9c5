"""GGUF checkpoints: metadata -> ModelConfig, and a (name, RawTensor) stream per layer range.

Names are translated to shoal's canonical names (see weights/names.py). llama.cpp's
converter stores llama-architecture attn_q / attn_k rows permuted (each head's rotary halves
interleaved); the stream undoes that so every model sees Hugging Face row order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.weights.gguf_file import GGUFFile, TensorInfo
from shoal.engine.weights.names import LayerRange, in_stage
from shoal.engine.weights.quant import RawTensor

# GGUF architectures whose q/k rows llama.cpp's converter permutes.
PERMUTED_ARCHITECTURES = ("llama", "mistral")

_GLOBAL_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
    "attn_output": "o", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm", "ffn_norm": "mlp_norm",
    "post_ffw_norm": "post_mlp_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFCheckpoint:
    """An opened .gguf file (memory-mapped; tensors are read lazily)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.tensors = self.file.tensors
        self.architecture = str(self._field("general.architecture"))
        self.config = self._read_config()

    def _field(self, key: str, default=None):
        value = self.file.metadata.get(key)
        return default if value is None else value

    def _arch_field(self, key: str, default=None):
        return self._field(f"{self.architecture}.{key}", default)

    def _read_config(self) -> ModelConfig:
        from shoal.engine.models.registry import canonical_architecture

        family = canonical_architecture(self.architecture)
        hidden = int(self._arch_field("embedding_length"))
        heads = int(self._arch_field("attention.head_count"))
        kv_heads = int(self._arch_field("attention.head_count_kv", heads))
        head_dim = int(self._arch_field("attention.key_length", hidden // heads))
        vocab = self._arch_field("vocab_size")
        if vocab is None:
            vocab = self.tensors["token_embd.weight"].dims[-1]
        common = dict(
            architecture=family,
            num_layers=int(self._arch_field("block_count")),
            hidden_size=hidden,
            intermediate_size=int(self._arch_field("feed_forward_length")),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            vocab_size=int(vocab),
            max_position=int(self._arch_field("context_length", 2048)),
            rope_theta=float(self._arch_field("rope.freq_base", 10000.0)),
            rms_eps=float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
        )
        if self._arch_field("rope.scaling.type", "none") not in ("none", "linear"):
            raise UnsupportedModel(f"RoPE scaling {self._arch_field('rope.scaling.type')!r} "
                                   "is not supported")
        factor = float(self._arch_field("rope.scaling.factor", 1.0) or 1.0)
        if family == "gemma3":
            return _gemma3_config(common, self._arch_field("attention.sliding_window", 512), factor)
        return ModelConfig(**common, rope_scaling_factor=factor)

    def stream(self, layer_range: LayerRange | None = None) -> Iterator[tuple[str, RawTensor]]:
        """(canonical name, RawTensor) for the tensors of layers [start, end) and, for the
        first / last stage, the embedding / final norm and output head."""
        config = self.config
        start, end = layer_range or (0, config.num_layers)
        for name, tensor in self.tensors.items():
            canonical, layer = _canonical(name)
            if canonical is None:
                continue
            if not in_stage(canonical, layer, start, end, config):
                continue
            raw = self._raw(tensor)
            part = canonical.split(".")[-2]
            if self.architecture in PERMUTED_ARCHITECTURES and part in ("q", "k"):
                heads = config.num_heads if ".q." in canonical else config.num_kv_heads
                raw = raw.rows(_unpermute_order(heads, config.head_dim, raw.shape[0]))
            yield canonical, raw


    def _raw(self, info: TensorInfo) -> RawTensor:
        # GGUF lists dimensions innermost first; torch wants them outermost first.
        shape = tuple(reversed(info.dims))
        return RawTensor(shape=shape, quant=info.type_name, data=self.file.data(info))


def _gemma3_config(common: dict, sliding_window, factor: float) -> ModelConfig:
    # Which layers slide and the local RoPE base are not in the GGUF metadata; these are
    # Gemma 3's defaults (every sixth layer global), as transformers fills them too.
    layers = common["num_layers"]
    layer_types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(layers))
    return ModelConfig(**common, sliding_window=int(sliding_window), layer_types=layer_types,
                       rope_local_theta=10000.0, rope_scaling_factor=factor,
                       attention_scale=common["head_dim"] ** -0.5,
                       hidden_activation="gelu_tanh")


def _canonical(name: str) -> tuple[str | None, int | None]:
    if name.endswith(".weight") and name[:-7] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[name[:-7]]}.weight", None
    match = _BLOCK.match(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None, None
    layer = int(match.group(1))
    return f"layers.{layer}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}", layer


def _unpermute_order(heads: int, head_dim: int, rows: int) -> torch.Tensor:
    """Row order that turns llama.cpp's stored q/k rows back into HF order.

    Stored rows of one head are [head_dim/2, 2] (rotary pairs interleaved);
    HF's are [2, head_dim/2].
    """
    if heads * head_dim != rows:
        raise UnsupportedModel(f"q/k has {rows} rows, expected {heads} heads x {head_dim}")
    return torch.arange(rows).view(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)
