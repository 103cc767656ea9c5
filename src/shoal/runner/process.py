"""A runner process: starting it and its connection back, and stopping it (the bounded
cleanup chain join -> SIGTERM -> SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger("shoal.supervisor")


@dataclass
class RunnerProcess:
    """One spawned runner and its socket (its supervisor's view of it)."""

    proc: asyncio.subprocess.Process
    writer: asyncio.StreamWriter | None = None
    reader_task: asyncio.Task | None = None
    ready: bool = False
    load_failed: str | None = None


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


Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def spawn_runner(command: Sequence[str], env: Mapping[str, str],
                       connect_timeout_s: float, terminate_grace_s: float,
                       started: Callable[[asyncio.subprocess.Process], None]) -> Streams | None:
    """Start the runner (command, e.g. `python -m shoal.runner.entrypoint`, with --socket
    and --parent-pid) and wait up to connect_timeout_s for it to dial back over a private
    unix socket. started(proc) is told of the process at once (so a shutdown meanwhile can
    stop it). Returns its streams, or None when it exited or stayed silent (it is then
    stopped)."""
    socket_dir = tempfile.mkdtemp(prefix="shoal-runner-")
    socket_path = os.path.join(socket_dir, "runner.sock")
    connected: asyncio.Future[Streams] = asyncio.get_running_loop().create_future()

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not connected.done():
            connected.set_result((reader, writer))
        else:
            writer.close()

    server = await asyncio.start_unix_server(on_connect, path=socket_path)
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, "--socket", socket_path, "--parent-pid", str(os.getpid()),
            stdin=asyncio.subprocess.DEVNULL, env=dict(env))
        started(proc)
        exited = asyncio.ensure_future(proc.wait())
        try:
            await asyncio.wait({connected, exited}, timeout=connect_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if not connected.done():
            connected.cancel()
            await stop_process(proc, 0.1, terminate_grace_s)
            return None
        return connected.result()
    finally:
        server.close()
        shutil.rmtree(socket_dir, ignore_errors=True)
