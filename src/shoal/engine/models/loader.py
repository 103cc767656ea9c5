"""load_model: checkpoint on disk -> a ready nn.Module for one layer range."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn

from shoal.engine.config import ModelSource
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.layers.attention import attention_dtype_for
from shoal.engine.models.layers.linear import WeightPlan
from shoal.engine.models.registry import model_class
from shoal.engine.parallel.shard import TensorShard
from shoal.engine.parallel.tensor import rank_config
from shoal.engine.weights.names import check_layer_range


@dataclass
class LoadedModel:
    module: nn.Module           # LlamaModel / Gemma3Model for layers [start, end)
    config: ModelConfig
    compute_dtype: torch.dtype
    weight_bytes: int
    layer_range: tuple[int, int] = (0, 0)
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype; None: compute_dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.compute_dtype


def open_checkpoint(source: ModelSource):
    """GGUFCheckpoint or SafetensorsCheckpoint; both have .config and .stream(layer_range)."""
    if source.format == "gguf":
        from shoal.engine.weights.gguf import GGUFCheckpoint
        return GGUFCheckpoint(Path(source.path))
    from shoal.engine.weights.safetensors import SafetensorsCheckpoint
    return SafetensorsCheckpoint(Path(source.path))


def read_model_config(source: ModelSource) -> ModelConfig:
    return open_checkpoint(source).config


def resolve_compute_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA and on CPUs with AVX512-BF16, float32 otherwise."""
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype != "auto":
        raise ValueError(f"dtype must be auto, bfloat16 or float32, not {dtype!r}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_model(source: ModelSource, dtype: str = "auto", device: str = "cpu",
               layer_range: tuple[int, int] | None = None,
               progress: Callable[[float], None] | None = None,
               shard: TensorShard | None = None,
               reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LoadedModel:
    """Load layers [start, end) of a checkpoint (the whole model by default); with a tensor
    shard, only that rank's slice of each layer, summed over the ranks with reduce.

    Q4_0/Q4_1 stay 4-bit and Q8_0 becomes int8 only on CPU with bfloat16 compute (plus
    dense bf16 copies for batches and prefill while memory allows);
    dtype="float32" dequantizes everything (the exact reference mode).
    The returned config is the model as this rank holds it (its heads, its MLP width).
    """
    checkpoint = open_checkpoint(source)
    config = checkpoint.config
    start, end = check_layer_range(layer_range, config.num_layers)
    compute_dtype = resolve_compute_dtype(dtype, device)
    torch_device = torch.device(device)
    keep_quantized = torch_device.type == "cpu" and compute_dtype == torch.bfloat16
    weights = dict(checkpoint.stream((start, end)))
    plan = WeightPlan(compute_dtype=compute_dtype, device=torch_device,
                      keep_quantized=keep_quantized,
                      dense_for_batches=keep_quantized and _dense_copies_fit(weights),
                      shard=shard if shard is not None and shard.size > 1 else None,
                      reduce=reduce)
    with torch.inference_mode():
        module = model_class(config.architecture)(config, (start, end), weights, plan, progress)
    module.eval()
    held = rank_config(config, plan.shard) if plan.shard is not None else config
    return LoadedModel(module=module, config=held, compute_dtype=compute_dtype,
                       weight_bytes=module.weight_bytes(), layer_range=(start, end),
                       kv_dtype=attention_dtype_for(torch_device, compute_dtype))


# Dense bf16 copies of the quantized layers (for batches and prefill) are kept while they take
# at most this share of the memory available before loading.
DENSE_COPY_SHARE = 0.1


def _dense_copies_fit(weights: dict, available_bytes: int | None = None) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    quantized = sum(math.prod(raw.shape) for raw in weights.values()
                    if raw.quant not in _DENSE_QUANTS and len(raw.shape) == 2)
    if available_bytes is None:
        available_bytes = psutil.virtual_memory().available
    return 2 * quantized <= DENSE_COPY_SHARE * available_bytes


# Tensor types that load dense anyway (no quantized kernel, so no second copy).
_DENSE_QUANTS = frozenset({"dense", "F32", "F16", "BF16"})


def kv_bytes_per_token(config: ModelConfig, kv_dtype: torch.dtype | str,
                       num_layers: int | None = None) -> int:
    """Bytes of K and V cache one token occupies across `num_layers` (default: all layers)."""
    if isinstance(kv_dtype, str):
        kv_dtype = resolve_compute_dtype(kv_dtype, "cpu")
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * config.num_kv_heads * config.head_dim * itemsize
