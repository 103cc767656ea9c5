"""Progress of a pull, one event at a time: the status lines of Ollama's /api/pull stream,
which the CLI draws as a bar and the node counts in /metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PullEvent:
    """status is Ollama's: "pulling manifest", "pulling <digest prefix>", "verifying sha256
    digest", "writing manifest", "success"; byte counts only while a file downloads."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None
    new_bytes: int = 0  # bytes that just came over the network (not resumed from disk)
    source: str | None = None  # "huggingface" / "ollama", for the metrics' label

    def to_json(self) -> dict[str, object]:
        line: dict[str, object] = {"status": self.status}
        if self.digest is not None:
            line["digest"] = self.digest
        if self.total is not None:
            line["total"] = self.total
            line["completed"] = self.completed or 0
        return line


Progress = Callable[[PullEvent], None]


def ignore(_event: PullEvent) -> None:
    """A Progress that drops every event."""
