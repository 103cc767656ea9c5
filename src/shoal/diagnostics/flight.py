"""A runner's flight recorder: its last phases (load stages, engine steps with their timing
and batch, errors with their message) in a ring buffer, oldest dropped.

Recording a step is one tuple appended to a deque (it runs after every engine step); the
dicts a reader sees are built only when it asks. The stages of the latest load are also
kept apart, so a long run of steps does not push out how the model loaded.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

DEFAULT_CAPACITY = 256
_MAX_LOAD_STAGES = 64
_MAX_MESSAGE = 2000  # characters of a logged error kept (a traceback's tail is dropped)


class FlightRecorder:
    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError("a flight recorder holds at least one phase")
        self._clock = clock
        # (unix seconds, phase, details: dict, or (seconds, requests, tokens) for a step)
        self._phases: collections.deque[tuple[float, str, Any]] = \
            collections.deque(maxlen=capacity)
        self._load: collections.deque[dict[str, Any]] = \
            collections.deque(maxlen=_MAX_LOAD_STAGES)
        self._stage: tuple[str, float] | None = None  # the load stage under way, since when
        self.recorded = 0

    def record(self, phase: str, **details: Any) -> None:
        self._phases.append((self._clock(), phase, details))
        self.recorded += 1

    def step(self, start_ns: int, end_ns: int, requests: int, tokens: int) -> None:
        """One engine step (steps.StepListener's signature)."""
        self._phases.append((start_ns / 1e9, "step",
                             ((end_ns - start_ns) / 1e9, requests, tokens)))
        self.recorded += 1

    def error(self, message: str, **details: Any) -> None:
        self.record("error", message=message, **details)

    def load_progress(self, stage: str, fraction: float) -> None:
        """A load's progress report: a phase is recorded when a stage ends (with how long
        it took), and when the load is done ("ready")."""
        now = self._clock()
        if self._stage is None:
            self._load.clear()
        if self._stage is not None and self._stage[0] != stage:
            self._end_stage(now)
        if self._stage is None:
            self._stage = (stage, now)
        if stage == "ready" and fraction >= 1.0:
            self._end_stage(now)

    def load_failed(self) -> None:
        """The load raised: its stage under way ends, marked failed (the error itself comes
        as its own phase, from the log)."""
        if self._stage is not None:
            self._end_stage(self._clock(), failed=True)

    def _end_stage(self, now: float, failed: bool = False) -> None:
        stage, since = self._stage  # type: ignore[misc]
        self._stage = None
        details = {"stage": stage, "seconds": round(now - since, 4)}
        if failed:
            details["failed"] = True
        self._load.append({"at": since, **details})
        self._phases.append((since, "load", details))
        self.recorded += 1

    def snapshot(self) -> dict[str, Any]:
        """{"phases": [{"at", "phase", ...}] oldest first, "load": the latest load's
        stages, "dropped": phases no longer held}. Readable from another thread."""
        phases = [_phase_dict(entry) for entry in self._phases.copy()]
        return {"phases": phases, "load": list(self._load.copy()),
                "dropped": self.recorded - len(phases)}


def _phase_dict(entry: tuple[float, str, Any]) -> dict[str, Any]:
    at, phase, details = entry
    if phase == "step":
        seconds, requests, tokens = details
        return {"at": at, "phase": "step", "seconds": round(seconds, 6),
                "requests": requests, "tokens": tokens}
    return {"at": at, "phase": phase, **details}


class FlightLogHandler(logging.Handler):
    """Every log record at WARNING or above becomes an "error" phase (message, logger,
    level), so whatever the runner logs as wrong is in its flight recorder."""

    def __init__(self, recorder: FlightRecorder) -> None:
        super().__init__(logging.WARNING)
        self.recorder = recorder

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.recorder.error(record.getMessage()[:_MAX_MESSAGE], logger=record.name,
                                level=record.levelname)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)
