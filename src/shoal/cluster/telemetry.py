"""The telemetry plane: per-node readings, last writer wins, never event-sourced.

Every node publishes a NodeReading every `interval_s` (memory, CPU, disk of its data dir,
its GPUs' memory, its backends and API addresses) and keeps every node's latest in a
TelemetryTable. Which reading is newer is decided by the sender's own clock (`taken_at`, one
clock per node, so skew between nodes does not matter); liveness uses this node's monotonic
receive time, so a node silent for `timeout_s` counts as gone.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pydantic

from shoal.backend_names import DEFAULT_BACKEND
from shoal.cluster.background import cancel_and_wait
from shoal.cluster.held_models import HeldModel
from shoal.cluster.instances import Frozen
from shoal.cluster.placement import NodeCapacity, usable_device, usable_ram
from shoal.cluster.transport.base import Subscription, Transport
from shoal.cluster.transport.topics import Topic
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.telemetry")

# Device files whose presence makes it worth importing torch to read GPU memory.
_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/kfd")


class GpuReading(Frozen):
    index: int
    name: str
    memory_total: int
    memory_available: int


class NodeReading(Frozen):
    """One node's readings at `taken_at` (seconds since the epoch on that node's clock)."""

    node_id: NodeId
    taken_at: float
    name: str = ""
    addresses: tuple[str, ...] = ()  # API endpoints, host:port
    memory_total: int = 0
    memory_available: int = 0
    cpu_percent: float = 0.0
    cpu_count: int = 0
    disk_total: int = 0
    disk_free: int = 0
    gpus: tuple[GpuReading, ...] = ()
    # The backends this node runs (engine, llama-server, ...), and the devices each drives
    # as the backend itself lists them (empty: the CPU).
    backends: tuple[str, ...] = ()
    backend_devices: dict[str, tuple[str, ...]] = pydantic.Field(default_factory=dict)
    # The backends that keep their models in the accelerators' memory (`gpus`) here.
    device_backends: tuple[str, ...] = ()
    # What this node's models may hold in all (node_budget.py), in RAM and on its
    # accelerators; None: place on live memory.
    memory_budget: int | None = None
    device_budget: int | None = None
    max_loaded_models: int | None = None  # None: no limit
    # Requests waiting in this node's queue, per model.
    queue_depths: dict[str, int] = pydantic.Field(default_factory=dict)
    # Instances this node serves -> when their keep-alive unloads them (unix seconds; None:
    # in use, pinned or kept loaded).
    expiries: dict[str, float | None] = pydantic.Field(default_factory=dict)
    # The model files on this node's disk, with sizes and hashes (held_models.py).
    models: tuple[HeldModel, ...] = ()

    def capacity(self) -> NodeCapacity:
        """What placement may use here, live: usable RAM (shoal's engine keeps its models
        there), and the accelerators' usable memory for the backends that drive them."""
        return NodeCapacity(
            node_id=self.node_id,
            usable_bytes=usable_ram(self.memory_total, self.memory_available),
            holds=self.held_model_names(),
            backends=frozenset({DEFAULT_BACKEND, *self.backends}),
            device_bytes=self.usable_device_bytes(),
            device_backends=frozenset(self.device_backends))

    def usable_device_bytes(self) -> int:
        """The accelerators' memory a backend may still use (0 when none drives them)."""
        if not self.device_backends:
            return 0
        return sum(usable_device(g.memory_total, g.memory_available) for g in self.gpus)

    def held_model_names(self) -> frozenset[str]:
        """Every name (lower case) of the models whose files this node holds."""
        return frozenset(name.lower() for m in self.models for name in (m.model, *m.names))

    def held(self, name: str) -> HeldModel | None:
        return next((m for m in self.models if m.answers_to(name)), None)


@dataclass(frozen=True)
class TelemetryConfig:
    interval_s: float = 2.0
    # A node not heard from for this long is gone (the master then removes it).
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("telemetry interval_s must be positive")
        if self.timeout_s <= 2 * self.interval_s:
            raise ValueError(f"telemetry timeout_s must exceed two intervals "
                             f"({2 * self.interval_s:g}s)")


