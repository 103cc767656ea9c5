"""Whether the node's data dir still takes writes: a probe file written, synced and removed,
and its free space against a floor. A full or read-only disk is a warning (in /health and on
the dashboard), never a stop: the node goes on serving, the event log stops persisting
(cluster/event_log.py), and pulls and copies from peers fail with their own errors."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("shoal.data_dir")

# The event log's own floor: below it, it stops persisting.
MIN_FREE_BYTES = 256 * 2**20
_PROBE_NAME = ".shoal-write-probe"
_CONSEQUENCES = ("the cluster's event log, pulls and copies of models cannot be written; "
                 "serving goes on")


def check_data_dir(path: Path, min_free_bytes: int = MIN_FREE_BYTES) -> str | None:
    """A warning about the data dir at path, or None when it takes writes and has room."""
    probe = Path(path) / f"{_PROBE_NAME}-{os.getpid()}"
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(descriptor, b"shoal")
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except OSError as error:
        return _write_failure(path, error)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    try:
        free = shutil.disk_usage(path).free
    except OSError as error:
        return f"the data dir {path} cannot be read ({error.strerror}): {_CONSEQUENCES}"
    if free < min_free_bytes:
        return (f"the data dir {path} is nearly full ({_mib(free)} free, below "
                f"{_mib(min_free_bytes)}): {_CONSEQUENCES}")
    return None


def _write_failure(path: Path, error: OSError) -> str:
    if error.errno == errno.EROFS:
        return f"the data dir {path} is on a read-only disk: {_CONSEQUENCES}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the data dir {path} is full: {_CONSEQUENCES}"
    return f"the data dir {path} cannot be written ({error.strerror}): {_CONSEQUENCES}"


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


class DataDirWatch:
    """Checks the data dir every interval_s, off the event loop; `warning` is the latest
    finding (None: all well). A change is logged once."""

    def __init__(self, path: Path, interval_s: float = 10.0,
                 min_free_bytes: int = MIN_FREE_BYTES) -> None:
        if interval_s <= 0:
            raise ValueError("data dir check interval must be positive")
        self.path = Path(path)
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.warning: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def check(self) -> str | None:
        warning = await asyncio.to_thread(check_data_dir, self.path, self.min_free_bytes)
        if warning != self.warning:
            if warning is not None:
                log.warning("%s", warning)
            else:
                log.info("the data dir %s takes writes again", self.path)
        self.warning = warning
        return warning

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="data-dir-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)
