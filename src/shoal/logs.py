"""Log output of `shoal serve` and its runner processes: text for people, or one JSON object
per line for log shippers (--log-format json, SHOAL_LOG_FORMAT).

The format travels to runner processes in SHOAL_LOG_FORMAT, so a node's whole stderr is in
one format.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

FORMATS = ("text", "json")
ENV = "SHOAL_LOG_FORMAT"


def log_format(flag: str | None = None) -> str:
    """The format asked for by flag, else SHOAL_LOG_FORMAT, else text (ValueError if bad)."""
    value = flag or os.environ.get(ENV) or "text"
    if value not in FORMATS:
        raise ValueError(f"log format must be text or json, not {value!r}")
    return value


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "process", "role", "message"[, "exception"]} per record."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(),
                 "level": record.levelname, "logger": record.name, "process": record.process,
                 "role": self.role, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(role: str, text_format: str, flag: str | None = None) -> str:
    """Send INFO and above to stderr in the chosen format; returns the format, also put in
    SHOAL_LOG_FORMAT for child processes."""
    chosen = log_format(flag)
    os.environ[ENV] = chosen
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if chosen == "json"
                         else logging.Formatter(text_format))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    # httpx logs each request it sends at INFO: a line per generation served by llama-server
    # (and per peer or hub call) is noise in the node's log, and its write sits on the path.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return chosen
