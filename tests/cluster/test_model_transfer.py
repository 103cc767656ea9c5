"""Model files between nodes over the data plane (in-memory transport): a node lacking a
model copies it from a holder, verified and installed in its store; a holder dropped
mid-transfer is replaced by another holder, or the fetch fails clearly within its bound;
a file not advertised is never served."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest

from shoal.catalog.file_hashes import FileHashes
from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.catalog.store import ModelStore
from shoal.cluster.data_plane import (
    FILE_ASK_FIELD,
    FILE_PART_FIELD,
    FILE_STREAM_ASK_FIELD,
    FILE_STREAM_OFFER_FIELD,
)
from shoal.cluster.held_models import HeldModels
from shoal.cluster.model_transfer import ModelTransfer, TransferConfig
from shoal.cluster.rank_files import HEADER_GUESS_BYTES
from shoal.cluster.telemetry import NodeReading
from shoal.cluster.transport import MemoryHub
from shoal.engine.config import ModelSource
from shoal.ids import NodeId

CHUNK = 4096


def model_file(directory, size=10 * CHUNK + 123):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.gguf"
    path.write_bytes(b"GGUF" + os.urandom(size - 4))
    return path


class Node:
    """One node's transfer service: holding the model at path, or nothing."""

    def __init__(self, hub, name, tmp_path, path=None, config=None, readings=None,
                 host=lambda: "127.0.0.1"):
        self.transport = hub.connect(name)
        self.sent = []  # the fields of every data-plane message this node sent
        send = self.transport.send_data
        self.transport.send_data = lambda node, message: (self.sent.extend(message), send(
            node, message))[1]
        sources = [] if path is None else [(ModelSource(model_id="tiny", format="gguf",
                                                        path=path), ("org/tiny",))]
        self.held = HeldModels(lambda: sources, FileHashes())
        self.held.scan()
        self.store = ModelStore.of_data_dir(tmp_path / name)
        self.transfer = ModelTransfer(self.transport, self.held, self.store,
                                      readings or (lambda: []),
                                      config or TransferConfig(chunk_bytes=CHUNK), host=host)
        self.transfer.server.piece_bytes = CHUNK  # streams in several pieces
        self.transfer.start()

    def reading(self) -> NodeReading:
        return NodeReading(node_id=self.transport.node_id, taken_at=time.time(),
                           models=self.held.current())


def test_a_model_is_copied_from_its_holder_verified_and_installed(tmp_path):
    original = model_file(tmp_path / "a-files")

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original)
        events = []
        asker = Node(hub, "b", tmp_path, readings=lambda: [holder.reading()])
        asker.transfer.observers.append(events.append)
        assert await asker.transfer.fetch("nothing-held") is False
        fetched = await asyncio.gather(asker.transfer.fetch("org/tiny"),
                                       asker.transfer.fetch("tiny"))  # one fetch
        return holder, asker, events, fetched

    holder, asker, events, fetched = asyncio.run(main())
    assert fetched == [True, True]
    source = resolve_model("tiny", data_dir=tmp_path / "b")
    assert source.path.read_bytes() == original.read_bytes()
    assert resolve_model("org/tiny", data_dir=tmp_path / "b").path == source.path
    size = original.stat().st_size
    assert asker.transfer.fetched_bytes == holder.transfer.served_bytes == size
    assert sum(e.new_bytes for e in events) == size and {e.source for e in events} == {"peer"}
    assert events[-1].status == "success"
    assert not list((tmp_path / "b" / "models" / ".downloads").rglob("*.partial"))


def test_a_copy_goes_over_a_direct_stream_and_no_chunk_crosses_the_data_plane(tmp_path):
    original = model_file(tmp_path / "files")

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original)
        asker = Node(hub, "b", tmp_path, readings=lambda: [holder.reading()])
        assert await asker.transfer.fetch("tiny")
        return holder, asker

    holder, asker = asyncio.run(main())
    assert set(asker.sent) == {FILE_STREAM_ASK_FIELD}
    assert set(holder.sent) == {FILE_STREAM_OFFER_FIELD}
    assert resolve_model("tiny", data_dir=tmp_path / "b").path.read_bytes() == \
        original.read_bytes()
    assert asker.transfer.fetched_bytes == holder.transfer.served_bytes == \
        original.stat().st_size


