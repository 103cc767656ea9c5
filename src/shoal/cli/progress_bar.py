"""Draw a pull's progress events (Ollama's status lines as dicts) on a terminal: one bar
per file, redrawn in place; anywhere else, one line per status and per finished file."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

_WIDTH = 30


def describe(event: dict[str, Any]) -> str:
    """One progress line: the status, with a percentage when the event counts bytes."""
    status = str(event.get("status", ""))
    total, completed = event.get("total"), event.get("completed")
    if isinstance(total, int) and isinstance(completed, int) and total > 0:
        return (f"{status} {100 * completed / total:.0f}% "
                f"({completed / 2**20:.1f} / {total / 2**20:.1f} MiB)")
    return status


class ProgressBar:
    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.live = self.out.isatty()
        self._status: str | None = None
        self._drawn = False
        self._started = time.monotonic()

    def show(self, event: dict[str, Any]) -> None:
        status = str(event.get("status", ""))
        total = event.get("total")
        counted = isinstance(total, int) and total > 0
        finished = counted and event.get("completed") == total
        if status != self._status:
            self._end_line()
            self._status, self._started = status, time.monotonic()
        if self.live and counted:
            self.out.write(f"\r{self._bar(event)}\033[K")
            self._drawn = True
            if finished:
                self._end_line()
        elif not counted or finished:  # off a terminal: each status once, files when done
            self.out.write(describe(event) + "\n")
        self.out.flush()

    def close(self) -> None:
        self._end_line()

    def _bar(self, event: dict[str, Any]) -> str:
        total, completed = event["total"], event.get("completed") or 0
        filled = int(_WIDTH * completed / total)
        elapsed = max(time.monotonic() - self._started, 1e-3)
        return (f"{event['status']} [{'#' * filled}{'.' * (_WIDTH - filled)}] "
                f"{100 * completed / total:3.0f}% {completed / 2**20:.1f}/"
                f"{total / 2**20:.1f} MiB {completed / 2**20 / elapsed:.1f} MiB/s")

    def _end_line(self) -> None:
        if self._drawn:
            self.out.write("\n")
            self._drawn = False
