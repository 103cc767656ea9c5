"""Telemetry: last-writer-wins readings, liveness timeouts, real readings of this machine."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from cluster_waits import wait_until

from shoal.cluster.telemetry import (
    GpuReading,
    NodeReading,
    Telemetry,
    TelemetryConfig,
    TelemetryTable,
    gpu_readings,
    read_node,
)
from shoal.cluster.transport import MemoryHub, Topic
from shoal.ids import NodeId

GIB = 2**30


def _reading(node: str, taken_at: float, available: int = 4 * GIB, **extra) -> NodeReading:
    return NodeReading(node_id=NodeId(node), taken_at=taken_at, memory_total=8 * GIB,
                       memory_available=available, **extra)


def test_last_writer_wins_by_the_senders_clock():
    table = TelemetryTable(timeout_s=5)
    assert table.apply(_reading("a", taken_at=100.0, available=1 * GIB), now=10)
    assert not table.apply(_reading("a", taken_at=99.0, available=2 * GIB), now=11)
    assert table.reading(NodeId("a")).memory_available == 1 * GIB
    # The stale reading still proves the node alive.
    assert table.last_heard(NodeId("a")) == 11
    assert table.apply(_reading("a", taken_at=101.0, available=3 * GIB), now=12)
    assert table.reading(NodeId("a")).memory_available == 3 * GIB


def test_silent_nodes_time_out():
    table = TelemetryTable(timeout_s=5)
    table.apply(_reading("a", 1.0), now=0)
    table.apply(_reading("b", 1.0), now=3)
    assert table.live_nodes(now=5) == {"a", "b"}
    assert table.live_nodes(now=6) == {"b"} and table.silent_nodes(now=6) == {"a"}
    assert [r.node_id for r in table.live_readings([NodeId("a"), NodeId("b")], now=6)] == ["b"]
    table.forget(NodeId("a"))
    assert table.silent_nodes(now=6) == frozenset() and table.reading(NodeId("a")) is None


def test_capacity_is_ram_unless_a_backend_drives_the_gpu():
    gpu = GpuReading(index=0, name="fake", memory_total=16 * GIB, memory_available=10 * GIB)
    # shoal's engine runs in RAM: a GPU no backend drives adds nothing to place on.
    engine_only = _reading("a", 1.0, gpus=(gpu,), available=4 * GIB).capacity()
    assert (engine_only.usable_bytes, engine_only.device_bytes) == (4 * GIB, 0)
    offloading = _reading("a", 1.0, gpus=(gpu,), available=4 * GIB,
                          backends=("engine", "llama-server"),
                          device_backends=("llama-server",)).capacity()
    assert (offloading.usable_bytes, offloading.device_bytes) == (4 * GIB, 10 * GIB)
    assert offloading.for_backend("llama-server").usable_bytes == 14 * GIB
    assert offloading.for_backend("engine").usable_bytes == 4 * GIB


def test_reading_this_machine(tmp_path):
    torch_was_loaded = "torch" in sys.modules
    reading = read_node(NodeId("me"), tmp_path / "not" / "yet", name="me",
                        addresses=("127.0.0.1:8470",), backends=("torch-cpu",))
    assert 0 < reading.memory_available <= reading.memory_total
    assert 0 < reading.disk_free <= reading.disk_total and reading.cpu_count >= 1
    assert reading.backends == ("torch-cpu",) and abs(reading.taken_at - time.time()) < 5
    assert NodeReading.model_validate(reading.model_dump(mode="json")) == reading
    if not torch_was_loaded:
        assert gpu_readings() == ()  # no GPU device here: torch is not imported for nothing
        assert "torch" not in sys.modules


def test_nodes_share_readings_and_a_silent_node_times_out():
    config = TelemetryConfig(interval_s=0.05, timeout_s=0.2)

    async def main():
        hub = MemoryHub()
        nodes = {}
        for name in ("a", "b"):
            transport = hub.connect(name)
            nodes[name] = Telemetry(transport, config,
                                    read=lambda name=name: _reading(name, time.time()))
            await nodes[name].start()
        table = nodes["a"].table
        try:
            await wait_until(lambda: table.live_nodes(time.monotonic()) == {"a", "b"})
            hub.connect("c").publish(Topic.TELEMETRY, {"node_id": "c"})  # malformed: dropped
            await nodes["b"].stop()
            took = await wait_until(
                lambda: table.silent_nodes(time.monotonic()) == {"b"}, what="b times out")
            return took, table.reading(NodeId("c"))
        finally:
            for telemetry in nodes.values():
                await telemetry.stop()

    took, c_reading = asyncio.run(main())
    assert took <= config.timeout_s + 0.5  # slack for a loaded machine
    assert c_reading is None


def test_config_is_validated():
    with pytest.raises(ValueError, match="two intervals"):
        TelemetryConfig(interval_s=1, timeout_s=1.5)
