"""Engine configuration: frozen, validated once, built by shoal.config from flags and env."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shoal.engine.parallel.config import ParallelConfig
from shoal.engine.speculation.config import SpeculativeConfig

DType = Literal["auto", "bfloat16", "float32"]
# KV cache elements: a compute dtype, or int8 with a scale per token and head (kv/quant.py).
KVCacheDType = Literal["auto", "bfloat16", "float32", "int8"]
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")
# "diffusers": a diffusers pipeline directory (model_index.json), served by the image runner.
WeightFormat = Literal["gguf", "safetensors", "diffusers"]
# What a model does: generate text, encode text into embedding vectors, or draw images.
ModelTask = Literal["generate", "embed", "image"]


@dataclass(frozen=True)
class ModelSource:
    """Where one model's weights and tokenizer live, already resolved to local files.

    path is a .gguf file (format "gguf"), a Hugging Face style directory holding
    config.json, *.safetensors and tokenizer.json (format "safetensors"), or a diffusers
    pipeline directory holding model_index.json (format "diffusers", task "image").
    """

    model_id: str
    format: WeightFormat
    path: Path
    task: ModelTask = "generate"

    def __post_init__(self) -> None:
        if self.task not in ("generate", "embed", "image"):
            raise ValueError(f"model {self.model_id!r}: task must be generate, embed or image")
        if (self.format == "diffusers") != (self.task == "image"):
            raise ValueError(f"model {self.model_id!r}: images come from diffusers pipeline "
                             f"directories, and those only draw images")
        if self.format == "gguf" and self.task == "embed":
            raise ValueError(f"model {self.model_id!r}: embedding models load from "
                             f"safetensors directories, not GGUF")
        if not self.path.exists():
            raise ValueError(f"model {self.model_id!r}: {self.path} does not exist")


@dataclass(frozen=True)
class KvDiskConfig:
    """The SSD tier for prefix KV blocks (--kv-disk): under `root`, one directory per model
    identity (kv/disk_prefixes.py), at most max_bytes each, entries kept ttl_s after last use."""

    root: Path
    max_bytes: int
    ttl_s: float = 7 * 24 * 3600.0
    # The longest a step waits for the disk when a prompt's blocks are read.
    read_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1024 * 1024:
            raise ValueError("the KV disk tier needs at least 1 MiB (--kv-disk)")
        if not self.ttl_s > 0:
            raise ValueError("the KV disk TTL must be positive (--kv-disk-ttl)")
        if not self.read_timeout_s > 0:
            raise ValueError("the KV disk read timeout must be positive")


@dataclass(frozen=True)
class EngineConfig:
    source: ModelSource
    dtype: DType = "auto"
    device: str = "cpu"
    threads: int | None = None
    # The most the KV cache may hold (--kv-cache-memory); None: max_num_seqs full contexts.
    kv_cache_bytes: int | None = None
    block_size: int = 16
    # Token budget per step: decode tokens first, the rest goes to prefill chunks.
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 32
    # Upper bound on context per request; None takes the model's own context length.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # KV cache elements: auto follows the compute dtype (bf16 halves what attention reads);
    # int8 halves bf16's bytes again.
    kv_cache_dtype: KVCacheDType = "auto"
    # Directory for derived artefacts (e.g. a tokenizer.json built from GGUF metadata).
    cache_dir: Path | None = None
    # This runner's rank in a multi-rank instance; None for a model served whole.
    parallel: ParallelConfig | None = None
    # The most this runner may hold in all (its share of the node's memory budget): the
    # pre-load guard refuses weights that would not fit in it. None: no share.
    memory_limit_bytes: int | None = None
    # Speculative decoding for every request of this model (--speculative); None: only
    # requests asking for it (x_speculative) speculate.
    speculative: SpeculativeConfig | None = None
    # The draft model's files (speculative method "draft"); None: resolved by its name.
    draft_source: ModelSource | None = None
    # Prefix KV blocks also kept on disk (--kv-disk); None: RAM only.
    kv_disk: KvDiskConfig | None = None

    def __post_init__(self) -> None:
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 0:
            raise ValueError("memory_limit_bytes must not be negative")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, not {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"not {self.kv_cache_dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError("block_size must be 8, 16, 32 or 64")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError("max_model_len must be >= 16")
