"""load_model: checkpoint on disk -> a ready nn.Module for one layer range."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shoal.engine.backends import Backend, choose_backend
from shoal.engine.config import ModelSource
from shoal.engine.errors import UnsupportedModel
from shoal.engine.kernels.build import KERNEL
from shoal.engine.kv.quant import check_head_dim, row_bytes
from shoal.engine.models.config import ModelConfig
from shoal.engine.models.layers.linear import WeightPlan
from shoal.engine.models.registry import family_of, model_class
from shoal.engine.parallel.experts import holds_tensor
from shoal.engine.parallel.shard import TensorShard
from shoal.engine.parallel.tensor import rank_config
from shoal.engine.weights.gguf import GGUFCheckpoint
from shoal.engine.weights.names import check_layer_range
from shoal.engine.weights.safetensors import SafetensorsCheckpoint

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    module: nn.Module           # LlamaModel / Gemma3Model for layers [start, end)
    config: ModelConfig
    compute_dtype: torch.dtype
    weight_bytes: int
    layer_range: tuple[int, int] = (0, 0)
    kv_dtype: torch.dtype | None = None  # the KV cache's elements; None: compute_dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.compute_dtype


def open_checkpoint(source: ModelSource):
    """GGUFCheckpoint or SafetensorsCheckpoint; both have .config and .stream(layer_range)."""
    if source.format == "gguf":
        return GGUFCheckpoint(Path(source.path))
    return SafetensorsCheckpoint(Path(source.path))


def read_model_config(source: ModelSource) -> ModelConfig:
    return open_checkpoint(source).config


def resolve_compute_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, on CPUs with AVX512-BF16, and on CPUs where the packed
    kernels run (AVX2: float32 arithmetic on packed weights, bf16 activations and KV, a
    quarter of float32's memory); float32 otherwise (dequantized weights, torch's kernels)."""
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype != "auto":
        raise ValueError(f"dtype must be auto, bfloat16 or float32, not {dtype!r}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if _cpu_has_bf16() or _packed_kernels_run() else torch.float32


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _packed_kernels_run() -> bool:
    """Whether the compiled packed-weight kernels built and multiply fast here (builds them
    on first use, as loading the model would)."""
    kernel = KERNEL.load()
    return kernel is not None and kernel.quant_fast_kernels()


def load_model(source: ModelSource, dtype: str = "auto", device: str = "cpu",
               layer_range: tuple[int, int] | None = None,
               progress: Callable[[float], None] | None = None,
               shard: TensorShard | None = None,
               reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
               kv_cache_dtype: str = "auto", backend: Backend | None = None,
               experts: tuple[int, int] | None = None) -> LoadedModel:
    """Load layers [start, end) of a checkpoint (the whole model by default); with a tensor
    shard, only that rank's slice of each layer, summed over the ranks with reduce; with an
    expert range, only those experts of each mixture-of-experts layer (parallel/experts.py).

    On CPU with bfloat16 compute every GGUF type stays packed as the file stores it
    (kernels/quant_*.cpp); dtype="float32" dequantizes everything (the exact reference
    mode), as does CUDA for now.
    The returned config is the model as this rank holds it (its heads, its MLP width).
    """
    checkpoint = open_checkpoint(source)
    config = checkpoint.config
    start, end = check_layer_range(layer_range, config.num_layers)
    if backend is None:
        backend = choose_backend(torch.device(device), resolve_compute_dtype(dtype, device))
    compute_dtype = backend.compute_dtype
    if experts is not None:
        check_expert_range(config, experts)
    plan = WeightPlan(backend, shard=shard if shard is not None and shard.size > 1 else None,
                      reduce=reduce, experts=experts)
    weights = {name: raw for name, raw in checkpoint.stream((start, end))
               if holds_tensor(name, experts)}  # never another rank's experts
    with torch.inference_mode():
        module = model_class(family_of(config.architecture))(config, (start, end), weights,
                                                             plan, progress)
    del weights
    module.eval()
    del checkpoint  # unmaps the file: the model holds its own (packed) copies
    held = rank_config(config, plan.shard) if plan.shard is not None else config
    return LoadedModel(module=module, config=held, compute_dtype=compute_dtype,
                       weight_bytes=module.weight_bytes(), layer_range=(start, end),
                       kv_dtype=resolve_kv_dtype(kv_cache_dtype, compute_dtype, held))


def check_expert_range(config: ModelConfig, experts: tuple[int, int]) -> None:
    """UnsupportedModel for a dense model, ValueError for a range outside its experts."""
    if not config.num_experts:
        raise UnsupportedModel("expert sharding needs a mixture-of-experts model: "
                               f"{config.architecture} has no experts")
    if not 0 <= experts[0] < experts[1] <= config.num_experts:
        raise ValueError(f"expert range [{experts[0]}, {experts[1]}) is outside the model's "
                         f"{config.num_experts} experts")


def resolve_kv_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype,
                     config: ModelConfig) -> torch.dtype:
    """The KV cache's elements: auto follows the compute dtype; int8 (kv/quant.py) needs
    head sizes its row layout allows."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    if kv_cache_dtype == "int8":
        check_head_dim(config.kv_row_dim)
        return torch.int8
    if kv_cache_dtype not in ("bfloat16", "float32"):
        raise ValueError("kv_cache_dtype must be one of auto, bfloat16, float32, int8, not "
                         f"{kv_cache_dtype!r}")
    return resolve_compute_dtype(kv_cache_dtype, "cpu")


def kv_bytes_per_token(config: ModelConfig, kv_dtype: torch.dtype | str,
                       num_layers: int | None = None) -> int:
    """Bytes of K and V cache one token occupies across `num_layers` (default: all layers),
    an int8 cache's scales included (latent attention: its one latent row per layer)."""
    if isinstance(kv_dtype, str):
        kv_dtype = torch.int8 if kv_dtype == "int8" else resolve_compute_dtype(kv_dtype, "cpu")
    layers = config.num_layers if num_layers is None else num_layers
    return layers * config.kv_cache_rows * row_bytes(config.kv_row_dim, kv_dtype)
