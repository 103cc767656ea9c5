"""Accelerator memory: what a backend that drives a node's GPUs holds there, how the node's
budgets count it, and where placement puts such a model (llama.cpp's offload: on the GPU
while it has room, the rest in RAM)."""

from __future__ import annotations

import sys
import types

from state_builders import GIB, facts, single

from shoal.cluster import telemetry
from shoal.cluster.instances import PlacementRequest
from shoal.cluster.node_budget import Accelerators, holdings, node_capacity
from shoal.cluster.placement import PlacementError, PlacementPolicy, place, shard_bytes
from shoal.cluster.state import ClusterState, RunnerStatus
from shoal.cluster.telemetry import GpuReading, NodeReading
from shoal.runner.llama_server.buffers import DeviceBuffers

POLICY = PlacementPolicy(overhead_factor=1.0, kv_reservation_tokens=0, floor_bytes=0,
                         generation_floor_bytes=0)
SERVED = ("engine", "llama-server")


def served_by_llama_server(instance_id: str, on: str, weight_gib: float):
    instance = single(instance_id, on, facts(model=instance_id,
                                             weight_bytes=int(weight_gib * GIB)))
    request = instance.request.model_copy(update={"backend": "llama-server"})
    return instance.model_copy(update={"request": request})


def gpu_node(ram_gib: float, gpu_gib: float, budget_gib: float | None = None,
             device_budget_gib: float | None = None) -> NodeReading:
    gpu = GpuReading(index=0, name="H", memory_total=int(gpu_gib * GIB) * 2,
                     memory_available=int(gpu_gib * GIB))
    return NodeReading(
        node_id="g", taken_at=0.0, memory_total=int(ram_gib * GIB) * 2,
        memory_available=int(ram_gib * GIB), gpus=(gpu,), backends=SERVED,
        device_backends=("llama-server",),
        memory_budget=None if budget_gib is None else int(budget_gib * GIB),
        device_budget=None if device_budget_gib is None else int(device_budget_gib * GIB))


def test_an_estimate_goes_to_the_gpu_while_it_has_room_and_the_rest_to_ram():
    first, second = served_by_llama_server("a", "g", 6), served_by_llama_server("b", "g", 6)
    engine = single("c", "g", facts(model="c", weight_bytes=2 * GIB))
    state = ClusterState(instances={i.instance_id: i for i in (first, second, engine)})
    devices = Accelerators(budget=10 * GIB, backends=frozenset({"llama-server"}))
    held = {h.instance.instance_id: h for h in holdings(state, "g", POLICY, devices)}
    needed = {i.instance_id: shard_bytes(i.facts, i.facts.n_layers, 1, POLICY)
              for i in (first, second, engine)}
    assert (held["a"].device_bytes, held["a"].bytes) == (needed["a"], 0)
    # The second finds the GPU's room short: what is left spills to RAM, as llama.cpp
    # keeps the layers it cannot offload on the CPU.
    assert held["b"].device_bytes == 10 * GIB - needed["a"]
    assert held["b"].total_bytes == needed["b"]
    # shoal's engine runs in RAM whatever the node's GPUs.
    assert (held["c"].bytes, held["c"].device_bytes) == (needed["c"], 0)
    # Without the node's accelerators counted, every byte is RAM (as before).
    assert all(h.device_bytes == 0 for h in holdings(state, "g", POLICY))


