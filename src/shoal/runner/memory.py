"""What a runner holds in memory, read from its engine, and when to tell the supervisor.

Weights come from the engine (`weight_bytes()`); the KV cache in use, kept resident and
granted is the scheduler's blocks (`stats()`) times the bytes one block takes over this
rank's layers (`kv_bytes_per_block()`); resident memory is the runner process's own
(private_resident_bytes). An engine that cannot tell a figure leaves it None. Measuring
never raises into the loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from shoal.engine.core import EngineCore
from shoal.runner.messages import MemoryUsage

log = logging.getLogger("shoal.runner")

CHECK_INTERVAL_S = 2.0  # how often the loop measures
HEARTBEAT_S = 10.0  # a report goes out at least this often, changed or not
RSS_STEP_BYTES = 4 * 2**20  # smaller RSS moves are noise, not a change worth a report


def kv_blocks(stats: dict[str, Any]) -> tuple[int, int, int, int | None] | None:
    """(blocks in use, free blocks kept resident, blocks in all, blocks granted or None)
    from engine.stats(); None if it has no block pool."""
    used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
    if not isinstance(used, int) or not isinstance(total, int):
        return None
    cached, granted = stats.get("kv_blocks_cached"), stats.get("kv_blocks_granted")
    return (used, cached if isinstance(cached, int) else 0, total,
            granted if isinstance(granted, int) else None)


def worth_sending(last: MemoryUsage | None, now: MemoryUsage, since_sent_s: float) -> bool:
    """A report is due when it is the first, the heartbeat is due, or a figure moved."""
    if last is None or since_sent_s >= HEARTBEAT_S:
        return True
    figures = ("weights_bytes", "kv_bytes_in_use", "kv_bytes_cached", "kv_bytes_capacity",
               "kv_bytes_granted")
    if any(getattr(last, name) != getattr(now, name) for name in figures):
        return True
    if last.rss_bytes is None or now.rss_bytes is None:
        return last.rss_bytes != now.rss_bytes
    return abs(now.rss_bytes - last.rss_bytes) >= RSS_STEP_BYTES


class MemoryReporter:
    """Measures the engine every CHECK_INTERVAL_S (when the loop asks) and sends a
    MemoryUsage when worth_sending says so. Runs on the loop's thread, between steps."""

    def __init__(self, engine: EngineCore, send: Callable[[MemoryUsage], None],
                 clock: Callable[[], float] = time.monotonic,
                 rss: Callable[[], int] | None = None) -> None:
        self._engine = engine
        self._send = send
        self._clock = clock
        self._rss = rss or _own_rss()
        self._per_block: int | None = None
        self._per_block_known = False
        self._last: MemoryUsage | None = None
        self._sent_at = 0.0
        self._next_check = 0.0
        self._warned = False

    def seconds_until_due(self) -> float:
        return max(0.0, self._next_check - self._clock())

    def maybe_report(self) -> None:
        """Measure if a check is due; send if worth it. Cheap when not due."""
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        usage = self.measure()
        if worth_sending(self._last, usage, now - self._sent_at):
            self._emit(usage, now)

    def report(self) -> None:
        """Measure and send now (right after load)."""
        now = self._clock()
        self._next_check = now + CHECK_INTERVAL_S
        self._emit(self.measure(), now)

    def measure(self) -> MemoryUsage:
        in_use, cached, capacity, granted = self._read(self._kv_bytes, (None,) * 4)
        return MemoryUsage(weights_bytes=self._read(self._engine.weight_bytes, None),
                           kv_bytes_in_use=in_use, kv_bytes_cached=cached,
                           kv_bytes_capacity=capacity, kv_bytes_granted=granted,
                           rss_bytes=self._read(self._rss, None))

    def _read(self, read: Callable[[], Any], unknown: Any) -> Any:
        try:
            return read()
        except Exception:  # noqa: BLE001 - a figure is not worth the runner
            if not self._warned:
                log.exception("measuring the runner's memory failed; that figure is unknown")
            self._warned = True
            return unknown

    def _kv_bytes(self) -> tuple[int | None, ...]:
        per_block = self._bytes_per_block()
        blocks = kv_blocks(self._engine.stats()) if per_block is not None else None
        if blocks is None or per_block is None:
            return None, None, None, None
        used, cached, total, granted = blocks
        return (used * per_block, cached * per_block, total * per_block,
                None if granted is None else granted * per_block)

    def _bytes_per_block(self) -> int | None:
        if not self._per_block_known:  # constant for the engine's life
            self._per_block_known = True
            self._per_block = self._engine.kv_bytes_per_block()
        return self._per_block

    def _emit(self, usage: MemoryUsage, now: float) -> None:
        self._send(usage)
        self._last, self._sent_at = usage, now