class TelemetryTable:
    """Latest reading and last-heard time per node. `now` is a monotonic time in seconds."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._readings: dict[NodeId, NodeReading] = {}
        self._heard: dict[NodeId, float] = {}

    def apply(self, reading: NodeReading, now: float) -> bool:
        """Record reading unless an equal or newer one from that node is already here.

        Any reading, even a stale one, proves the node is alive.
        """
        self._heard[reading.node_id] = max(now, self._heard.get(reading.node_id, now))
        current = self._readings.get(reading.node_id)
        if current is not None and current.taken_at >= reading.taken_at:
            return False
        self._readings[reading.node_id] = reading
        return True

    def reading(self, node: NodeId) -> NodeReading | None:
        return self._readings.get(node)

    def readings(self) -> dict[NodeId, NodeReading]:
        return dict(self._readings)

    def last_heard(self, node: NodeId) -> float | None:
        return self._heard.get(node)

    def is_alive(self, node: NodeId, now: float) -> bool:
        heard = self._heard.get(node)
        return heard is not None and now - heard <= self.timeout_s

    def live_nodes(self, now: float) -> frozenset[NodeId]:
        return frozenset(node for node in self._heard if self.is_alive(node, now))

    def silent_nodes(self, now: float) -> frozenset[NodeId]:
        return frozenset(node for node in self._heard if not self.is_alive(node, now))

    def forget(self, node: NodeId) -> None:
        self._readings.pop(node, None)
        self._heard.pop(node, None)

    def live_readings(self, nodes: Sequence[NodeId], now: float) -> list[NodeReading]:
        """The latest readings of the live nodes among `nodes` that have reported."""
        return [self._readings[n] for n in nodes
                if n in self._readings and self.is_alive(n, now)]


# -- reading this node ------------------------------------------------------------------------


def read_node(node_id: NodeId, data_dir: Path, name: str = "",
              addresses: Sequence[str] = (), backends: Sequence[str] = ()) -> NodeReading:
    """This machine's readings now (blocking for at most a few milliseconds without a GPU)."""
    memory = psutil.virtual_memory()
    disk = psutil.disk_usage(str(_existing_parent(data_dir)))
    return NodeReading(
        node_id=node_id, taken_at=time.time(), name=name, addresses=tuple(addresses),
        memory_total=memory.total, memory_available=memory.available,
        # interval=None: the usage since the previous call, without sleeping.
        cpu_percent=psutil.cpu_percent(interval=None), cpu_count=psutil.cpu_count() or 1,
        disk_total=disk.total, disk_free=disk.free, gpus=gpu_readings(),
        backends=tuple(backends))


def gpu_readings() -> tuple[GpuReading, ...]:
    """Memory of each GPU on this machine; () when there is none.

    NVIDIA's management library (NVML, through nvidia-ml-py) answers whatever the torch
    build is (shoal's own install is a CPU torch; llama-server brings its own CUDA); torch
    answers for other GPUs it drives (ROCm). Neither is touched on a machine without a GPU
    device file, so a CPU-only node never pays for loading them.
    """
    if not any(os.path.exists(path) for path in _GPU_DEVICE_FILES):
        return ()
    found = _nvml_readings()
    return found if found is not None else _torch_readings()


def _nvml_readings() -> tuple[GpuReading, ...] | None:
    """None when NVML is not there to ask (no NVIDIA driver, or not installed)."""
    pynvml = _nvml()
    if pynvml is None:
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(GpuReading(
                index=index, name=name.decode() if isinstance(name, bytes) else name,
                memory_total=int(memory.total), memory_available=int(memory.free)))
        return tuple(gpus)
    except pynvml.NVMLError as error:
        log.warning("NVML cannot read GPU memory: %s", error)
        return None


@functools.cache
def _nvml() -> Any:
    """nvidia-ml-py's pynvml, initialised once for the process (it keeps the driver's
    handle; initialising on every reading costs milliseconds); None where NVML cannot be
    had."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        log.debug("no NVML here: %s", error)
        return None
    return pynvml


def _torch_readings() -> tuple[GpuReading, ...]:
    torch = sys.modules.get("torch")
    if torch is None:
        if importlib.util.find_spec("torch") is None:
            return ()
        import torch
    try:
        if not torch.cuda.is_available():
            return ()
        gpus = []
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            gpus.append(GpuReading(index=index, name=torch.cuda.get_device_name(index),
                                   memory_total=int(total), memory_available=int(free)))
        return tuple(gpus)
    except RuntimeError as error:  # a driver problem must not stop telemetry
        log.warning("cannot read GPU memory: %s", error)
        return ()


def _existing_parent(path: Path) -> Path:
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# -- the driver ---------------------------------------------------------------------------


class Telemetry:
    """Publishes this node's reading every interval and keeps every node's in `table`."""

    def __init__(self, transport: Transport, config: TelemetryConfig | None = None, *,
                 read: Callable[[], NodeReading]) -> None:
        self._transport = transport
        self.config = config or TelemetryConfig()
        self.table = TelemetryTable(self.config.timeout_s)
        self._read = read
        self._task: asyncio.Task[None] | None = None
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._subscription = self._transport.subscribe(Topic.TELEMETRY, self._on_reading)
        self._task = asyncio.create_task(self._run(), name="telemetry")

    async def stop(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        await cancel_and_wait([self._task])
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                # A reading blocks (psutil, CUDA): off the loop, and bounded. asyncio.timeout,
                # not wait_for: on 3.11 wait_for can swallow a cancel racing the result.
                async with asyncio.timeout(self.config.interval_s):
                    reading = await asyncio.to_thread(self._read)
                self._transport.publish(Topic.TELEMETRY, reading.model_dump(mode="json"))
            except TimeoutError:
                log.warning("reading this node's telemetry took over %gs; skipped",
                            self.config.interval_s)
            except (OSError, pydantic.ValidationError) as error:
                log.warning("cannot read this node's telemetry: %s", error)
            await asyncio.sleep(self.config.interval_s)

    def _on_reading(self, message: Any) -> None:
        try:
            reading = NodeReading.model_validate(message)
        except pydantic.ValidationError as error:
            log.warning("malformed telemetry reading dropped: %s", error)
            return
        self.table.apply(reading, time.monotonic())
