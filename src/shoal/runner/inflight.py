"""The requests one runner holds, each with a bounded queue of the chunks not yet read.

The supervisor's read loop delivers every chunk here without waiting; each request's reader
takes them in order. A terminal chunk (finish, error, embedding, images_done) ends a
request: the runner holds nothing more of it. A reader that falls max_buffered_chunks
behind has its request cancelled in the runner and ended with a clear error, so memory
stays bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.protocol import ErrorChunk

TERMINAL_KINDS = ("finish", "error", "embedding", "images_done")


@dataclass
class Pending:
    queue: asyncio.Queue
    finished: bool = False  # a terminal chunk was queued (the runner holds nothing more)


class InFlight:
    """request id -> Pending; cancel(request_id) tells the runner to drop a request."""

    def __init__(self, max_buffered_chunks: int, chunk_timeout_s: float,
                 cancel: Callable[[str], None]) -> None:
        self._max_buffered = max_buffered_chunks
        self._chunk_timeout_s = chunk_timeout_s
        self._cancel = cancel
        self._pending: dict[str, Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def open(self, request_id: str, max_chunks: int | None = None) -> Pending:
        pending = Pending(asyncio.Queue(maxsize=max_chunks or self._max_buffered))
        self._pending[request_id] = pending
        return pending

    def close(self, request_id: str, pending: Pending) -> None:
        """The reader is done with the request; cancel it in the runner if it still runs."""
        self._pending.pop(request_id, None)
        if not pending.finished:
            self._cancel(request_id)

    async def next_chunk(self, request_id: str, pending: Pending) -> Any:
        """The request's next chunk, or a timeout ErrorChunk after chunk_timeout_s."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
        # that races with a chunk arriving, and the request would then run to its end.
        try:
            async with asyncio.timeout(self._chunk_timeout_s):
                return await pending.queue.get()
        except TimeoutError:
            return ErrorChunk(request_id=request_id, code="timeout",
                              message=f"no output from the runner for "
                                      f"{self._chunk_timeout_s:.0f} s")

    def deliver(self, chunk: Any) -> None:
        pending = self._pending.get(chunk.request_id)
        if pending is None or pending.finished:
            return  # cancelled or already failed; the runner may still report it
        if chunk.kind in TERMINAL_KINDS:
            _terminate(pending, chunk)
            return
        try:
            pending.queue.put_nowait(chunk)
        except asyncio.QueueFull:
            # The client stopped reading; keep memory bounded and end its stream clearly.
            self._cancel(chunk.request_id)
            _terminate(pending, ErrorChunk(
                request_id=chunk.request_id, code="overloaded",
                message="the client did not read its stream fast enough"))

    def cancel(self, request_id: str, message: str) -> None:
        """Drop a request the server gave up on: the runner is told, its reader gets an
        error chunk."""
        pending = self._pending.pop(request_id, None)
        if pending is not None and not pending.finished:
            self._cancel(request_id)
            _terminate(pending, ErrorChunk(request_id=request_id, code="invalid_request",
                                           message=message))

    def fail_all(self, code: str, message: str) -> None:
        """End every unfinished request with an error chunk (the runner is gone)."""
        for request_id, pending in list(self._pending.items()):
            if not pending.finished:
                _terminate(pending, ErrorChunk(request_id=request_id, code=code,
                                               message=message))


def _terminate(pending: Pending, chunk: Any) -> None:
    """Queue the request's last chunk, dropping unread ones if the queue is full."""
    pending.finished = True
    if pending.queue.full():
        while not pending.queue.empty():
            pending.queue.get_nowait()
    pending.queue.put_nowait(chunk)