def test_a_stream_ask_lost_on_the_way_is_asked_again(tmp_path):
    original = model_file(tmp_path / "files")

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original)
        asker = Node(hub, "b", tmp_path, readings=lambda: [holder.reading()])
        send, lost = asker.transport.send_data, []

        def lose_the_first_ask(node, message):
            if FILE_STREAM_ASK_FIELD in message and not lost:
                lost.append(message)
                return None
            return send(node, message)

        asker.transport.send_data = lose_the_first_ask
        started = time.monotonic()
        assert await asker.transfer.fetch("tiny")
        return asker, lost, time.monotonic() - started

    asker, lost, took = asyncio.run(main())
    assert len(lost) == 1 and FILE_ASK_FIELD not in asker.sent and took < 3
    assert resolve_model("tiny", data_dir=tmp_path / "b").path.read_bytes() == \
        original.read_bytes()


def test_under_cluster_tls_the_stream_is_mutual_tls_under_the_cluster_ca(tmp_path):
    from shoal.cluster.certs import make_cluster_certs
    from shoal.cluster.tls import read_cluster_tls

    original = model_file(tmp_path / "files")
    make_cluster_certs(tmp_path / "tls")
    config = TransferConfig(chunk_bytes=CHUNK, tls=read_cluster_tls(tmp_path / "tls"))

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original, config=config)
        asker = Node(hub, "b", tmp_path, config=config, readings=lambda: [holder.reading()])
        assert await asker.transfer.fetch("tiny")
        return asker

    asker = asyncio.run(main())
    assert set(asker.sent) == {FILE_STREAM_ASK_FIELD}
    assert resolve_model("tiny", data_dir=tmp_path / "b").path.read_bytes() == \
        original.read_bytes()


def test_a_holder_that_cannot_offer_a_stream_serves_over_the_data_plane(tmp_path):
    original = model_file(tmp_path / "files")

    async def main():
        hub = MemoryHub()
        # An address this machine does not have: the holder cannot listen there.
        holder = Node(hub, "a", tmp_path, original, host=lambda: "192.0.2.1")
        asker = Node(hub, "b", tmp_path, readings=lambda: [holder.reading()])
        assert await asker.transfer.fetch("tiny")
        return asker

    asker = asyncio.run(main())
    assert FILE_ASK_FIELD in asker.sent
    assert resolve_model("tiny", data_dir=tmp_path / "b").path.read_bytes() == \
        original.read_bytes()


def test_a_holder_stopped_mid_stream_is_replaced_and_the_copy_resumes(tmp_path):
    # Larger than what the socket buffers between the two hold, read at 1 MiB a second.
    original = model_file(tmp_path / "files", size=512 * CHUNK)
    slow = TransferConfig(chunk_bytes=CHUNK, chunk_wait_s=0.5, rate_bytes_per_s=256 * CHUNK)

    async def main():
        hub = MemoryHub()
        first, second = (Node(hub, "a", tmp_path, original), Node(hub, "c", tmp_path, original))
        asker = Node(hub, "b", tmp_path, config=slow,
                     readings=lambda: [first.reading(), second.reading()])
        fetch = asyncio.create_task(asker.transfer.fetch("tiny"))
        while asker.transfer.fetched_bytes < 5 * CHUNK:
            await asyncio.sleep(0.01)
        await first.transfer.stop()  # its streams end with it
        started = time.monotonic()
        assert await fetch
        return second, asker, time.monotonic() - started

    second, asker, took = asyncio.run(main())
    size = original.stat().st_size
    assert 0 < second.transfer.served_bytes <= size - 5 * CHUNK  # resumed, not restarted
    assert asker.transfer.fetched_bytes == size
    assert FILE_ASK_FIELD not in asker.sent
    assert resolve_model("tiny", data_dir=tmp_path / "b").path.read_bytes() == \
        original.read_bytes()
    assert took < 5


