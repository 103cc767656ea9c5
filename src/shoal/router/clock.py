"""Where a request's time went, for the errors it may end with."""

from __future__ import annotations

import time

from shoal.protocol import ErrorChunk

# Errors that say where the request's time went (not validation errors: those are instant).
_TIMED_CODES = ("unavailable", "timeout", "runner_crashed", "overloaded", "internal")


class RequestClock:
    """Where a request's time went: waiting in the queue, loading its model, generating."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._queued: float | None = None
        self._loaded: float | None = None

    def queued(self) -> float:
        self._queued = time.monotonic()
        return self._queued - self._start

    def loaded(self) -> float:
        self._loaded = time.monotonic()
        return self._loaded - (self._queued or self._start)

    def explain(self, chunk: ErrorChunk) -> ErrorChunk:
        """chunk, its message ending with the time spent in each stage so far."""
        if chunk.code not in _TIMED_CODES:
            return chunk
        now = time.monotonic()
        queued = (self._queued or now) - self._start
        parts = [f"queue {queued:.1f} s"]
        if self._queued is not None:
            parts.append(f"load {(self._loaded or now) - self._queued:.1f} s")
        if self._loaded is not None:
            parts.append(f"generation {now - self._loaded:.1f} s")
        return chunk.model_copy(update={"message": f"{chunk.message} (time: "
                                                   f"{', '.join(parts)})"})
