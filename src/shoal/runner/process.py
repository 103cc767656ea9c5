"""Stopping a runner process: the bounded cleanup chain join -> SIGTERM -> SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

log = logging.getLogger("shoal.supervisor")


async def stop_process(proc: asyncio.subprocess.Process, grace_s: float,
                       terminate_grace_s: float) -> None:
    """Wait grace_s for a clean exit, then SIGTERM, then SIGKILL; every wait bounded."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, terminate_grace_s),
                        (signal.SIGKILL, 5.0)):
        if proc.returncode is not None:
            return
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await proc.wait()
    if proc.returncode is None:
        log.error("runner %d did not die after SIGKILL", proc.pid)