def test_a_measured_model_counts_the_buffers_it_reported():
    served = served_by_llama_server("a", "g", 6)
    rank = served.ranks[0]
    status = RunnerStatus(runner_id=rank.runner_id, instance_id="a", node_id="g",
                          phase="ready", memory_bytes=GIB // 2, device_bytes=7 * GIB)
    state = ClusterState(instances={"a": served}, runners={rank.runner_id: status})
    capacity = node_capacity(gpu_node(ram_gib=8, gpu_gib=24, budget_gib=8,
                                      device_budget_gib=20), state, POLICY)
    assert capacity.usable_bytes == 8 * GIB - GIB // 2
    assert capacity.device_bytes == 13 * GIB
    assert capacity.device_backends == frozenset({"llama-server"})


def test_placement_gives_a_gpu_backend_the_gpu_and_the_engine_ram():
    reading = gpu_node(ram_gib=4, gpu_gib=40, budget_gib=4, device_budget_gib=40)
    roomy_ram = NodeReading(node_id="r", taken_at=0.0, memory_total=64 * GIB,
                            memory_available=32 * GIB, backends=SERVED, memory_budget=32 * GIB)
    nodes = [node_capacity(r, ClusterState(), POLICY) for r in (reading, roomy_ram)]
    big = facts(model="big", weight_bytes=38 * GIB)  # over 4 + 32 GiB of RAM in all
    on_gpu = place(PlacementRequest(facts=big, backend="llama-server"), nodes, POLICY)
    assert on_gpu.shards[0].node_id == "g"
    # The same model for shoal's engine needs RAM: the GPU node has 4 GiB of it.
    small = facts(model="small", weight_bytes=3 * GIB)
    assert place(PlacementRequest(facts=small), nodes, POLICY).shards[0].node_id == "r"
    refused = place(PlacementRequest(facts=big), nodes, POLICY)
    assert isinstance(refused, PlacementError) and "usable" in refused.reason


# -- llama-server's own account of its device buffers -------------------------------------

# As builds print them: bare, or after a timestamp and a level letter (newer builds, at
# --log-verbosity 4).
LOAD_LOG = """\
load_tensors: offloading 24 repeating layers to GPU
0.00.049.810 I load_tensors:        CUDA0 model buffer size =   512.50 MiB
0.00.049.822 I load_tensors:   CPU_Mapped model buffer size =    40.00 MiB
llama_context:  CUDA_Host  output buffer size =     0.58 MiB
llama_kv_cache:        CUDA0 KV buffer size =   192.00 MiB
sched_reserve:      CUDA0 compute buffer size =   300.75 MiB
sched_reserve:  CUDA_Host compute buffer size =    20.01 MiB
"""


def test_device_buffers_add_what_llama_server_put_on_its_devices():
    buffers = DeviceBuffers(["CUDA0"])
    for line in LOAD_LOG.splitlines():
        buffers.read(line)
    assert buffers.total_bytes == int((512.50 + 192.00 + 300.75) * 2**20)
    # A compute buffer reserved again replaces the first, never adds to it.
    buffers.read("sched_reserve:      CUDA0 compute buffer size =   100.75 MiB")
    assert buffers.total_bytes == int((512.50 + 192.00 + 100.75) * 2**20)
    buffers.reset()  # a new process
    assert buffers.total_bytes == 0
    cpu_build = DeviceBuffers([])
    for line in LOAD_LOG.splitlines():
        cpu_build.read(line)
    assert cpu_build.total_bytes is None


def test_nvml_readings_give_each_gpus_memory(monkeypatch):
    """The NVML path as nvidia-ml-py answers (a fake module: this host has no GPU)."""
    calls = []
    fake = types.ModuleType("pynvml")
    fake.NVMLError = type("NVMLError", (Exception,), {})
    fake.nvmlInit = lambda: calls.append("init")
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda index: index
    fake.nvmlDeviceGetName = lambda handle: [b"NVIDIA H200", "NVIDIA L4"][handle]
    fake.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(
        total=(141 - 117 * handle) * GIB, free=(140 - 117 * handle) * GIB, used=GIB)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(telemetry, "_GPU_DEVICE_FILES", ("/",))
    telemetry._nvml.cache_clear()
    gpus = telemetry.gpu_readings()
    assert [(g.index, g.name, g.memory_total, g.memory_available) for g in gpus] == [
        (0, "NVIDIA H200", 141 * GIB, 140 * GIB), (1, "NVIDIA L4", 24 * GIB, 23 * GIB)]
    assert telemetry.gpu_readings() == gpus
    assert calls == ["init"]  # once for the process

    def no_driver():
        raise fake.NVMLError("Driver Not Loaded")

    fake.nvmlInit = no_driver
    monkeypatch.setattr(telemetry, "_torch_readings", lambda: ())
    telemetry._nvml.cache_clear()
    assert telemetry.gpu_readings() == ()
    telemetry._nvml.cache_clear()
