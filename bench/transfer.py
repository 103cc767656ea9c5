"""Model files between nodes on loopback; prints one JSON object.

    python bench/transfer.py [--size-mb 256] [--layers 16]

Measures, with two Zenoh sessions in this process (msgpack, TCP loopback, the holder's
reads and the asker's writes, per-chunk and whole-file sha256):
- peer: throughput of copying a model file from a holder (ModelTransfer.fetch, no rate
  bound) against a plain file copy of the same bytes (shutil.copyfile), and their ratio;
- rank: the bytes each rank of a 2-rank pipeline copies of a GGUF of --layers layers
  (ModelTransfer.fetch_rank) against the whole file.
Time to first token for a model held by one node and placed on another is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

from shoal.catalog.file_hashes import FileHashes
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


async def pair(base: Path, path: Path) -> tuple[list[ModelTransfer], list]:
    """A holder of path and an asker that sees its reading, over Zenoh on loopback."""
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
    holder = ModelTransfer(transports[0], held, ModelStore(base / "holder"), lambda: [])
    asker = ModelTransfer(transports[1], HeldModels(lambda: [], FileHashes()),
                          ModelStore(base / "asker"), lambda: [reading],
                          TransferConfig(rate_bytes_per_s=None))
    holder.start()
    asker.start()
    return [holder, asker], transports


async def peer_copy(base: Path, size_mb: int) -> dict:
    path = base / "model.gguf"
    path.write_bytes(np.random.default_rng(1).bytes(size_mb << 20))
    (holder, asker), transports = await pair(base, path)
    started = time.monotonic()
    assert await asker.fetch("model")
    peer_s = time.monotonic() - started
    started = time.monotonic()
    shutil.copyfile(path, base / "copy.gguf")
    copy_s = time.monotonic() - started
    for transport in transports:
        await transport.close()
    return {"bytes": path.stat().st_size, "peer_mb_s": round(size_mb / peer_s, 1),
            "copy_mb_s": round(size_mb / copy_s, 1), "ratio": round(copy_s / peer_s, 3)}


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


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as temporary:
        base = Path(temporary)
        (base / "peer").mkdir()
        (base / "rank").mkdir()
        result = {"peer": await peer_copy(base / "peer", args.size_mb),
                  "rank": await rank_copy(base / "rank", args.layers)}
    print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
