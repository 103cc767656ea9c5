"""GGUF checkpoints: metadata -> ModelConfig, and a (name, RawTensor) stream per layer range.

The family's declaration (models/families/) names the metadata keys and, through the gguf
package's tables, the tensor names; they are translated to shoal's canonical names (see
weights/names.py). For families whose q/k rows llama.cpp's converter permutes (each head's
rotary halves interleaved) the stream undoes that, so every model sees Hugging Face row order.
A layer's experts, one 3-D tensor in the file, are streamed one matrix per expert (views of
the file's bytes: each expert's matrix is contiguous in it), as safetensors files hold them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES

from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.registry import family_of
from shoal.engine.weights.gguf_file import GGUFFile, TensorInfo
from shoal.engine.weights.names import LayerRange, TensorNames, expert_name, in_stage
from shoal.engine.weights.quant import RawTensor

_EMBEDDING = TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight"
_OUTPUT = TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight"
_FIRST_Q = TENSOR_NAMES[MODEL_TENSOR.ATTN_Q].format(bid=0)
_FIRST_Q_NORM = TENSOR_NAMES[MODEL_TENSOR.ATTN_Q_NORM].format(bid=0) + ".weight"


class GGUFCheckpoint:
    """An opened .gguf file (memory-mapped; tensors are read lazily)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.tensors = self.file.tensors
        self.architecture = str(self._field("general.architecture"))
        self.family = family_of(self.architecture)
        self.config = self._read_config()
        self.names = TensorNames(self.family, self.config.num_layers)

    def _field(self, key: str, default=None):
        value = self.file.metadata.get(key)
        return default if value is None else value

    def _arch_field(self, key: str, default=None):
        return self._field(f"{self.architecture}.{key}", default)

    def _read_config(self) -> ModelConfig:
        family = self.family
        if family.task != "generate":
            raise UnsupportedModel(f"{self.architecture} is an embedding model; "
                                   "it cannot generate text")

        def read(name: str, default: Any = None) -> Any:
            return self._arch_field(family.gguf_config_keys[name], default)

        hidden = int(read("hidden_size"))
        heads = int(read("num_heads"))
        vocab = read("vocab_size")
        if vocab is None:
            vocab = self.tensors[_EMBEDDING].dims[-1]
        common = dict(
            architecture=family.name,
            num_layers=int(read("num_layers")),
            hidden_size=hidden,
            intermediate_size=int(read("intermediate_size")),
            num_heads=heads, num_kv_heads=int(read("num_kv_heads", heads)),
            head_dim=int(read("head_dim", hidden // heads)),
            vocab_size=int(vocab),
            max_position=int(read("max_position", 2048)),
            rope_theta=float(read("rope_theta", 10000.0)),
            rms_eps=float(read("rms_eps", 1e-6)),
        )
        scaling = read("rope_scaling_type", "none")
        if scaling not in family.rope_scalings:
            raise UnsupportedModel(f"RoPE scaling {scaling!r} is not supported")
        values = {**family.config_defaults, **common,
                  # Which optional tensors the file holds says what the model has.
                  "tie_embeddings": _OUTPUT not in self.tensors,
                  "qkv_bias": _FIRST_Q + ".bias" in self.tensors,
                  "qk_norm": _FIRST_Q_NORM in self.tensors,
                  "rope_scaling_factor": (float(read("rope_scaling_factor", 1.0) or 1.0)
                                          if scaling != "yarn" else 1.0)}
        if family.gguf_config_extras is not None:
            values.update(family.gguf_config_extras(self._arch_field, values))
        return ModelConfig(**values)

    def stream(self, layer_range: LayerRange | None = None) -> Iterator[tuple[str, RawTensor]]:
        """(canonical name, RawTensor) for the tensors of layers [start, end) and, for the
        first / last stage, the embedding / final norm and output head."""
        config = self.config
        start, end = layer_range or (0, config.num_layers)
        for name, tensor in self.tensors.items():
            canonical, layer = self.names.from_gguf(name)
            if canonical is None:
                continue
            if not in_stage(canonical, layer, start, end, config):
                continue
            raw = self._raw(tensor)
            part = canonical.split(".")[-2]
            if self.family.gguf_permuted_qk and part in ("q", "k"):
                heads = config.num_heads if ".q." in canonical else config.num_kv_heads
                raw = raw.rows(_unpermute_order(heads, config.head_dim, raw.shape[0]))
            if ".experts." in canonical and canonical.endswith(".bias"):  # [experts, out]
                values = raw.dequantize()
                for expert in range(values.shape[0]):
                    yield expert_name(canonical, expert), RawTensor(
                        (values.shape[1],), "dense", values[expert].clone())
                continue
            if ".experts." in canonical:  # [experts, out, in]
                for expert, matrix in enumerate(_expert_matrices(raw)):
                    yield expert_name(canonical, expert), matrix
                continue
            yield canonical, raw

    def _raw(self, info: TensorInfo) -> RawTensor:
        # GGUF lists dimensions innermost first; torch wants them outermost first.
        shape = tuple(reversed(info.dims))
        return RawTensor(shape=shape, quant=info.type_name, data=self.file.data(info))


def _expert_matrices(raw: RawTensor) -> list[RawTensor]:
    """[experts, out, in] -> one [out, in] tensor per expert; raw.data is [experts * out,
    bytes per row], so each expert's rows are a slice (no copy)."""
    experts, rows, columns = raw.shape
    return [RawTensor((rows, columns), raw.quant, raw.data[e * rows:(e + 1) * rows])
            for e in range(experts)]


def _unpermute_order(heads: int, head_dim: int, rows: int) -> torch.Tensor:
    """Row order that turns llama.cpp's stored q/k rows back into HF order.

    Stored rows of one head are [head_dim/2, 2] (rotary pairs interleaved);
    HF's are [2, head_dim/2].
    """
    if heads * head_dim != rows:
        raise UnsupportedModel(f"q/k has {rows} rows, expected {heads} heads x {head_dim}")
    return torch.arange(rows).view(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)
