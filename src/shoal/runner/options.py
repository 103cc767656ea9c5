"""Bounds and policies of one runner supervisor: timeouts, crash window, backoff, limits."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

# How a runner process starts; the supervisor appends --socket PATH --parent-pid PID.
RUNNER_COMMAND = (sys.executable, "-m", "shoal.runner.entrypoint")


@dataclass(frozen=True)
class SupervisorOptions:
    load_timeout_s: float = 600.0
    # How long a request waits for a starting or restarting runner before it gets a 503.
    ready_wait_s: float = 120.0
    # Longest silence between two chunks of one request before it fails with "timeout".
    chunk_timeout_s: float = 600.0
    max_in_flight: int = 256
    max_buffered_chunks: int = 4096
    restart_backoff_s: tuple[float, ...] = (0.5, 2.0, 5.0)
    max_crashes: int = 3
    crash_window_s: float = 60.0
    shutdown_grace_s: float = 5.0
    terminate_grace_s: float = 3.0
    # The runner's command line (tests start a runner of fake engines instead).
    runner_command: tuple[str, ...] = RUNNER_COMMAND
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("load_timeout_s", "ready_wait_s", "chunk_timeout_s", "crash_window_s",
                     "shutdown_grace_s", "terminate_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_in_flight < 1 or self.max_buffered_chunks < 1 or self.max_crashes < 1:
            raise ValueError("max_in_flight, max_buffered_chunks and max_crashes must be >= 1")
        if not self.restart_backoff_s:
            raise ValueError("restart_backoff_s needs at least one delay")
        if not self.runner_command:
            raise ValueError("runner_command needs at least the program to run")
