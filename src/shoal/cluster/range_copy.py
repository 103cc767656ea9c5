"""Copying a byte range of a model file from the nodes that hold it (model_transfer.py's
engine): over a direct stream from the holder (file_stream.py: asked for and offered on the
data plane, then one TCP connection, TLS under --cluster-tls, pieces checked by sha256 and
written in order), else, where no stream opens, over the data plane itself in hashed chunks
(`window` asked ahead, each checked and written in order); paced to `rate_bytes_per_s`. A
holder that fails is left out and the next resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO

from shoal.catalog.pull.progress import Progress, PullEvent
from shoal.catalog.resolve import ModelNotFound
from shoal.cluster.background import run_on_thread
from shoal.cluster.data_plane import (
    FILE_ASK_FIELD,
    FILE_PART_FIELD,
    FILE_STREAM_ASK_FIELD,
    FILE_STREAM_OFFER_FIELD,
)
from shoal.cluster.file_stream import (
    Offer,
    StreamBroken,
    StreamReceiver,
    StreamUnavailable,
    client_context,
    start_writeback,
)
from shoal.cluster.held_models import HeldFile, HeldModel
from shoal.cluster.tls import ClusterTls
from shoal.cluster.transport.base import Transport, TransportError
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.transfer")

SOURCE = "peer"  # the label of these bytes in progress events and /metrics
_ASK_AGAIN_S = 1.0  # a stream ask unanswered this long is sent again


@dataclass(frozen=True)
class TransferConfig:
    chunk_bytes: int = 1024 * 1024
    window: int = 4  # chunks asked ahead of the one being written
    chunk_wait_s: float = 10.0  # a holder silent this long is given up
    # --peer-fetch-rate: at most this many bytes a second per fetch; None: unbounded.
    rate_bytes_per_s: float | None = 256 * 1024 * 1024
    direct: bool = True  # copy over direct streams where the holder offers them
    connect_timeout_s: float = 5.0  # for an offer to come, and for its stream to open
    tls: ClusterTls | None = None  # --cluster-tls: streams are mutual TLS under its CA

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.window < 1 or self.chunk_wait_s <= 0 \
                or self.connect_timeout_s <= 0:
            raise ValueError("peer fetch chunk_bytes, window, chunk_wait_s and "
                             "connect_timeout_s must be positive")
        if self.rate_bytes_per_s is not None and self.rate_bytes_per_s <= 0:
            raise ValueError("--peer-fetch-rate must be positive")

    @property
    def chunk_size(self) -> int:
        """Bytes per chunk: chunk_bytes, or a quarter second at the rate when that is less
        (pacing then stays smooth; never under 4 KiB)."""
        if self.rate_bytes_per_s is None:
            return self.chunk_bytes
        return max(4096, min(self.chunk_bytes, int(self.rate_bytes_per_s // 4)))


class _HolderFailed(Exception):
    """This holder cannot finish the file (silent, gone, refused, or sent bad bytes);
    reached: the offset up to which its bytes were written."""

    reached = 0


class RangeCopier:
    """Copies ranges of files from holders into open files; observers get every chunk's
    progress (the node's metrics)."""

    def __init__(self, transport: Transport, config: TransferConfig) -> None:
        self._transport = transport
        self._config = config
        tls = config.tls
        self._client_context = client_context(tls) if tls is not None else None
        self._parts: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._offers: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.observers: list[Progress] = []
        self.fetched_bytes = 0  # bytes received from peers

    def take(self, message: dict[str, Any]) -> bool:
        """Take message if it answers one of this node's asks (True)."""
        if isinstance(part := message.get(FILE_PART_FIELD), dict):
            queue = self._parts.get(str(part.get("fetch")))
            if queue is not None:
                queue.put_nowait(part)
            return True
        if isinstance(offer := message.get(FILE_STREAM_OFFER_FIELD), dict):
            answer = self._offers.get(str(offer.get("fetch")))
            if answer is not None and not answer.done():
                answer.set_result(offer)
            return True
        return False

    async def copy_with_failover(self, model: HeldModel, file: HeldFile, out: BinaryIO,
                                  begin: int, end: int, nodes: list[NodeId],
                                  failures: dict[NodeId, str], label: str,
                                  ways: set[str]) -> None:
        """file's bytes [begin, end) into out at the same offsets, from the first holder
        that can; a holder that fails is left out and the next resumes where it stopped.
        ways: gets "stream" and "relay" as bytes come either way."""
        for node in nodes:
            if node in failures:
                continue
            try:
                await self._copy_range(node, model, file, out, begin, end, ways)
                break
            except _HolderFailed as error:
                failures[node] = str(error)
                begin = error.reached
                log.warning("%s: %s of %s from %s: %s; trying another holder", label,
                            file.path, model.model, node, error)
        else:
            reasons = "; ".join(f"{node}: {why}" for node, why in failures.items())
            raise ModelNotFound(f"{label}: no holder could finish {file.path} ({reasons}); "
                                f"fetch again to resume it")
        await asyncio.to_thread(_sync, out)

    async def _copy_range(self, node: NodeId, model: HeldModel, file: HeldFile,
                          out: BinaryIO, begin: int, end: int, ways: set[str]) -> None:
        """file's bytes [begin, end) from node into out: over a direct stream, else over
        the data plane; _HolderFailed (with how far it got) when node cannot finish them."""
        if self._config.direct:
            try:
                ways.add("stream")
                await self._stream_range(node, model, file, out, begin, end)
                return
            except StreamUnavailable as error:
                log.info("no direct stream of %s from %s (%s): over the data plane", file.path,
                         node, error)
        ways.add("relay")
        await self._relay_range(node, model, file, out, begin, end)

    async def _stream_range(self, node: NodeId, model: HeldModel, file: HeldFile,
                            out: BinaryIO, begin: int, end: int) -> None:
        offer = await self._ask_offer(node, model, file, begin, end)
        out.flush()  # the stream writes at the descriptor, under the file object
        loop = asyncio.get_running_loop()
        receiver = StreamReceiver(
            offer, begin, end, out.fileno(), context=self._client_context,
            connect_timeout_s=self._config.connect_timeout_s,
            read_timeout_s=self._config.chunk_wait_s, rate=self._config.rate_bytes_per_s,
            on_piece=lambda start, length: loop.call_soon_threadsafe(
                self._received, file, start + length, length))
        try:
            await run_on_thread(receiver.run, receiver.cancel)
        except StreamBroken as error:
            failed = _HolderFailed(str(error))
            failed.reached = error.reached
            raise failed from None

    async def _ask_offer(self, node: NodeId, model: HeldModel, file: HeldFile, begin: int,
                         end: int) -> Offer:
        """The holder's stream offer; StreamUnavailable when it makes none in time. The ask
        goes again each second without an answer (a message to a node that only just
        joined can be lost); the first offer wins, any other expires unused."""
        fetch_id = uuid.uuid4().hex
        answer = self._offers[fetch_id] = asyncio.get_running_loop().create_future()
        ask = {FILE_STREAM_ASK_FIELD: {
            "fetch": fetch_id, "from": self._transport.node_id, "model": model.model,
            "path": file.path, "sha256": file.sha256, "offset": begin, "length": end - begin,
            "rate": self._config.rate_bytes_per_s}}
        try:
            async with asyncio.timeout(self._config.connect_timeout_s):
                while True:
                    self._transport.send_data(node, ask)
                    done, _ = await asyncio.wait([answer], timeout=_ASK_AGAIN_S)
                    if done:
                        break
            wire = answer.result()
            if "error" in wire:
                raise StreamUnavailable(str(wire["error"]))
            return Offer.from_wire(wire)
        except TransportError as error:
            raise StreamUnavailable(f"cannot reach it ({error})") from None
        except TimeoutError:
            raise StreamUnavailable(f"no offer within {self._config.connect_timeout_s:g} s") \
                from None
        except ValueError as error:
            raise StreamUnavailable(str(error)) from None
        finally:
            self._offers.pop(fetch_id, None)

    def _received(self, file: HeldFile, have: int, length: int) -> None:
        self.fetched_bytes += length
        self.report(PullEvent(f"pulling {file.sha256[:12]}", f"sha256:{file.sha256}",
                               file.size, have, new_bytes=length, source=SOURCE))

    async def _relay_range(self, node: NodeId, model: HeldModel, file: HeldFile,
                           out: BinaryIO, begin: int, end: int) -> None:
        """file's bytes [begin, end) from node over the data plane, chunk by chunk in order."""
        config, chunk = self._config, self._config.chunk_size
        fetch_id = uuid.uuid4().hex
        parts = self._parts[fetch_id] = asyncio.Queue()
        have, asked, early = begin, begin, {}
        started, copied = time.monotonic(), 0
        try:
            while have < end:
                while asked < end and asked - have < config.window * chunk:
                    length = min(chunk, end - asked)
                    self._ask(node, fetch_id, model, file, asked, length)
                    asked += length
                part = await self._next_part(node, parts)
                early[int(part["offset"])] = part
                while (part := early.pop(have, None)) is not None:
                    # Hashing and writing off the event loop (sha256 lets go of the GIL).
                    data = await asyncio.to_thread(_check_and_write, part, have, file, out)
                    have += len(data)
                    copied += len(data)
                    self._received(file, have, len(data))
                await self._pace(started, copied)
        except _HolderFailed as error:
            error.reached = have
            raise
        finally:
            self._parts.pop(fetch_id, None)

    def _ask(self, node: NodeId, fetch_id: str, model: HeldModel, file: HeldFile,
             offset: int, length: int) -> None:
        try:
            self._transport.send_data(node, {FILE_ASK_FIELD: {
                "fetch": fetch_id, "from": self._transport.node_id, "model": model.model,
                "path": file.path, "offset": offset, "length": length}})
        except TransportError as error:
            raise _HolderFailed(f"cannot reach it ({error})") from error

    async def _next_part(self, node: NodeId, parts: asyncio.Queue[dict[str, Any]]
                         ) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self._config.chunk_wait_s):
                part = await parts.get()
        except TimeoutError:
            gone = "" if node in self._transport.peers else " and left the cluster"
            raise _HolderFailed(f"sent nothing for {self._config.chunk_wait_s:g} s{gone}") \
                from None
        if "error" in part:
            raise _HolderFailed(str(part["error"]))
        return part

    async def _pace(self, started: float, copied: int) -> None:
        """Sleep while this fetch is ahead of --peer-fetch-rate."""
        rate = self._config.rate_bytes_per_s
        if rate is not None:
            ahead = copied / rate - (time.monotonic() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)

    def report(self, event: PullEvent) -> None:
        for observer in list(self.observers):
            try:
                observer(event)
            except Exception:  # noqa: BLE001 - a metrics hiccup must not stop a fetch
                log.exception("a fetch progress observer failed")


def _checked(part: dict[str, Any], offset: int, file: HeldFile) -> bytes:
    """A chunk's bytes once they match the hash they came with and fit the file."""
    data = part.get("data")
    if not isinstance(data, bytes) or not data or offset + len(data) > file.size:
        raise _HolderFailed(f"sent a malformed chunk at offset {offset}")
    if hashlib.sha256(data).hexdigest() != part.get("sha256"):
        raise _HolderFailed(f"the chunk at offset {offset} does not match its sha256")
    return data


def _write_at(out: BinaryIO, offset: int, data: bytes) -> None:
    out.seek(offset)
    out.write(data)
    out.flush()  # on its way to disk now, so that the copy's fsync finds little left
    start_writeback(out.fileno(), offset, len(data))


def _check_and_write(part: dict[str, Any], offset: int, file: HeldFile, out: BinaryIO) -> bytes:
    data = _checked(part, offset, file)
    _write_at(out, offset, data)
    return data


def _sync(out: BinaryIO) -> None:
    out.flush()
    os.fsync(out.fileno())