def _glibc(name: str) -> Callable[..., object] | None:
    try:
        return getattr(ctypes.CDLL(None), name)  # other C libraries lack these
    except (OSError, AttributeError):
        return None


_TRIM = _glibc("malloc_trim")
_MALLOPT = _glibc("mallopt")
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
LOADING_MMAP_THRESHOLD = 2**20
SERVING_MMAP_THRESHOLD = 32 * 2**20  # where glibc's own adaptive threshold ends up
# glibc's adaptive rule keeps the trim threshold at twice the mmap threshold; setting the
# mmap threshold by hand freezes the trim threshold at its 128 KiB start instead, and then
# every free of a step buffer at the heap's top hands its pages back, to be faulted in
# again by the next op (torch's topk over a [16, 151936] head took 2.0-2.5 ms instead of
# 1.0; a runner's batch-16 decode steps ran ~20% slower than the same engine elsewhere).
SERVING_TRIM_THRESHOLD = 2 * SERVING_MMAP_THRESHOLD


def return_freed_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim(0)). A burst of
    steps leaves tens of MB of freed activation buffers in the heap (Qwen2.5-Coder-0.5B:
    +43 MB of RSS after 16 concurrent requests, all of it free); the runner calls this once
    when it goes idle, so RSS returns to weights + KV + floor. A few ms; a no-op without
    glibc."""
    if _TRIM is not None:
        _TRIM(0)


@contextlib.contextmanager
def loading_heap() -> Iterator[None]:
    """Load with every allocation of 1 MiB or more in its own mapping, then serve with
    glibc's usual 32 MiB threshold, the loader's leftovers handed back. With glibc's
    adaptive threshold, loading's scratch (dequantized blocks, file reads) and the packed
    weights shared the heap, and the runner of Qwen2.5-Coder-1.5B held 1.58-1.98 GB after
    load from run to run (its weights: 1.28 GB); with this, 1.58 GB every time. Mapped
    buffers cost page faults on every use, so steps get the large thresholds back (the
    heap's free top is handed back when the runner goes idle: return_freed_heap)."""
    if _MALLOPT is not None:
        _MALLOPT(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if _MALLOPT is not None:
            _MALLOPT(_M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
            _MALLOPT(_M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD)
        return_freed_heap()


def private_resident_bytes(pid: int | str = "self") -> int:
    """What a process holds resident on its own: its anonymous and shared-memory pages
    (heap, weights, KV blocks touched), from /proc/<pid>/status. The pages of shared
    libraries and mapped files are left out: the page cache shares them between runners
    (torch's libraries are ~95 MB of every runner's RSS, one copy in memory) and can drop
    them, and how many of them a process maps varies by host (large file folios map
    whole 2 MB pieces of libtorch). Where /proc is not there, the whole RSS."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return sum(int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssShmem"))
    except (OSError, KeyError, ValueError):
        process = psutil.Process() if pid == "self" else psutil.Process(int(pid))
        return int(process.memory_info().rss)


def _own_rss() -> Callable[[], int]:
    return private_resident_bytes
