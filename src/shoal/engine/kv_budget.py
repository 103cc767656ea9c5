"""Size the paged KV cache from a memory budget, and refuse models that cannot fit."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.errors import ModelDoesNotFit

# Share of the memory available after loading weights that the KV cache takes by default.
DEFAULT_KV_SHARE = 0.25
# The smallest context worth serving; below it loading fails with a clear error.
MIN_CONTEXT_TOKENS = 256
# Weights in memory are at most this many times the file size (dequantized norms, packing).
LOAD_OVERHEAD_FACTOR = 1.3


# The decode row buffer (kv/row_buffer.py) takes this share of the KV budget, at most
# ROW_BUFFER_MAX_TOKENS.
ROW_BUFFER_SHARE = 0.125
ROW_BUFFER_MAX_TOKENS = 8192


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    max_model_len: int
    row_buffer_tokens: int = 0  # slots of the decode row buffer, after the paged blocks


def check_weights_fit(source: ModelSource, available_bytes: int | None = None) -> None:
    """Fail before loading when the weight files alone exceed available memory."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    files = [source.path] if source.path.is_file() else list(source.path.glob("*.safetensors"))
    needed = int(sum(f.stat().st_size for f in files) * LOAD_OVERHEAD_FACTOR)
    if needed > available:
        raise ModelDoesNotFit(
            f"model {source.model_id!r} needs about {needed / 2**30:.2f} GiB to load but only "
            f"{available / 2**30:.2f} GiB is available")


def kv_bytes_per_block(loaded, block_size: int) -> int:
    """Bytes one KV block takes over the layers `loaded` holds (a pipeline rank caches only
    its own layers; a tensor rank's config counts its own KV heads)."""
    # torch: placement imports this module in the node process, which loads no model
    from shoal.engine.models.loader import kv_bytes_per_token

    start, end = loaded.layer_range
    return kv_bytes_per_token(loaded.config, loaded.cache_dtype,
                              num_layers=(end - start) or None) * block_size


def plan_kv_cache(config: EngineConfig, model_config, loaded,
                  available_bytes: int | None = None) -> KVPlan:
    """Blocks for the KV cache and the context they allow.

    The budget is --kv-cache-memory when given, else DEFAULT_KV_SHARE of available memory
    (within the runner's memory limit, less what it holds already: its share of the node's
    memory budget), never more than max_num_seqs full contexts need. ROW_BUFFER_SHARE of it
    (at most ROW_BUFFER_MAX_TOKENS tokens) is the decode row buffer; the paged blocks get the
    rest.
    """
    # Here, not at the top: placement reads this module's constants in a node that never
    # imports torch, and the loader does.
    from shoal.engine.models.loader import kv_bytes_per_token

    start, end = loaded.layer_range
    # A pipeline rank caches only its own layers (a tensor rank's config has its KV heads).
    per_token = kv_bytes_per_token(model_config, loaded.cache_dtype,
                                   num_layers=(end - start) or None)
    per_block = per_token * config.block_size
    context = model_config.max_position
    if config.max_model_len is not None:
        context = min(context, config.max_model_len)
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    else:
        available = (psutil.virtual_memory().available if available_bytes is None
                     else available_bytes)
        if config.memory_limit_bytes is not None:
            held = psutil.Process().memory_info().rss
            available = min(available, max(0, config.memory_limit_bytes - held))
        budget = min(int(available * DEFAULT_KV_SHARE),
                     config.max_num_seqs * context * per_token)
    row_buffer_tokens = min(ROW_BUFFER_MAX_TOKENS, int(budget * ROW_BUFFER_SHARE) // per_token)
    num_blocks = (budget - row_buffer_tokens * per_token) // per_block
    tokens = num_blocks * config.block_size
    if tokens < min(MIN_CONTEXT_TOKENS, context):
        raise ModelDoesNotFit(
            f"the KV cache budget of {budget / 2**20:.1f} MiB holds only {tokens} tokens of "
            f"model {config.source.model_id!r} ({per_token} bytes per token); at least "
            f"{min(MIN_CONTEXT_TOKENS, context)} are needed. "
            "Raise --kv-cache-memory or free memory.")
    return KVPlan(num_blocks=int(num_blocks), max_model_len=int(min(context, tokens)),
                  row_buffer_tokens=row_buffer_tokens)
