"""Model files between nodes on loopback; prints one JSON object.

    python bench/transfer.py [--size-mb 256] [--rounds 2] [--layers 16] [--ttft-model ID]
                             [--skip-nodes]

Measures, with two Zenoh sessions in this process (TCP loopback, the holder's reads and the
asker's writes, every piece's sha256 checked):
- peer: throughput of copying a model file from a holder (ModelTransfer.fetch, no rate
  bound) against a plain file copy of the same bytes (shutil.copyfile), and their ratio,
  each timed --rounds times interleaved and the fastest kept: over a direct stream (plain TCP, and TLS under a
  cluster CA) and over the data plane's messages (the fallback); and against the bound
  of a verified copy, a plain copy plus one sha256 pass of the same bytes (`bound_mb_s`,
  `<way>_bound_ratio`): every byte an asker writes is hashed once, on any path;
- rank: the bytes each rank of a 2-rank pipeline copies of a GGUF of --layers layers
  (ModelTransfer.fetch_rank) against the whole file.
- ttft (real `shoal serve` processes on 127.0.0.1, bench/cluster.py's): a completion's time
  to first token on a node that lacks a model one other node holds (it copies the file from
  that node, then loads it), against the same request once the file is on its disk (the
  model unloaded between, so both include the load); the model is --ttft-model's GGUF
  (default qwen2.5-coder-0.5b-instruct) under a name no catalogue resolves.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import shutil
import socket
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from cluster import cluster_view, start_nodes, stop_nodes, wait_agreed

from shoal.catalog.file_hashes import FileHashes
from shoal.catalog.resolve import resolve_model
from shoal.catalog.store import ModelStore
from shoal.cluster.held_models import HeldModels
from shoal.cluster.model_transfer import ModelTransfer, TransferConfig
from shoal.cluster.telemetry import NodeReading
from shoal.cluster.transport.zenoh import ZenohConfig, ZenohTransport
from shoal.engine.config import ModelSource
from shoal.ids import NodeId


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_gguf(path: Path, layers: int, layer_bytes: int) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    columns = layer_bytes // 4 // 256
    writer.add_tensor("token_embd.weight", rng.standard_normal((256, columns), np.float32))
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.ffn_up.weight",
                          rng.standard_normal((256, columns), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(columns, np.float32))
    writer.add_tensor("output.weight", rng.standard_normal((256, columns), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


async def pair(base: Path, path: Path, config: TransferConfig | None = None
               ) -> tuple[list[ModelTransfer], list]:
    """A holder of path and an asker that sees its reading, over Zenoh on loopback."""
    config = config or TransferConfig(rate_bytes_per_s=None)
    ports = free_port(), free_port()
    transports = [await ZenohTransport.open(NodeId(name), ZenohConfig(
        listen=(f"tcp/127.0.0.1:{ports[i]}",), connect=(f"tcp/127.0.0.1:{ports[1 - i]}",),
        multicast_scouting=False, secret="bench")) for i, name in enumerate(("holder", "asker"))]
    while not transports[1].peers:
        await asyncio.sleep(0.05)
    held = HeldModels(lambda: [(ModelSource(model_id="model", format="gguf", path=path), ())],
                      FileHashes())
    held.scan()
    reading = NodeReading(node_id=NodeId("holder"), taken_at=time.time(), models=held.current())
    holder = ModelTransfer(transports[0], held, ModelStore(base / "holder"), lambda: [],
                           config)
    asker = ModelTransfer(transports[1], HeldModels(lambda: [], FileHashes()),
                          ModelStore(base / "asker"), lambda: [reading], config)
    holder.start()
    asker.start()
    return [holder, asker], transports


def cpu_s() -> float:
    """This process's CPU time so far, every thread, user and kernel."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def file_copy_s(path: Path, target: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a plain copy."""
    started, cpu = time.monotonic(), cpu_s()
    shutil.copyfile(path, target)
    took = time.monotonic() - started, cpu_s() - cpu
    target.unlink()
    return took


