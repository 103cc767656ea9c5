"""bench/kv.py's "int8" section: the int8 KV cache against bf16's, bytes per token and batch-1
decode speed at long contexts.

Two engines of the same model are loaded, one with a bf16 KV cache and one with
int8. KV bytes per token are measured from the tensors each one allocated (every layer's
cache over its slots). For each context length a greedy request with a prompt of that many
tokens decodes new_tokens tokens on each engine, turn about for `rounds` rounds (this host's
speed drifts within minutes); decode tokens/s is timed from the first token (the prompt's
blocks come from the prefix cache after the first round) and each side's median is taken.
The greedy tokens of the two sides are reported as equal or not (they may differ: int8
rounds the keys and values). Beside the whole step, the decode attention alone (the compiled
kernel's arithmetic for one generated row of this model's heads, over blocks of 16 keys
scattered over each layer's cache, every layer in turn so the caches outgrow the CPU's) is
timed per layer on one thread for each context: the part int8 changes.
"""

from __future__ import annotations

import statistics
import time

import torch

from shoal.catalog.resolve import resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.kernels.build import KERNEL
from shoal.engine.kv.quant import quantize
from shoal.engine.sampling import SamplingParams

DTYPES = ("bfloat16", "int8")
PARAGRAPH = (
    "The harbour master kept a ledger of every ship that came in: its name, its cargo, the "
    "weather on the day it docked and how long it stayed. Over the years the ledger grew "
    "into a history of the town, the fishing fleets of the good years and the empty quays "
    "of the bad ones. def tally(ships):\n    return sum(ship.tons for ship in ships)\n")


def kv_bytes_per_token(engine: Engine) -> float:
    """Bytes of every layer's allocated cache over its slots (paged blocks and stage)."""
    caches = engine.runner.kv_caches
    return sum(cache.nbytes for cache in caches) / caches[0].shape[1]


def prompt_ids(engine: Engine, length: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        ids += engine.tokenizer.encode(PARAGRAPH)
    return ids[:length]


def decode(engine: Engine, ids: list[int], new_tokens: int, tag: str) -> tuple[float, list[int]]:
    """(decode tokens/s timed from the first token, the tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request(tag, ids, params)
    tokens: list[int] = []
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.token_ids:
                first = time.perf_counter()
            tokens.extend(output.token_ids)
    elapsed = time.perf_counter() - first
    return (len(tokens) - 1) / elapsed, tokens


def attention_us(config, context: int, rounds: int) -> dict[str, float]:
    """Median microseconds per layer of a decode step's attention for one row over
    `context` keys, every layer's cache read in turn (together they outgrow the CPU's
    caches, as a model's do), bf16 against int8 rows (kernels attend_rows on generated
    rows: the fused decoder's code)."""
    kernel = KERNEL.load()
    # One thread: on a shared host, waking a second one costs more than the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    slots = 2 * context
    generator = torch.Generator().manual_seed(0)
    shape = (2 * config.num_kv_heads, slots, config.head_dim)
    layers = {"bfloat16": [], "int8": []}
    for _ in range(config.num_layers):
        values = torch.randn(shape, generator=generator)
        layers["bfloat16"].append(values.to(torch.bfloat16))
        layers["int8"].append(quantize(values))
    # The context's blocks of 16 slots, in a shuffled order (as a block table leaves them).
    blocks = torch.randperm(slots // 16, generator=generator)[:-(-context // 16)]
    key_slots = (blocks[:, None] * 16 + torch.arange(16)).flatten()[:context]
    q = torch.randn(1, config.num_heads, config.head_dim, generator=generator)
    row = (torch.tensor([0]), torch.tensor([context - 1]), torch.tensor([0]))
    times: dict[str, list[float]] = {kv: [] for kv in layers}
    for _ in range(rounds):
        for kv, caches in layers.items():
            started = time.perf_counter()
            for _ in range(3):
                for cache in caches:
                    kernel.attend_rows(q, cache, key_slots, *row, config.scale, False)
            times[kv].append((time.perf_counter() - started) / (3 * len(caches)) * 1e6)
    torch.set_num_threads(threads)
    return {kv: round(statistics.median(values), 1) for kv, values in times.items()}


def measure(model: str, contexts: list[int], new_tokens: int, rounds: int,
            threads: int) -> dict:
    source = resolve_model(model)
    engines = {kv: Engine(EngineConfig(source=source, threads=threads,
                                       kv_cache_bytes=512 * 2**20, kv_cache_dtype=kv))
               for kv in DTYPES}
    bytes_per_token = {kv: kv_bytes_per_token(engine) for kv, engine in engines.items()}
    results = []
    for context in contexts:
        ids = prompt_ids(engines["bfloat16"], context)
        speeds: dict[str, list[float]] = {kv: [] for kv in DTYPES}
        outputs: dict[str, list[int]] = {}
        for round_index in range(rounds):
            for kv, engine in engines.items():
                speed, tokens = decode(engine, ids, new_tokens, f"{context}-{round_index}")
                speeds[kv].append(speed)
                outputs[kv] = tokens
        median = {kv: statistics.median(values) for kv, values in speeds.items()}
        results.append({
            "context_tokens": context,
            "decode_tok_s": {kv: round(median[kv], 2) for kv in DTYPES},
            "decode_tok_s_rounds": {kv: [round(v, 2) for v in speeds[kv]] for kv in DTYPES},
            "int8_over_bf16": round(median["int8"] / median["bfloat16"], 3),
            "same_greedy_tokens": outputs["int8"] == outputs["bfloat16"],
            "attention_us_per_layer": attention_us(engines["int8"].loaded.config, context,
                                                   max(rounds, 5)),
        })
    for engine in engines.values():
        engine.close()
    return {
        "model": model, "new_tokens": new_tokens, "rounds": rounds,
        "kv_bytes_per_token": {kv: round(b, 1) for kv, b in bytes_per_token.items()},
        "int8_bytes_over_bf16": round(bytes_per_token["int8"] / bytes_per_token["bfloat16"], 4),
        "contexts": results,
    }