def test_a_holder_dropped_mid_relay_is_replaced_by_another(tmp_path):
    original = model_file(tmp_path / "files", size=40 * CHUNK)
    # Paced to 20 chunks a second, so the first holder is dropped part-way.
    slow = TransferConfig(chunk_bytes=CHUNK, window=2, chunk_wait_s=0.5,
                          rate_bytes_per_s=20 * CHUNK, direct=False)

    async def main():
        hub = MemoryHub()
        first, second = (Node(hub, "a", tmp_path, original), Node(hub, "c", tmp_path, original))
        asker = Node(hub, "b", tmp_path, config=slow,
                     readings=lambda: [first.reading(), second.reading()])
        fetch = asyncio.create_task(asker.transfer.fetch("tiny"))
        while first.transfer.served_bytes < 5 * CHUNK:
            await asyncio.sleep(0.01)
        hub.drop(NodeId("a"))
        started = time.monotonic()
        assert await fetch
        return first, second, asker, time.monotonic() - started

    first, second, asker, took = asyncio.run(main())
    assert 0 < first.transfer.served_bytes < original.stat().st_size
    assert second.transfer.served_bytes > 0
    source = resolve_model("tiny", data_dir=tmp_path / "b")
    assert hashlib.sha256(source.path.read_bytes()).digest() == \
        hashlib.sha256(original.read_bytes()).digest()
    assert took < 5


def test_the_only_holder_dropped_mid_relay_is_a_clear_error_within_the_bound_and_resumes(tmp_path):
    original = model_file(tmp_path / "files", size=40 * CHUNK)
    slow = TransferConfig(chunk_bytes=CHUNK, window=2, chunk_wait_s=0.5,
                          rate_bytes_per_s=20 * CHUNK, direct=False)

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original)
        readings = [holder.reading()]
        asker = Node(hub, "b", tmp_path, config=slow, readings=lambda: readings)
        fetch = asyncio.create_task(asker.transfer.fetch("tiny"))
        while holder.transfer.served_bytes < 5 * CHUNK:
            await asyncio.sleep(0.01)
        hub.drop(NodeId("a"))
        started = time.monotonic()
        with pytest.raises(ModelNotFound, match="no holder could finish tiny.gguf") as error:
            await fetch
        took = time.monotonic() - started
        # Back again: the fetch resumes from what the first one wrote.
        again = Node(hub, "a2", tmp_path, original)
        readings[:] = [again.reading()]
        assert await asker.transfer.fetch("tiny")
        return error.value, took, again

    error, took, again = asyncio.run(main())
    assert "sent nothing for 0.5 s" in str(error) and took < 2
    assert again.transfer.served_bytes < original.stat().st_size  # resumed, not restarted
    source = resolve_model("tiny", data_dir=tmp_path / "b")
    assert source.path.read_bytes() == original.read_bytes()


def test_a_holder_serves_only_the_files_it_advertises(tmp_path):
    original = model_file(tmp_path / "files")
    (tmp_path / "files" / "secret").write_text("private")

    async def main():
        hub = MemoryHub()
        Node(hub, "a", tmp_path, original)
        asker = hub.connect("b")
        answers = []
        asker.subscribe_data(answers.append)
        sha256 = hashlib.sha256(original.read_bytes()).hexdigest()
        for model, path in (("tiny", "secret"), ("tiny", "../files/secret"), ("x", "tiny.gguf")):
            asker.send_data(NodeId("a"), {FILE_ASK_FIELD: {
                "fetch": "f", "from": "b", "model": model, "path": path, "offset": 0,
                "length": 10}})
            asker.send_data(NodeId("a"), {FILE_STREAM_ASK_FIELD: {
                "fetch": "f", "from": "b", "model": model, "path": path, "sha256": sha256,
                "offset": 0, "length": 10}})
        # Another version of the file than the one this node holds now.
        asker.send_data(NodeId("a"), {FILE_STREAM_ASK_FIELD: {
            "fetch": "f", "from": "b", "model": "tiny", "path": "tiny.gguf",
            "sha256": "0" * 64, "offset": 0, "length": 10}})
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(answers) == 7:
                break
        return answers

    answers = asyncio.run(main())
    assert len(answers) == 7
    parts = [a[FILE_PART_FIELD] for a in answers if FILE_PART_FIELD in a]
    offers = [a[FILE_STREAM_OFFER_FIELD] for a in answers if FILE_STREAM_OFFER_FIELD in a]
    assert all("does not hold" in a["error"] and "data" not in a for a in parts)
    assert sum("does not hold" in a["error"] for a in offers) == 3
    assert sum("holds another version" in a["error"] for a in offers) == 1
    assert not any("port" in a for a in offers)