def sha256_s(path: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one sha256 pass over a file (in the page cache)."""
    started, cpu = time.monotonic(), cpu_s()
    with open(path, "rb") as file:
        hashlib.file_digest(file, "sha256")
    return time.monotonic() - started, cpu_s() - cpu


async def peer_copy_s(base: Path, path: Path, config: TransferConfig) -> tuple[float, float]:
    """(wall seconds, CPU seconds of both ends) to copy path from a holder into a fresh
    store."""
    base.mkdir()
    (holder, asker), transports = await pair(base, path, config)
    started, cpu = time.monotonic(), cpu_s()
    assert await asker.fetch("model")
    took = time.monotonic() - started, cpu_s() - cpu
    for transport in transports:
        await transport.close()
    shutil.rmtree(base)
    return took


async def peer_copy(base: Path, size_mb: int, rounds: int) -> dict:
    from shoal.cluster.certs import make_cluster_certs
    from shoal.cluster.tls import read_cluster_tls

    path = base / "model.gguf"
    path.write_bytes(np.random.default_rng(1).bytes(size_mb << 20))
    os.sync()  # no writeback of the source left to slow whichever copy comes first
    make_cluster_certs(base / "tls")
    tls = read_cluster_tls(base / "tls")
    ways = {"stream": TransferConfig(rate_bytes_per_s=None),
            "stream_tls": TransferConfig(rate_bytes_per_s=None, tls=tls),
            "relay": TransferConfig(rate_bytes_per_s=None, direct=False)}
    # Each way timed `rounds` times, interleaved with the plain copy; the fastest kept.
    best: dict[str, tuple[float, float]] = {}
    for round_ in range(rounds):
        took = {"copy": file_copy_s(path, base / "copy.gguf"), "sha256": sha256_s(path)}
        for way, config in ways.items():
            took[way] = await peer_copy_s(base / f"{way}-{round_}", path, config)
            os.sync()
        best = {way: min(s, best.get(way, s)) for way, s in took.items()}
    copy_s, copy_cpu = best.pop("copy")
    hash_s, hash_cpu = best.pop("sha256")
    # CPU seconds a GB, both ends together: what a busy host's share of cores caps.
    result: dict = {"bytes": path.stat().st_size, "rounds": rounds,
                    "copy_mb_s": round(size_mb / copy_s, 1),
                    "copy_cpu_s_per_gb": round(copy_cpu * 1024 / size_mb, 2),
                    "sha256_mb_s": round(size_mb / hash_s, 1),
                    "bound_mb_s": round(size_mb / (copy_s + hash_s), 1),
                    "bound_cpu_s_per_gb": round((copy_cpu + hash_cpu) * 1024 / size_mb, 2)}
    for way, (took_s, cpu) in best.items():
        result[f"{way}_mb_s"] = round(size_mb / took_s, 1)
        result[f"{way}_ratio"] = round(copy_s / took_s, 3)
        result[f"{way}_bound_ratio"] = round((copy_s + hash_s) / took_s, 3)
        result[f"{way}_cpu_s_per_gb"] = round(cpu * 1024 / size_mb, 2)
    return result


async def rank_copy(base: Path, layers: int) -> dict:
    path = base / "layers.gguf"
    write_gguf(path, layers, 1 << 20)
    ranks = []
    for start, end in ((0, layers // 2), (layers // 2, layers)):
        directory = base / f"rank-{start}"
        directory.mkdir()
        (holder, asker), transports = await pair(directory, path)
        assert await asker.fetch_rank("model", start, end, layers) is not None
        ranks.append({"layers": [start, end], "bytes": asker.fetched_bytes})
        for transport in transports:
            await transport.close()
    return {"file_bytes": path.stat().st_size, "ranks": ranks}


def first_token_s(url: str, model: str) -> float:
    body = {"model": model, "prompt": "The history of rivers is", "max_tokens": 4,
            "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("the completion streamed no token")


def unload_all(url: str, urls: list[str]) -> None:
    for instance in cluster_view(url)["instances"]:
        httpx.delete(f"{url}/instances/{instance['instance_id']}", timeout=30)
    deadline = time.monotonic() + 60
    while any(cluster_view(u)["instances"] for u in urls):
        if time.monotonic() > deadline:
            raise RuntimeError("the instances were not deleted")
        time.sleep(0.2)


def ttft(base: Path, model_id: str) -> dict:
    """Time to first token on a node lacking the model (a peer copy, then the load) against
    the same node with the file on its disk."""
    path = base / "bench-peer-model.gguf"  # a stem no catalogue id resolves
    shutil.copyfile(resolve_model(model_id).path, path)
    nodes = start_nodes(base, 2, extra={0: ["--peer-fetch-rate", "off"],
                                        1: ["--peer-fetch-rate", "off"]})
    urls = [url for _, url in nodes]
    try:
        wait_agreed(urls, 2, 60)
        holder, asker = urls
        first_token_s(holder, str(path))  # the holder resolves it (so lists it), then unloads
        unload_all(holder, urls)
        deadline = time.monotonic() + 60
        while not any(any(m["model"] == path.stem for m in n.get("models", []))
                      for n in cluster_view(asker)["nodes"]):
            if time.monotonic() > deadline:
                raise RuntimeError("the asker never saw the holder's model")
            time.sleep(0.2)
        copied = first_token_s(asker, path.stem)
        unload_all(asker, urls)
        on_disk = first_token_s(asker, path.stem)
    finally:
        stop_nodes(nodes)
    return {"model": model_id, "file_bytes": path.stat().st_size,
            "ttft_after_peer_copy_s": round(copied, 2), "ttft_from_disk_s": round(on_disk, 2),
            "copy_overhead_s": round(copied - on_disk, 2)}


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as temporary:
        base = Path(temporary)
        (base / "peer").mkdir()
        (base / "rank").mkdir()
        result = {"peer": await peer_copy(base / "peer", args.size_mb, args.rounds),
                  "rank": await rank_copy(base / "rank", args.layers)}
        if not args.skip_nodes:
            (base / "nodes").mkdir()
            result["ttft"] = await asyncio.to_thread(ttft, base / "nodes", args.ttft_model)
    print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ttft-model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--skip-nodes", action="store_true")
    asyncio.run(main(parser.parse_args()))
