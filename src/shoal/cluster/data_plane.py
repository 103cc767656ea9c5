"""The data plane: token chunks from the node serving a task to the node holding its client.

The serving node sends each chunk to data/<owner> as {"request_id", "seq", "chunk"} with seq
counting from 0 per task. The owner reorders by seq, drops duplicates, and ends a stream
with a clear error when its producer falls silent: the silence bound starts at the first
chunk, because before it the task may wait for a model to load (that wait has its own bound).
A chunk that never comes while later ones do was lost: the stream ends with an error once
the gap has lasted `gap_timeout_s` or `reorder_limit` later chunks wait behind it (so the
buffer is bounded), not after the silence bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import pydantic
from pydantic import TypeAdapter

from shoal.cluster.card_exchange import CARDS_FIELD
from shoal.cluster.proposer_service import PROPOSAL_FIELD
from shoal.cluster.queries import ANSWER_FIELD
from shoal.cluster.state import ClusterState
from shoal.cluster.transport.base import Subscription, Transport
from shoal.ids import NodeId
from shoal.protocol import Chunk, ErrorChunk, ErrorCode, chunk_to_wire

log = logging.getLogger("shoal.cluster.data")

_chunks: TypeAdapter[Chunk] = TypeAdapter(Chunk)
TERMINAL_KINDS = ("finish", "error", "embedding")
# Prefix KV between nodes (prefix_share.py): a request to export, and a part of the answer.
KV_FETCH_FIELD = "kv_fetch"
KV_PART_FIELD = "kv_part"
# Model files between nodes (model_transfer.py): a request for a range, and a part of a file.
FILE_ASK_FIELD = "model_file_ask"
FILE_PART_FIELD = "model_file_part"
# ... and over a direct stream (file_stream.py): a request for one, and the holder's offer.
FILE_STREAM_ASK_FIELD = "model_file_stream_ask"
FILE_STREAM_OFFER_FIELD = "model_file_stream_offer"
# How long a bulk sender waits for room in a congested transport before it gives up with a
# TransportError (the receiver then hears of the failure, or its own bound ends the wait).
SEND_ROOM_WAIT_S = 10.0
# Messages on the data key that are not token chunks (queries.py, card_exchange.py,
# proposer_service.py, prefix_share.py, model_transfer.py) carry one of these fields.
_OTHER_FIELDS = (ANSWER_FIELD, CARDS_FIELD, PROPOSAL_FIELD, KV_FETCH_FIELD,
                 KV_PART_FIELD, FILE_ASK_FIELD, FILE_PART_FIELD, FILE_STREAM_ASK_FIELD,
                 FILE_STREAM_OFFER_FIELD)


def chunk_message(request_id: str, seq: int, chunk: Any) -> dict[str, Any]:
    """The wire form of one chunk of a task."""
    return {"request_id": request_id, "seq": seq, "chunk": chunk_to_wire(chunk)}


class ChunkSender:
    """Numbers one task's chunks and sends them to its owner, waiting for room in the
    transport (back-pressure on the runner's stream) rather than losing one."""

    def __init__(self, transport: Transport, owner: NodeId, request_id: str) -> None:
        self._transport = transport
        self._owner = owner
        self._request_id = request_id
        self.seq = 0

    async def send(self, chunk: Any) -> None:
        """TransportError when the link stays congested for SEND_ROOM_WAIT_S."""
        await self._transport.room(SEND_ROOM_WAIT_S)
        self._transport.send_data(self._owner, chunk_message(self._request_id, self.seq, chunk))
        self.seq += 1


@dataclass(frozen=True)
class StreamLimits:
    # Chunks that may wait behind a missing one; one more and the missing one is lost.
    reorder_limit: int = 256
    # A missing chunk not come this long after a later one arrived is lost.
    gap_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.reorder_limit < 1:
            raise ValueError("stream reorder_limit must be >= 1")
        if self.gap_timeout_s <= 0:
            raise ValueError("stream gap_timeout_s must be positive")


class RemoteStream:
    """One task's chunks in seq order. next() waits with the bounds given by its caller."""

    def __init__(self, request_id: str, limits: StreamLimits | None = None) -> None:
        self.request_id = request_id
        self.limits = limits or StreamLimits()
        self._next_seq = 0
        self._early: dict[int, Any] = {}  # chunks that arrived ahead of a gap
        self._gap_since: float | None = None  # when the first chunk behind the gap came
        self._ready: asyncio.Queue[Any] = asyncio.Queue()
        self.first_chunk_at: float | None = None
        self.finished = False  # a terminal chunk was queued
        self.failed_here = False  # ended by this node (fail()), not by its producer
        self.duplicates = 0

    def push(self, seq: int, chunk: Any) -> None:
        if self.finished or seq < self._next_seq or seq in self._early:
            self.duplicates += 1
            return
        if seq > self._next_seq and len(self._early) >= self.limits.reorder_limit:
            self._lose(f"{len(self._early) + 1} later chunks arrived")
            return
        self._early[seq] = chunk
        advanced = False
        while (chunk := self._early.pop(self._next_seq, None)) is not None:
            self._next_seq += 1
            advanced = True
            self._queue(chunk)
        if not self._early:
            self._gap_since = None
        elif advanced or self._gap_since is None:
            self._gap_since = time.monotonic()  # a new gap begins now

    def fail(self, code: ErrorCode, message: str) -> None:
        """End the stream with an error (the task failed, or its producer went silent)."""
        if not self.finished:
            self.failed_here = True
            self._queue(ErrorChunk(request_id=self.request_id, code=code, message=message))

    def _lose(self, why: str) -> None:
        self._early.clear()
        self._gap_since = None
        self.fail("unavailable", f"chunk {self._next_seq} of this request's stream was lost "
                                 f"on the way from the serving node ({why}); retry it")

    def _check_gap(self) -> float | None:
        """Seconds the current gap may still last (None: no gap); fails a gap past its bound."""
        if self._gap_since is None:
            return None
        left = self._gap_since + self.limits.gap_timeout_s - time.monotonic()
        if left <= 0:
            self._lose(f"{len(self._early)} later chunks arrived, it did not within "
                       f"{self.limits.gap_timeout_s:g} s")
            return None
        return left

    def _queue(self, chunk: Any) -> None:
        if self.finished:
            return
        if self.first_chunk_at is None:
            self.first_chunk_at = time.monotonic()
        self.finished = chunk.kind in TERMINAL_KINDS
        self._ready.put_nowait(chunk)

    async def next(self, timeout_s: float) -> Any:
        """The next chunk in order (an error once a chunk is lost); TimeoutError after
        timeout_s without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            gap_left = self._check_gap()
            if not self._ready.empty():
                return self._ready.get_nowait()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                async with asyncio.timeout(left if gap_left is None else min(left, gap_left)):
                    return await self._ready.get()
            except TimeoutError:
                continue  # the gap's bound or the caller's: the loop's top tells which


class RemoteStreams:
    """The streams this node owns, fed from its data key."""

    def __init__(self, transport: Transport, limits: StreamLimits | None = None) -> None:
        self._transport = transport
        self.limits = limits or StreamLimits()
        self._streams: dict[str, RemoteStream] = {}
        # This node's streams whose task the master created (TaskCreated, or a state
        # holding it): one missing from a later state was failed or finished unheard.
        self._accepted: set[str] = set()
        self._subscription: Subscription | None = None
        self.unknown = 0  # chunks for streams this node does not hold (late, or cancelled)

    def start(self) -> None:
        self._subscription = self._transport.subscribe_data(self._on_data)

    def stop(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        for stream in self._streams.values():
            stream.fail("unavailable", "this node is shutting down")

    def open(self, request_id: str) -> RemoteStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = self._streams[request_id] = RemoteStream(request_id, self.limits)
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._accepted.discard(request_id)

    def accept(self, request_id: str) -> None:
        """The master created the task of this node's stream request_id."""
        self._accepted.add(request_id)

    def accepted(self, request_id: str) -> bool:
        return request_id in self._accepted

    def settle(self, state: ClusterState, node_id: NodeId) -> None:
        """After the state was replaced (a new session began, or a sync) for node_id: a task
        of its open streams that state holds was accepted; one accepted before and missing
        now was failed or finished unheard (a new session carries no task in flight), and
        its stream ends now, retryable, instead of at its silence bound."""
        for request_id, stream in list(self._streams.items()):
            task = state.tasks.get(request_id)
            if task is not None and task.owner_node == node_id:
                self._accepted.add(request_id)
            elif request_id in self._accepted:
                stream.fail("unavailable", f"the cluster master changed (now "
                                           f"{state.session_master}) while this request "
                                           "was in flight; retry it")

    def get(self, request_id: str) -> RemoteStream | None:
        return self._streams.get(request_id)

    def _on_data(self, message: Any) -> None:
        if isinstance(message, dict) and any(f in message for f in _OTHER_FIELDS):
            return  # query answers, capability cards, proposals share this key
        try:
            request_id, seq = str(message["request_id"]), int(message["seq"])
            chunk = _chunks.validate_python(message["chunk"])
        except (TypeError, KeyError, ValueError, pydantic.ValidationError) as error:
            log.warning("malformed data-plane message dropped: %s", error)
            return
        stream = self._streams.get(request_id)
        if stream is None:
            self.unknown += 1
            return
        stream.push(seq, chunk)


class StreamDeadlines(Protocol):
    """How long the owner of a remote task waits at each stage (cluster/service.py's
    ServiceConfig)."""

    accept_timeout_s: float  # for the master to take the task
    first_chunk_timeout_s: float  # for the first chunk (a model may load meanwhile)
    silence_timeout_s: float  # between chunks once the first came
    peer_gone_s: float  # with the serving node absent from the cluster


def stream_failure(deadlines: StreamDeadlines, now: float, sent_at: float,
                   last_chunk_at: float | None, accepted: bool, gone_since: float | None,
                   server: NodeId | None) -> tuple[str, str] | None:
    """(code, message) when a remote task's stream must end now, else None."""
    if gone_since is not None and now - gone_since >= deadlines.peer_gone_s:
        return ("unavailable", f"node {server} serving this request left the cluster")
    if last_chunk_at is not None:
        if now - last_chunk_at >= deadlines.silence_timeout_s:
            return ("timeout", f"node {server} serving this request fell silent for "
                               f"{deadlines.silence_timeout_s:.0f} s")
        return None
    if not accepted and now - sent_at >= deadlines.accept_timeout_s:
        return ("unavailable", "the cluster master did not take the request within "
                               f"{deadlines.accept_timeout_s:.0f} s; retry it")
    if now - sent_at >= deadlines.first_chunk_timeout_s:
        return ("timeout", f"node {server} did not start answering within "
                           f"{deadlines.first_chunk_timeout_s:.0f} s")
    return None