def test_nodes_holding_different_files_under_one_name_are_a_clear_error(tmp_path):
    one = model_file(tmp_path / "one")
    other = model_file(tmp_path / "other")  # the same name, other bytes

    async def main():
        hub = MemoryHub()
        a, c = Node(hub, "a", tmp_path, one), Node(hub, "c", tmp_path, other)
        asker = Node(hub, "b", tmp_path, readings=lambda: [a.reading(), c.reading()])
        with pytest.raises(ModelNotFound, match="nodes hold different files under the name"):
            await asker.transfer.fetch("tiny")
        return asker

    asker = asyncio.run(main())
    assert asker.transfer.fetched_bytes == 0


def test_no_room_for_the_copy_is_a_clear_error_before_any_byte_moves(tmp_path):
    from shoal.catalog.pull.errors import NotEnoughDisk

    original = model_file(tmp_path / "files")
    asked = []

    def no_room(model_size, missing, label):
        asked.append((model_size, missing))
        raise NotEnoughDisk(f"{label}: the model store is bounded (--models-disk)")

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original)
        asker = Node(hub, "b", tmp_path, readings=lambda: [holder.reading()])
        asker.transfer.make_room = no_room
        with pytest.raises(ModelNotFound, match="--models-disk"):
            await asker.transfer.fetch("tiny")
        return holder

    holder = asyncio.run(main())
    size = original.stat().st_size
    assert asked == [(size, size)] and holder.transfer.served_bytes == 0


