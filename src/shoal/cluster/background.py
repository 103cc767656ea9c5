"""Ending the cluster's background tasks with a bound, so a stop can never hang."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("shoal.cluster")


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None], timeout_s: float = 2.0) -> None:
    """Cancel tasks and wait up to timeout_s for them to end; log any that did not."""
    pending = [task for task in tasks if task is not None and not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _, still_running = await asyncio.wait(pending, timeout=timeout_s)
    for task in still_running:
        log.error("background task %s did not stop within %gs", task.get_name(), timeout_s)
