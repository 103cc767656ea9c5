"""Run a function as several ranks, each in its own spawned process, and collect results.

The function gets (rank, world_size, port, *args) and returns something picklable; an
exception becomes ("error", message). Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve_process import free_port

from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.parallel.config import ParallelConfig
from shoal.engine.parallel.follower import FollowerEngine


def _entry(target, rank, world_size, port, args, results) -> None:
    try:
        results.put((rank, target(rank, world_size, port, *args)))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        results.put((rank, ("error", f"{type(error).__name__}: {error}")))


def run_ranks(target: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = 120.0, ranks: list[int] | None = None,
              expect: list[int] | None = None) -> dict[int, Any]:
    """{rank: result} of target run as each of `ranks` (default: all) of world_size;
    waits for results from `expect` only (default: every rank started)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_entry, args=(target, rank, world_size, port, args,
                                                  results), daemon=True)
             for rank in (ranks if ranks is not None else range(world_size))]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    try:
        for _ in (expect if expect is not None else procs):
            rank, value = results.get(timeout=timeout_s)
            collected[rank] = value
    except queue.Empty:
        raise AssertionError(f"ranks did not finish within {timeout_s} s: got "
                             f"{sorted(collected)}") from None
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return collected


def split_config(rank: int, world: int, port: int, path: str, sharding: str,
                 layers: list[tuple[int, int]], **fields: Any) -> EngineConfig:
    """A float32, one-thread EngineConfig for `rank` of a model split as `layers` says."""
    parallel = ParallelConfig(rank=rank, world_size=world, sharding=sharding,
                              layer_start=layers[rank][0], layer_end=layers[rank][1],
                              master_addr="127.0.0.1", master_port=port)
    return EngineConfig(source=ModelSource("m", "gguf", Path(path)), dtype="float32",
                        threads=1, kv_cache_bytes=32 * 2**20, parallel=parallel, **fields)


def follow(config: EngineConfig) -> int:
    """Serve as a rank other than 0 until rank 0 shuts the instance down: its step count."""
    follower = FollowerEngine(config)
    follower.run()
    return follower.steps
