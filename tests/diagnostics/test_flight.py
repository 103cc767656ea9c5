"""The flight recorder keeps its last phases (oldest dropped), steps with timing and batch,
the stages of the latest load with their durations, and logged errors."""

from __future__ import annotations

import logging

from shoal.diagnostics.error_log import RecentErrors
from shoal.diagnostics.flight import FlightLogHandler, FlightRecorder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_ring_keeps_the_last_phases_and_counts_the_dropped():
    flight = FlightRecorder(capacity=3)
    for index in range(5):
        flight.step(index * 10**9, index * 10**9 + 2_500_000, requests=index, tokens=2 * index)
    snapshot = flight.snapshot()
    assert snapshot["dropped"] == 2
    assert [p["requests"] for p in snapshot["phases"]] == [2, 3, 4]
    assert snapshot["phases"][0] == {"at": 2.0, "phase": "step", "seconds": 0.0025,
                                     "requests": 2, "tokens": 4}


def test_load_stages_are_timed_and_kept_apart_from_the_ring():
    clock = Clock()
    flight = FlightRecorder(capacity=2, clock=clock)
    for stage, fraction, at in (("starting", 0.0, 100.0), ("tokenizer", 0.0, 100.5),
                                ("weights", 0.1, 101.0), ("weights", 0.9, 103.0),
                                ("ready", 1.0, 104.0)):
        clock.now = at
        flight.load_progress(stage, fraction)
    stages = flight.snapshot()["load"]
    assert [(s["stage"], s["seconds"]) for s in stages] == [
        ("starting", 0.5), ("tokenizer", 0.5), ("weights", 3.0), ("ready", 0.0)]
    for index in range(3):
        flight.step(0, 1, 1, 1)
    snapshot = flight.snapshot()
    assert [p["phase"] for p in snapshot["phases"]] == ["step", "step"]
    assert len(snapshot["load"]) == 4  # still there after the ring moved on


def test_a_failed_load_marks_its_stage_and_a_new_load_starts_afresh():
    clock = Clock()
    flight = FlightRecorder(clock=clock)
    flight.load_progress("weights", 0.5)
    clock.now = 102.0
    flight.load_failed()
    assert flight.snapshot()["load"] == [{"at": 100.0, "stage": "weights", "seconds": 2.0,
                                          "failed": True}]
    flight.load_progress("starting", 0.0)
    flight.load_progress("ready", 1.0)
    assert [s["stage"] for s in flight.snapshot()["load"]] == ["starting", "ready"]


def test_logged_warnings_and_errors_become_phases():
    flight = FlightRecorder()
    logger = logging.getLogger("shoal.test.flight")
    handler = FlightLogHandler(flight)
    logger.addHandler(handler)
    try:
        logger.info("fine")
        logger.error("engine step failed: %s", "boom" * 1000)
        logger.warning("slow")
    finally:
        logger.removeHandler(handler)
    phases = flight.snapshot()["phases"]
    assert [(p["phase"], p["level"]) for p in phases] == [("error", "ERROR"),
                                                         ("error", "WARNING")]
    assert phases[0]["message"].startswith("engine step failed: boom")
    assert len(phases[0]["message"]) == 2000 and phases[0]["logger"] == "shoal.test.flight"


def test_the_node_s_recent_errors_are_bounded():
    errors = RecentErrors(capacity=2)
    logger = logging.getLogger("shoal.test.errors")
    logger.addHandler(errors)
    try:
        logger.info("not kept")
        for index in range(3):
            logger.error("failure %d", index)
        try:
            raise ValueError("bad value")
        except ValueError:
            logger.exception("with an exception")
    finally:
        logger.removeHandler(errors)
    recent = errors.recent()
    assert [e["message"] for e in recent["errors"]] == [
        "failure 2", "with an exception (ValueError: bad value)"]
    assert recent["dropped"] == 2
