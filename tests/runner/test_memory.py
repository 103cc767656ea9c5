"""The runner's memory report: measured from the engine, sent when it changes (or as a
heartbeat), and kept by the supervisor (fake engines; the last test spawns a runner)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from fake_embedding import FakeEmbeddingEngine, fake_embedding_source
from fakes import (
    KV_BYTES_PER_BLOCK,
    KV_NUM_BLOCKS,
    WEIGHT_BYTES,
    FakeEngine,
    FakeKVEngine,
    fake_engine_config,
    fake_supervisor_options,
)

from shoal.engine.config import EngineConfig
from shoal.engine.sampling import SamplingParams
from shoal.protocol import GenerationRequest
from shoal.runner import memory
from shoal.runner.memory import MemoryReporter, kv_blocks, worth_sending
from shoal.runner.messages import MemoryUsage, parse_from_runner, to_wire
from shoal.runner.supervisor import RunnerSupervisor


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reporter(engine, rss=lambda: 7_000_000):
    sent: list[MemoryUsage] = []
    clock = Clock()
    return MemoryReporter(engine, sent.append, clock=clock, rss=rss), sent, clock


def add(engine, request_id: str, prompt: str) -> None:
    ids = engine.tokenizer.encode(prompt)
    engine.add_request(request_id, ids, SamplingParams())


def test_worth_sending_on_first_change_or_heartbeat():
    base = MemoryUsage(weights_bytes=10, kv_bytes_in_use=0, kv_bytes_capacity=64,
                       rss_bytes=100 * 2**20)
    assert worth_sending(None, base, 0.0)
    assert not worth_sending(base, base, memory.HEARTBEAT_S - 0.1)
    assert worth_sending(base, base, memory.HEARTBEAT_S)
    assert worth_sending(base, base.model_copy(update={"kv_bytes_in_use": 16}), 0.1)
    small = base.model_copy(update={"rss_bytes": base.rss_bytes + memory.RSS_STEP_BYTES - 1})
    assert not worth_sending(base, small, 0.1)
    big = base.model_copy(update={"rss_bytes": base.rss_bytes - memory.RSS_STEP_BYTES})
    assert worth_sending(base, big, 0.1)
    assert worth_sending(base, base.model_copy(update={"rss_bytes": None}), 0.1)


def test_kv_blocks_from_engine_stats():
    assert kv_blocks({"kv_blocks_used": 3, "kv_blocks_total": 10,
                      "num_running": 1}) == (3, 0, 10, None)
    assert kv_blocks({"kv_blocks_used": 3, "kv_blocks_cached": 4, "kv_blocks_total": 10,
                      "kv_blocks_granted": 6}) == (3, 4, 10, 6)
    assert kv_blocks({"num_running": 1}) is None


def test_the_footprint_counts_granted_kv_not_yet_touched_never_the_capacity():
    usage = MemoryUsage(rss_bytes=100, kv_bytes_in_use=10, kv_bytes_cached=5,
                        kv_bytes_granted=40, kv_bytes_capacity=10**9)
    assert usage.footprint_bytes == 100 + 40 - 15
    assert usage.model_copy(update={"kv_bytes_granted": None}).footprint_bytes == 100


def test_held_bytes_is_weights_plus_kv_in_use():
    assert MemoryUsage(weights_bytes=10, kv_bytes_in_use=5).held_bytes == 15
    assert MemoryUsage(weights_bytes=10).held_bytes == 10
    assert MemoryUsage(kv_bytes_in_use=5, rss_bytes=1).held_bytes is None
    wire = to_wire(MemoryUsage(weights_bytes=1, rss_bytes=2))
    assert parse_from_runner(wire) == MemoryUsage(weights_bytes=1, rss_bytes=2)


def test_report_follows_blocks_used_and_freed(tmp_path):
    engine = FakeKVEngine(fake_engine_config(tmp_path))
    memory_reporter, sent, clock = reporter(engine)
    memory_reporter.report()
    assert sent == [MemoryUsage(weights_bytes=WEIGHT_BYTES, kv_bytes_in_use=0,
                                kv_bytes_cached=0,
                                kv_bytes_capacity=KV_NUM_BLOCKS * KV_BYTES_PER_BLOCK,
                                rss_bytes=7_000_000)]
    add(engine, "a", "one two three four five")  # 5 tokens: 2 blocks of 4
    memory_reporter.maybe_report()
    assert len(sent) == 1  # not due yet
    assert memory_reporter.seconds_until_due() == memory.CHECK_INTERVAL_S
    clock.now += memory.CHECK_INTERVAL_S
    memory_reporter.maybe_report()
    assert sent[-1].kv_bytes_in_use == 2 * KV_BYTES_PER_BLOCK
    assert sent[-1].held_bytes == WEIGHT_BYTES + 2 * KV_BYTES_PER_BLOCK
    clock.now += memory.CHECK_INTERVAL_S
    memory_reporter.maybe_report()
    assert len(sent) == 2  # nothing changed: nothing sent
    engine.abort_request("a")
    engine.step()
    clock.now += memory.CHECK_INTERVAL_S
    memory_reporter.maybe_report()
    assert len(sent) == 3 and sent[-1].kv_bytes_in_use == 0
    clock.now += memory.HEARTBEAT_S
    memory_reporter.maybe_report()
    assert len(sent) == 4 and sent[-1] == sent[-2]  # the heartbeat


def test_engines_that_cannot_tell_report_what_is_known(tmp_path):
    plain, sent, _ = reporter(FakeEngine(fake_engine_config(tmp_path)))  # stats, no KV pool
    plain.report()
    assert sent == [MemoryUsage(rss_bytes=7_000_000)] and sent[0].held_bytes is None
    embedder = FakeEmbeddingEngine(EngineConfig(source=fake_embedding_source(tmp_path)))
    embeds, sent, _ = reporter(embedder)  # weights, no KV cache at all
    embeds.report()
    assert sent == [MemoryUsage(weights_bytes=1234, rss_bytes=7_000_000)]


def test_a_figure_that_fails_is_unknown_and_the_rest_still_reported(tmp_path):
    engine = FakeKVEngine(fake_engine_config(tmp_path))

    def broken_stats():
        raise RuntimeError("no stats today")

    engine.stats = broken_stats
    broken, sent, _ = reporter(engine, rss=lambda: 1 // 0)
    broken.report()
    assert sent == [MemoryUsage(weights_bytes=WEIGHT_BYTES)]


def test_supervisor_keeps_the_runner_s_latest_report(tmp_path):
    """Known once the runner is ready, updated as a request holds and frees KV blocks,
    forgotten when the runner stops."""

    async def wait_for(supervisor, condition, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while not condition(supervisor.memory):
            assert time.monotonic() < deadline, f"memory stayed {supervisor.memory}"
            await asyncio.sleep(0.05)
        return supervisor.memory

    async def main():
        supervisor = RunnerSupervisor(fake_engine_config(tmp_path), fake_supervisor_options(
            fake_engine="kv"))
        try:
            await supervisor.start()
            loaded = supervisor.memory
            stream = supervisor.submit(GenerationRequest(
                request_id="a", model="fake-model", prompt="FOREVER SLOW",
                sampling=SamplingParams()))
            assert (await anext(stream)).kind == "accepted"
            busy = await wait_for(supervisor, lambda m: m.kv_bytes_in_use > 0)
            await stream.aclose()  # cancels the request: its blocks are freed
            idle = await wait_for(supervisor, lambda m: m.kv_bytes_in_use == 0)
            described = supervisor.describe()
        finally:
            await supervisor.shutdown()
        return loaded, busy, idle, described, supervisor.memory

    loaded, busy, idle, described, after = asyncio.run(main())
    assert loaded.weights_bytes == WEIGHT_BYTES and loaded.kv_bytes_in_use == 0
    assert loaded.kv_bytes_capacity == KV_NUM_BLOCKS * KV_BYTES_PER_BLOCK
    assert loaded.rss_bytes > 0
    assert busy.kv_bytes_in_use % KV_BYTES_PER_BLOCK == 0
    assert idle.weights_bytes == WEIGHT_BYTES
    assert described["size_bytes"] == idle.footprint_bytes == idle.rss_bytes  # no grant
    assert after is None


@pytest.mark.skipif(memory._TRIM is None, reason="the C library has no malloc_trim (not glibc)")
def test_freed_heap_pages_go_back_to_the_system():
    import ctypes

    import psutil

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 KiB chunks (below glibc's mmap threshold: they live in the heap), touched, every
    # other one freed: the freed ones cannot merge with each other or the heap's top, so
    # free() alone gives none back (as with a step's buffers among longer-lived objects).
    chunks = [libc.malloc(64 * 1024) for _ in range(2048)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, 64 * 1024)
    for chunk in chunks[::2]:
        libc.free(chunk)
    process = psutil.Process()
    before = process.memory_info().rss
    memory.return_freed_heap()
    after = process.memory_info().rss
    for chunk in chunks[1::2]:
        libc.free(chunk)
    assert before - after > 48 * 2**20  # of the 64 MiB freed


def test_loading_maps_large_blocks_then_serving_gets_the_usual_threshold(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_MALLOPT", lambda *args: calls.append(("mallopt", *args)))
    monkeypatch.setattr(memory, "return_freed_heap", lambda: calls.append(("trim",)))
    with pytest.raises(RuntimeError), memory.loading_heap():
        calls.append(("load",))
        raise RuntimeError("the load failed")  # the heap is restored all the same
    assert calls == [("mallopt", -3, memory.LOADING_MMAP_THRESHOLD), ("load",),
                     ("mallopt", -3, memory.SERVING_MMAP_THRESHOLD),
                     ("mallopt", -1, memory.SERVING_TRIM_THRESHOLD), ("trim",)]


# In a fresh interpreter (its heap untouched by other tests): after loading, an 8 MiB step
# buffer freed at the heap's top keeps its pages, so the next op does not fault them in
# again; the idle-time trim still hands them back.
_FREED_TOP = """
import ctypes, psutil
from shoal.runner import memory
with memory.loading_heap():
    pass
libc, process = ctypes.CDLL(None), psutil.Process()
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size = 8 * 2**20
buffer = libc.malloc(size)
ctypes.memset(buffer, 1, size)
held = process.memory_info().rss
libc.free(buffer)
after_free = process.memory_info().rss
memory.return_freed_heap()
after_trim = process.memory_info().rss
print(held - after_free, held - after_trim)
"""


@pytest.mark.skipif(memory._MALLOPT is None, reason="glibc's malloc tuning is absent")
def test_serving_keeps_freed_step_buffers_until_the_runner_goes_idle():
    result = subprocess.run([sys.executable, "-c", _FREED_TOP], capture_output=True,
                            text=True, timeout=60, check=True)
    dropped_at_free, dropped_at_trim = map(int, result.stdout.split())
    assert dropped_at_free < 2**20
    assert dropped_at_trim > 6 * 2**20
