"""Size the paged KV cache from what a model may need, and refuse models that cannot fit.

The cache's capacity is what the model may need: max_num_seqs full contexts, or less when
--kv-cache-memory caps it. It never depends on what memory happens to be free, so a model
gets the same context whatever loaded before it. Capacity is address space only: pages
become resident as blocks are first written, and the runner touches no more blocks than the
node has granted it (engine/kv/block_pool.py, runner/kv_grant.py), in steps of
KV_GRANT_STEP_TOKENS tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.errors import ModelDoesNotFit

# The KV a runner is granted at load and by each later grant, in tokens of its model; also
# what placement reserves for a model's KV before it has measured itself.
KV_GRANT_STEP_TOKENS = 4096
# The smallest context worth serving; below it loading fails with a clear error.
MIN_CONTEXT_TOKENS = 256
# Weights in memory are at most this many times the file size (dequantized norms, packing,
# the output head's estimate copies, which models/llama.py keeps within the same factor).
LOAD_OVERHEAD_FACTOR = 1.2


# The decode row buffer (kv/row_buffer.py) takes this share of the KV budget, at most
# ROW_BUFFER_MAX_TOKENS.
ROW_BUFFER_SHARE = 0.125
ROW_BUFFER_MAX_TOKENS = 8192


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    max_model_len: int
    row_buffer_tokens: int = 0  # slots of the decode row buffer, after the paged blocks


def check_weights_fit(source: ModelSource, available_bytes: int | None = None,
                      limit_bytes: int | None = None) -> None:
    """Fail before loading when the weight files alone exceed available memory, or the
    runner's share of the node's budget (limit_bytes). The runner's pre-load guard: the
    node tries a model whose estimate is a little over its room, and this decides."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if limit_bytes is not None:
        available = min(available, limit_bytes)
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


def plan_kv_cache(config: EngineConfig, model_config, loaded) -> KVPlan:
    """Blocks for the KV cache and the context they allow.

    By default the paged blocks hold max_num_seqs full contexts and the decode row buffer
    (ROW_BUFFER_SHARE of that, at most ROW_BUFFER_MAX_TOKENS tokens) comes on top. With
    --kv-cache-memory, both fit within it: the row buffer takes its share, the paged blocks
    the rest.
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
    need = config.max_num_seqs * context * per_token
    budget = need if config.kv_cache_bytes is None else min(need, config.kv_cache_bytes)
    row_buffer_tokens = min(ROW_BUFFER_MAX_TOKENS, int(budget * ROW_BUFFER_SHARE) // per_token)
    if config.kv_cache_bytes is None:
        num_blocks = -(-config.max_num_seqs * context // config.block_size)
    else:
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
