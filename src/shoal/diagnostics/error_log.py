"""The node's recent errors: a logging handler keeping the last WARNING-and-above records
of the node process in a ring (the runners' own are in their flight recorders)."""

from __future__ import annotations

import collections
import logging
from typing import Any

DEFAULT_CAPACITY = 200
_MAX_MESSAGE = 2000  # characters kept of one message (a traceback's tail is dropped)


class RecentErrors(logging.Handler):
    def __init__(self, capacity: int = DEFAULT_CAPACITY, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._records: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self.seen = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
            self._records.append({"at": record.created, "level": record.levelname,
                                  "logger": record.name, "message": message[:_MAX_MESSAGE]})
            self.seen += 1
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)

    def recent(self) -> dict[str, Any]:
        """{"errors": oldest first, "dropped": how many older ones are gone}."""
        errors = list(self._records.copy())
        return {"errors": errors, "dropped": self.seen - len(errors)}
