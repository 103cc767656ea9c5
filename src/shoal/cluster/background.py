"""Ending the cluster's background tasks with a bound, so a stop can never hang; blocking work
on a thread that a cancelled task ends."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

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


async def run_on_thread(work: Callable[[], T], cancel: Callable[[], None]) -> T:
    """work() on a thread of its own (long transfers must not hold the default executor's
    few threads); when the caller is cancelled, cancel() (which must make work end soon)
    and wait for the thread, so nothing work uses is closed under it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def body() -> None:
        result, error = None, None
        try:
            result = work()
        except BaseException as raised:  # noqa: BLE001 - handed to the awaiting task
            error = raised
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=body, name=getattr(work, "__qualname__", "work"),
                     daemon=True).start()
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel()
        await asyncio.wait([future])
        raise
