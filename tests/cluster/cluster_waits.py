"""Bounded waits shared by the cluster tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0,
                     what: str = "condition") -> float:
    """Poll predicate every 10 ms; the seconds it took, or AssertionError after timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start
