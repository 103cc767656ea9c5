"""The holder's side of a peer copy (model_transfer.py): answers other nodes' asks for the
files this node advertises (held_models.py; nothing else is ever read).

Two kinds of ask arrive on the data key:
- {"model_file_stream_ask": {fetch, from, model, path, sha256, offset, length, rate}}: a
  direct stream (file_stream.py). The holder checks that the file it holds now is the version
  whose sha256 was asked for, opens a one-off listener on its own address and answers
  {"model_file_stream_offer": {fetch, host, port, token, piece_bytes}}, or {fetch, error};
- {"model_file_ask": {fetch, from, model, path, offset, length}}: one chunk over the data
  plane itself (the fallback where no stream opens), answered {"model_file_part": {fetch,
  offset, data, sha256}} or {..., "error"}.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.catalog.file_hashes import CHUNK_BYTES
from shoal.cluster.background import run_on_thread
from shoal.cluster.data_plane import (
    FILE_ASK_FIELD,
    FILE_PART_FIELD,
    FILE_STREAM_ASK_FIELD,
    FILE_STREAM_OFFER_FIELD,
    SEND_ROOM_WAIT_S,
)
from shoal.cluster.file_stream import SLICE_BYTES, StreamServer
from shoal.cluster.held_models import HeldModels
from shoal.cluster.transport.base import Transport, TransportError
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.transfer")

MAX_ASK_BYTES = 16 * 1024 * 1024  # the most one data-plane ask may read


class _Refused(Exception):
    """An ask this node does not serve; the message is the answer's error."""


class ModelFileServer:
    """Serves asks for this node's advertised files. host(): the address peers reach this
    node at; wait_s: how long an offer waits for its asker, and a stream for it to read;
    context: TLS for streams (None: plain, the token alone proves the asker)."""

    def __init__(self, transport: Transport, held: HeldModels, host: Callable[[], str],
                 wait_s: float, context: ssl.SSLContext | None) -> None:
        self._transport = transport
        self.held = held
        self._host = host
        self._wait_s = wait_s
        self._context = context
        self._tasks: set[asyncio.Task] = set()
        # A stream's pieces: FileHashes' chunks, so that their digests are already known.
        self.piece_bytes = CHUNK_BYTES
        self.served_bytes = 0  # bytes sent to peers, either way

    def handle(self, message: dict[str, Any]) -> bool:
        """Take message if it is an ask (True), serving it in the background."""
        for field, serve in ((FILE_STREAM_ASK_FIELD, self._stream),
                             (FILE_ASK_FIELD, self._relay)):
            if isinstance(message.get(field), dict):
                task = asyncio.get_running_loop().create_task(serve(message[field]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return True
        return False

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _stream(self, ask: dict[str, Any]) -> None:
        try:
            asker, fetch_id = NodeId(str(ask["from"])), str(ask["fetch"])
            offset, length = int(ask["offset"]), int(ask["length"])
            rate = float(ask["rate"]) if ask.get("rate") else None
            relative, sha256 = str(ask["path"]), str(ask["sha256"])
            path = self.held.path_of(str(ask["model"]), relative)
        except (KeyError, TypeError, ValueError):
            log.warning("malformed model file stream ask dropped")
            return
        answer: dict[str, Any] = {"fetch": fetch_id}
        server = None
        try:
            server = await asyncio.to_thread(self._open, path, relative, sha256, offset,
                                             length, rate, asyncio.get_running_loop())
            answer.update(server.offer.to_wire())
        except _Refused as error:
            answer["error"] = str(error)
        except OSError as error:
            answer["error"] = f"cannot offer a stream of {relative}: {error}"
        try:
            self._transport.send_data(asker, {FILE_STREAM_OFFER_FIELD: answer})
        except TransportError as error:
            log.warning("cannot send a model file stream offer to %s: %s", asker, error)
            if server is not None:
                server.close()
            return
        if server is not None:
            await run_on_thread(server.run, server.cancel)

    def _open(self, path: Path | None, relative: str, sha256: str, offset: int, length: int,
              rate: float | None, loop: asyncio.AbstractEventLoop) -> StreamServer:
        """A listener for the ask (blocking: stats the file); _Refused when this node does
        not hold that version of the file, or the range is not in it."""
        node = self._transport.node_id
        if path is None or offset < 0 or length <= 0:
            raise _Refused(f"node {node} does not hold {relative}")
        if self.held.hashes.cached(path) != sha256:
            raise _Refused(f"node {node} holds another version of {relative} now")
        if offset + length > path.stat().st_size:
            raise _Refused(f"{relative} holds no bytes [{offset}, {offset + length})")
        # A slow asker reads a slice per SLICE_BYTES / rate seconds: the holder waits that too.
        wait_s = self._wait_s + (SLICE_BYTES / rate if rate else 0.0)
        digests = self.held.hashes.chunk_digests(sha256) \
            if self.piece_bytes == CHUNK_BYTES else None
        return StreamServer(self._host(), path, offset, offset + length, chunk_digests=digests,
                            piece_bytes=self.piece_bytes, wait_s=wait_s, context=self._context,
                            on_sent=lambda n: loop.call_soon_threadsafe(self._sent, n),
                            rate=rate)

    def _sent(self, length: int) -> None:
        self.served_bytes += length

    async def _relay(self, ask: dict[str, Any]) -> None:
        try:
            asker, fetch_id = NodeId(str(ask["from"])), str(ask["fetch"])
            offset, length = int(ask["offset"]), int(ask["length"])
            path = self.held.path_of(str(ask["model"]), str(ask["path"]))
        except (KeyError, TypeError, ValueError):
            log.warning("malformed model file ask dropped")
            return
        answer: dict[str, Any] = {"fetch": fetch_id, "offset": offset}
        if path is None or offset < 0 or not 0 < length <= MAX_ASK_BYTES:
            answer["error"] = f"node {self._transport.node_id} does not hold {ask['path']}"
        else:
            try:
                data, digest = await asyncio.to_thread(_read_and_hash, path, offset, length)
                answer.update(data=data, sha256=digest)
                self.served_bytes += len(data)
            except OSError as error:
                answer["error"] = f"cannot read {ask['path']}: {error}"
        try:
            await self._transport.room(SEND_ROOM_WAIT_S)  # parts are large: back-pressure
            self._transport.send_data(asker, {FILE_PART_FIELD: answer})
        except TransportError as error:
            log.warning("cannot send a model file part to %s: %s", asker, error)


def _read_and_hash(path: Path, offset: int, length: int) -> tuple[bytes, str]:
    with open(path, "rb") as file:
        file.seek(offset)
        data = file.read(length)
    return data, hashlib.sha256(data).hexdigest()
