"""What one runner process remembers for diagnosis, and its answers to Inspect.

The flight recorder holds the runner's recent phases (load stages, steps, errors); once the
engine is built, its step tracer's span buffer holds the spans of the requests it served.
Answers are built on the socket's reader thread (Channel), so a runner busy loading or in a
long step still answers at once: both buffers can be copied while the loop records.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from shoal.diagnostics.flight import FlightRecorder
from shoal.engine.core import EngineCore
from shoal.runner.messages import Inspect, Inspection
from shoal.tracing.spans import SpanBuffer

log = logging.getLogger("shoal.runner")


class RunnerRecords:
    def __init__(self, flight: FlightRecorder | None = None) -> None:
        self.flight = flight or FlightRecorder()
        self.spans: SpanBuffer | None = None  # the engine's, once it is built
        self.started_at = time.time()

    def watch(self, engine: EngineCore) -> None:
        """Read the built engine's spans, and record its steps in the flight recorder."""
        tracer = engine.tracer
        if tracer is not None:
            self.spans = tracer.spans
            tracer.on_step = self.flight.step

    def answer(self, raw: dict[str, Any]) -> Inspection | None:
        """The Inspection for a raw Inspect (None when it is malformed: logged)."""
        try:
            inspect = Inspect.model_validate(raw)
        except ValueError as error:
            log.error("malformed inspect message: %s", error)
            return None
        if inspect.what == "trace":
            spans = self.spans
            body = {"spans": spans.of(inspect.trace_id or "") if spans is not None else []}
        else:
            body = {"pid": os.getpid(), "started_at": self.started_at,
                    **self.flight.snapshot()}
            if self.spans is not None:
                body["spans"] = {"held": len(self.spans), "capacity": self.spans.capacity,
                                 "recorded": self.spans.recorded}
        return Inspection(query_id=inspect.query_id, body=body)