def tiny_gguf(path):
    """A GGUF of two layers with an embedding, an output head and a final norm."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    names = ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight",
             "blk.1.attn_q.weight", "blk.1.ffn_up.weight", "output_norm.weight",
             "output.weight")
    for name in names:
        shape = (64,) if name == "output_norm.weight" else (64, 256)
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_pipeline_rank_copies_only_its_layers_into_a_valid_sparse_gguf(tmp_path):
    from shoal.engine.weights.gguf_file import GGUFFile

    (tmp_path / "files").mkdir()
    original = tiny_gguf(tmp_path / "files" / "tiny.gguf")

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original)
        firsts = Node(hub, "b", tmp_path, readings=lambda: [holder.reading()])
        lasts = Node(hub, "c", tmp_path, readings=lambda: [holder.reading()])
        first = await firsts.transfer.fetch_rank("tiny", 0, 1, 2)
        last = await lasts.transfer.fetch_rank("tiny", 1, 2, 2)
        assert await firsts.transfer.fetch_rank("tiny", 0, 1, 2) == first  # kept
        return first, last, firsts.transfer.fetched_bytes, lasts.transfer.fetched_bytes

    first, last, first_bytes, last_bytes = asyncio.run(main())
    whole = GGUFFile(original)
    size = original.stat().st_size
    assert first.stat().st_size == last.stat().st_size == size
    for copy, fetched, wanted in (
            (first, first_bytes, {"token_embd.weight", "blk.0.attn_q.weight",
                                  "blk.0.ffn_up.weight", "output_norm.weight"}),
            (last, last_bytes, {"blk.1.attn_q.weight", "blk.1.ffn_up.weight",
                                "output_norm.weight", "output.weight"})):
        # Its tensors, plus at most the first read of the header.
        needed = sum(whole.tensors[name].nbytes for name in wanted)
        assert needed <= fetched <= needed + HEADER_GUESS_BYTES and fetched < size * 0.7
        rank_file = GGUFFile(copy)  # a valid GGUF: the same header and tensors
        assert list(rank_file.tensors) == list(whole.tensors)
        for name, info in whole.tensors.items():
            held = (rank_file.data(rank_file.tensors[name]) == whole.data(info)).all()
            assert held == (name in wanted), (copy, name)


def test_a_rank_reads_the_embedding_first_and_the_head_last_tied_or_not():
    from shoal.cluster.rank_files import rank_needs

    assert rank_needs("token_embd.weight", 0, 1, 2, tied=False)
    assert not rank_needs("token_embd.weight", 1, 2, 2, tied=False)
    assert rank_needs("token_embd.weight", 1, 2, 2, tied=True)  # the head is the embedding
    assert rank_needs("output.weight", 1, 2, 2, tied=False)
    assert not rank_needs("output.weight", 0, 1, 2, tied=False)
    assert rank_needs("blk.3.attn_q.weight", 2, 4, 6, tied=False)
    assert not rank_needs("blk.4.attn_q.weight", 2, 4, 6, tied=False)
    assert rank_needs("output_norm.weight", 0, 1, 2, tied=False)  # small: everywhere


def moe_gguf(path, n_experts=4):
    """A GGUF of two mixture-of-experts layers: a router and 3-D expert tensors."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "qwen2moe")
    rng = np.random.default_rng(1)
    # 64 KiB first: the experts lie past the header's first read (a rank copies that whole).
    writer.add_tensor("token_embd.weight", rng.standard_normal((512, 32)).astype(np.float32))
    for layer in range(2):
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                          rng.standard_normal((n_experts, 32)).astype(np.float32))
        for part in ("gate", "up", "down"):
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight",  # [experts, out, in]
                              rng.standard_normal((n_experts, 16, 32)).astype(np.float32))
    writer.add_tensor("output.weight", rng.standard_normal((64, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_expert_rank_copies_only_its_experts_slices_of_each_expert_tensor(tmp_path):
    from shoal.engine.weights.gguf_file import GGUFFile

    (tmp_path / "files").mkdir()
    original = moe_gguf(tmp_path / "files" / "tiny.gguf")

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original)
        asker = Node(hub, "b", tmp_path, readings=lambda: [holder.reading()])
        copy = await asker.transfer.fetch_rank("tiny", 0, 2, 2, experts=(1, 3, 4))
        return copy, asker.transfer.fetched_bytes

    copy, fetched = asyncio.run(main())
    whole, rank_file = GGUFFile(original), GGUFFile(copy)
    experts = [info for name, info in whole.tensors.items() if "_exps." in name]
    others = sum(info.nbytes for name, info in whole.tensors.items() if "_exps." not in name)
    needed = others + sum(info.nbytes for info in experts) // 2  # experts 1 and 2 of 4
    assert needed <= fetched <= needed + HEADER_GUESS_BYTES
    for name, info in whole.tensors.items():
        original_rows = whole.data(info).reshape(-1)
        copied_rows = rank_file.data(rank_file.tensors[name]).reshape(-1)
        if "_exps." not in name:
            assert (copied_rows == original_rows).all(), name
            continue
        per_expert = original_rows.size // 4
        for expert in range(4):
            held = slice(expert * per_expert, (expert + 1) * per_expert)
            if expert in (1, 2):
                assert (copied_rows[held] == original_rows[held]).all(), (name, expert)
            else:
                assert not copied_rows[held].any(), (name, expert)  # a hole: never copied


def test_a_node_guessing_for_a_gguf_model_copies_only_its_header_for_the_tokenizer(tmp_path):
    import gguf
    import numpy as np
    from engine.tokenizer_fixtures import tiny_byte_level_metadata  # tests/engine

    from shoal.engine.tokenizer.tokenizer import Tokenizer

    (tmp_path / "files").mkdir()
    original = tmp_path / "files" / "tiny.gguf"
    writer = gguf.GGUFWriter(original, "llama")
    for key, value in tiny_byte_level_metadata().items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.ones((1024, 256), np.float32))  # 1 MiB
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    async def main():
        hub = MemoryHub()
        holder = Node(hub, "a", tmp_path, original)
        asker = Node(hub, "b", tmp_path, readings=lambda: [holder.reading()])
        assert await asker.transfer.fetch_tokenizer("nothing-held") is None
        source = await asker.transfer.fetch_tokenizer("tiny")
        return source, asker.transfer.fetched_bytes

    source, fetched = asyncio.run(main())
    assert source.model_id == "tiny" and source.path.stat().st_size == original.stat().st_size
    assert fetched < 256 * 1024  # the header, not the weights
    copied = Tokenizer.load(source, cache_dir=tmp_path / "cache")
    whole = Tokenizer.load(ModelSource(model_id="tiny", format="gguf", path=original),
                           cache_dir=tmp_path / "cache")
    assert copied.encode("Once upon a time") == whole.encode("Once upon a time")
    assert resolve_model_or_none("tiny", tmp_path / "b") is None  # not a model in the store


def resolve_model_or_none(name, data_dir):
    try:
        return resolve_model(name, data_dir=data_dir)
    except ModelNotFound:
        return None
