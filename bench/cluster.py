"""Cluster timings on loopback; prints one JSON object.

    python bench/cluster.py [--nodes 3] [--chunks 2000] [--skip-nodes]

Measures:
- data_plane: one-way latency of a token chunk between two Zenoh sessions in this process
  (ChunkSender -> RemoteStreams: msgpack, Zenoh over TCP loopback, reordering, validation);
- nodes: real `shoal serve` processes dialling each other on 127.0.0.1: time until all agree
  on one master (from process start), time to first token and decode tokens/s of a streamed
  completion sent to node 1 for a model placed on the last node, against the same request
  sent to that node directly, and failover time after kill -9 of the master.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from shoal.cluster.data_plane import ChunkSender, RemoteStreams
from shoal.cluster.transport.zenoh import ZenohConfig, ZenohTransport
from shoal.ids import NodeId
from shoal.protocol import TokenChunk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- data plane -----------------------------------------------------------------------------

async def data_plane_latency(chunks: int) -> dict:
    port = free_port()
    receiver = await ZenohTransport.open("bench-owner", ZenohConfig(
        listen=(f"tcp/127.0.0.1:{port}",), multicast_scouting=False, secret="bench"))
    sender_transport = await ZenohTransport.open("bench-server", ZenohConfig(
        connect=(f"tcp/127.0.0.1:{port}",), multicast_scouting=False, secret="bench"))
    streams = RemoteStreams(receiver)
    streams.start()
    try:
        deadline = time.monotonic() + 10
        while NodeId("bench-owner") not in sender_transport.peers:
            if time.monotonic() > deadline:
                raise RuntimeError("the two Zenoh sessions did not connect")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the data subscription propagate
        stream = streams.open("bench")
        sender = ChunkSender(sender_transport, NodeId("bench-owner"), "bench")
        latencies = []
        for i in range(chunks):
            sent = time.perf_counter()
            sender.send(TokenChunk(request_id="bench", text=" word", token_ids=(i,)))
            await stream.next(5.0)
            latencies.append(time.perf_counter() - sent)
            await asyncio.sleep(0)  # one chunk in flight at a time, as decode produces them
    finally:
        streams.stop()
        await sender_transport.close()
        await receiver.close()
    latencies.sort()
    return {"chunks": chunks, "p50_ms": 1e3 * statistics.median(latencies),
            "p95_ms": 1e3 * latencies[int(0.95 * len(latencies))],
            "max_ms": 1e3 * latencies[-1]}


# ---- real nodes -----------------------------------------------------------------------------

def start_nodes(root: Path, count: int, extra: dict[int, list[str]] | None = None,
                threads: int = 2) -> list[tuple[subprocess.Popen, str]]:
    """count `shoal serve` processes dialling each other on loopback; extra: more flags
    for the node of that index."""
    ports = [free_port() for _ in range(count)]
    nodes = []
    for index in range(count):
        peers = ",".join(f"tcp/127.0.0.1:{p}" for j, p in enumerate(ports) if j != index)
        api = free_port()
        data = root / f"node{index + 1}"
        data.mkdir()
        cmd = [sys.executable, "-m", "shoal.cli.app", "serve", "--port", str(api),
               "--data-dir", str(data), "--listen", f"tcp/127.0.0.1:{ports[index]}",
               "--peers", peers, "--no-discovery", "--no-preload", "--cluster-secret", "bench",
               "--threads", str(threads), "--kv-cache-memory", "256MiB",
               *(extra or {}).get(index, [])]
        log = open(data / "serve.log", "w")  # noqa: SIM115 - closed with the process
        nodes.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
                      f"http://127.0.0.1:{api}"))
    return nodes


def stop_nodes(nodes: list[tuple[subprocess.Popen, str]]) -> None:
    """SIGTERM every node still running, then wait (SIGKILL after 30 s)."""
    for proc, _ in nodes:
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in nodes:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def cluster_view(url: str) -> dict | None:
    try:
        response = httpx.get(url + "/cluster", timeout=2)
        return response.json() if response.status_code == 200 else None
    except httpx.HTTPError:
        return None


def wait_agreed(urls: list[str], size: int, timeout_s: float, not_master: str | None = None
                ) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = [cluster_view(url) for url in urls]
        if all(v and len(v["nodes"]) >= size for v in views):
            masters = {v["master_id"] for v in views}
            if len(masters) == 1 and None not in masters and not_master not in masters:
                return masters.pop()
        time.sleep(0.05)
    raise RuntimeError(f"no agreed master among {len(urls)} nodes within {timeout_s} s")


def streamed_completion(url: str, max_tokens: int = 64) -> dict:
    body = {"model": "smollm2", "prompt": "The history of rivers is", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    arrivals = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft_s": arrivals[0] - start, "chunks": len(arrivals),
            "decode_tokens_per_s": len(gaps) / sum(gaps) if gaps else None}


def bench_nodes(count: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        started = time.monotonic()
        nodes = start_nodes(Path(root), count)
        urls = [url for _, url in nodes]
        try:
            master = wait_agreed(urls, count, 60)
            formation_s = time.monotonic() - started
            ids = [cluster_view(url)["node_id"] for url in urls]
            server = next(i for i in reversed(range(count)) if ids[i] != master)
            client = next(i for i in range(count) if i != server)
            placed = httpx.post(urls[client] + "/instances", timeout=60, json={
                "model": "smollm2", "excluded_nodes": [n for n in ids if n != ids[server]]})
            placed.raise_for_status()
            deadline = time.monotonic() + 180
            while [i["status"] for i in cluster_view(urls[client])["instances"]] != ["ready"]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the placed instance did not become ready")
                time.sleep(0.2)
            streamed_completion(urls[server], 8)  # warm-up
            direct = streamed_completion(urls[server])
            remote = streamed_completion(urls[client])
            master_index = ids.index(master)
            nodes[master_index][0].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            rest = [url for i, url in enumerate(urls) if i != master_index]
            wait_agreed(rest, count - 1, 30, not_master=master)
            failover_s = time.monotonic() - killed
        finally:
            stop_nodes(nodes)
    return {"nodes": count, "formation_s": formation_s, "direct": direct, "remote": remote,
            "remote_ttft_overhead_s": remote["ttft_s"] - direct["ttft_s"],
            "failover_s": failover_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--skip-nodes", action="store_true")
    args = parser.parse_args()
    result = {"data_plane": asyncio.run(data_plane_latency(args.chunks))}
    if not args.skip_nodes:
        result["cluster"] = bench_nodes(args.nodes)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
