"""A GPU build of llama-server as shoal's backend on a machine with an NVIDIA GPU (marked
gpu: only where one is). The node reads the GPU through NVML and says llama-server drives
it; a model llama-server offloads counts its GPU buffers in the node's accelerator budget,
in /api/ps (size_vram), /cluster (device_held) and /metrics, and NVML's own count of used
memory grew by at least as much; shoal's engine on the same node (whatever torch the
machine has) serves from RAM beside it. The binary: SHOAL_TEST_LLAMA_SERVER, else the CUDA
build make test's install step makes where nvcc is (tests/llama_server_build.py --cuda),
else llama-server on PATH."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from random_gguf import write_random_llama_gguf

from shoal.cluster import telemetry
from shoal.config import (
    BackendSettings,
    ClusterSettings,
    EngineDefaults,
    NodeConfig,
    PoolSettings,
    ServerConfig,
)
from shoal.node import BackgroundNode
from shoal.pool.queue import QueueLimits
from shoal.runner.llama_server.binary import probe

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

OFFLOADED = "random-llama-gpu"  # ~1.6 GB of F16 weights, every layer on the GPU
IN_RAM = "random-llama-ram"  # a small one for shoal's engine
CONTEXT = 4096


@pytest.fixture(scope="module")
def gpu_binary():
    from llama_server_build import cached_binary

    named = (os.environ.get("SHOAL_TEST_LLAMA_SERVER") or cached_binary(cuda=True)
             or shutil.which("llama-server"))
    if named is None:
        pytest.fail("no llama-server built for the GPU: make test builds one where nvcc is "
                    "(tests/llama_server_build.py --cuda), or name one in "
                    "SHOAL_TEST_LLAMA_SERVER")
    binary = probe(Path(named))
    if not binary.devices:
        pytest.fail(f"{named} drives no GPU (a CPU build): name a GPU build in "
                    "SHOAL_TEST_LLAMA_SERVER")
    return binary


def gpu_used_bytes() -> int:
    return sum(g.memory_total - g.memory_available for g in telemetry.gpu_readings())


@pytest.fixture(scope="module")
def node(tmp_path_factory, gpu_binary):
    tmp = tmp_path_factory.mktemp("gpu-node")
    offloaded = tmp / f"{OFFLOADED}.gguf"
    weights = write_random_llama_gguf(offloaded, hidden=2048, layers=16, ffn=5632, heads=16)
    in_ram = tmp / f"{IN_RAM}.gguf"
    write_random_llama_gguf(in_ram, hidden=256, layers=2, ffn=512, heads=4)
    used_before = gpu_used_bytes()
    config = NodeConfig(
        server=ServerConfig(port=0), models=(str(offloaded), str(in_ram)), data_dir=tmp,
        cluster=ClusterSettings(standalone=True),
        engine=EngineDefaults(max_model_len=CONTEXT, threads=4),
        pool=PoolSettings(queue=QueueLimits(parallel=4)),
        backends=BackendSettings(llama_server=gpu_binary.path,
                                 assigned=((OFFLOADED, "llama-server"), (IN_RAM, "engine"))))
    background = BackgroundNode(config, start_timeout_s=600)
    background.start()
    yield {"url": background.url, "weights": weights, "used_before": used_before}
    background.stop()


def test_the_node_reads_its_gpu_and_llama_server_drives_it(node):
    (info,) = httpx.get(node["url"] + "/cluster").json()["nodes"]
    print("node:", {k: info[k] for k in ("gpus", "device_budget", "device_held",
                                         "memory_budget", "memory_held", "backend_devices")})
    assert info["gpus"] and info["gpus"][0]["memory_total"] > 8 * 2**30
    assert info["backend_devices"]["llama-server"][0].startswith("CUDA0")
    assert info["device_budget"] is not None and info["device_budget"] > 8 * 2**30


def test_an_offloaded_model_counts_its_gpu_buffers_where_the_node_counts(node):
    url = node["url"]
    reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": OFFLOADED, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}]})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    ps = {m["model"]: m for m in httpx.get(url + "/api/ps").json()["models"]}
    offloaded = ps[OFFLOADED]
    growth = gpu_used_bytes() - node["used_before"]
    print("offloaded:", {"size": offloaded["size"], "size_vram": offloaded["size_vram"],
                         "weights": node["weights"], "nvml_growth": growth,
                         "shoal": offloaded.get("shoal")})
    # Every weight is on the GPU, with its KV cache and compute buffers beside them; NVML
    # also counts the process's CUDA context, which no buffer does.
    assert offloaded["size_vram"] >= node["weights"]
    assert offloaded["size_vram"] <= growth
    # What stays in RAM is the process, not the weights (llama.cpp unmaps what it copied).
    assert offloaded["size"] - offloaded["size_vram"] < node["weights"] // 2
    (info,) = httpx.get(url + "/cluster").json()["nodes"]
    assert abs(info["device_held"] - offloaded["size_vram"]) <= 0.05 * offloaded["size_vram"]
    metrics = httpx.get(url + "/metrics").text
    line = re.search(r'shoal_runner_device_bytes\{backend="llama-server",model="%s"\} (\S+)'
                     % OFFLOADED, metrics)
    assert line is not None and float(line.group(1)) == offloaded["size_vram"]


def test_shoals_engine_serves_from_ram_beside_it(node):
    url = node["url"]
    reply = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "model": IN_RAM, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}]})
    assert reply.status_code == 200, reply.text
    ps = {m["model"]: m for m in httpx.get(url + "/api/ps").json()["models"]}
    print("in RAM:", {"size": ps[IN_RAM]["size"], "size_vram": ps[IN_RAM]["size_vram"]})
    assert ps[IN_RAM]["size_vram"] == 0 and ps[IN_RAM]["size"] > 0
