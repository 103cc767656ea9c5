"""What every runner supervisor shares, whatever process it owns (shoal's runner, a
llama-server): its states, the bounded wait for ready, admission of a request, crash counting
with restart backoff, the tasks it owns, and the order of a shutdown.

A subclass owns the process: _spawn starts it (and sets "ready", or calls _fail / _crashed),
_stop_process stops it, _cancel_in_runner drops one request in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from shoal.protocol import ErrorChunk
from shoal.runner.inflight import InFlight
from shoal.runner.messages import MemoryUsage, ModelInfo
from shoal.runner.options import SupervisorOptions

RunnerState = Literal["stopped", "starting", "ready", "restarting", "failed"]
ProgressCallback = Callable[[str, str, float], None]  # (model_id, stage, fraction)


class RunnerUnavailable(RuntimeError):
    """The runner could not be (re)started; the message says why."""


class RunnerLifecycle:
    backend = "engine"
    log = logging.getLogger("shoal.supervisor")

    def __init__(self, model_id: str, options: SupervisorOptions | None,
                 on_progress: ProgressCallback | None) -> None:
        self.options = options or SupervisorOptions()
        self.on_progress = on_progress
        self.model_id = model_id
        self.state: RunnerState = "stopped"
        self.model_info: ModelInfo | None = None
        # What the runner holds now (its report, or its process's measure); None when gone.
        self.memory: MemoryUsage | None = None
        self.last_error: str | None = None
        # The runner's latest load report: stage ("weights", "ready", ...) and its fraction.
        self.load_stage: str | None = None
        self.load_progress = 0.0
        self.restarts = 0
        # Wall-clock time (unix seconds) the router will stop this runner if it stays idle;
        # None when it is kept loaded indefinitely. Set by the router's keep-alive.
        self.expires_at: float | None = None
        self.generated_tokens = 0  # tokens streamed back over the runner's life (throughput)
        self._requests = InFlight(self.options.max_buffered_chunks,
                                  self.options.chunk_timeout_s, self._cancel_in_runner)
        self._crash_times: list[float] = []
        self._state_changed = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._stopping = False

    # ---- what the subclass provides -----------------------------------------------------

    async def _spawn(self) -> None:
        raise NotImplementedError

    async def _stop_process(self) -> None:
        raise NotImplementedError

    def _cancel_in_runner(self, request_id: str) -> None:
        raise NotImplementedError

    # ---- public -------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    async def start(self) -> None:
        """Spawn the runner and wait (bounded) until it is ready; RunnerUnavailable if not."""
        if self.state in ("ready", "starting", "restarting"):
            await self.wait_ready(self.options.load_timeout_s)
            return
        self._stopping = False
        self._crash_times.clear()
        self._set_state("starting")
        self._own(self._spawn_or_fail())
        await self.wait_ready(self.options.load_timeout_s)

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.state != "ready":
            if self.state in ("failed", "stopped"):
                raise RunnerUnavailable(self._unavailable_message())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RunnerUnavailable(f"model {self.model_id!r} is not ready after "
                                        f"{timeout_s:.0f} s (state {self.state})")
            event = self._state_changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await event.wait()

    async def cancel(self, request_id: str) -> None:
        self._requests.cancel(request_id, "the request was cancelled by the server")

    async def shutdown(self) -> None:
        """Stop the runner: its tasks, its requests (each gets an error), its process."""
        self._stopping = True
        for task in list(self._background):
            task.cancel()
        self._requests.fail_all("unavailable", f"model {self.model_id!r} is shutting down")
        await self._stop_process()
        self.memory = None
        self._set_state("stopped")

    # ---- requests -----------------------------------------------------------------------

    async def _admit(self, request_id: str) -> ErrorChunk | None:
        """Why request_id cannot be served now, or None once the runner is ready for it."""
        return self._refusal(request_id) or await self._until_ready(request_id)

    def _refusal(self, request_id: str) -> ErrorChunk | None:
        if request_id in self._requests:
            return ErrorChunk(request_id=request_id, code="invalid_request",
                              message=f"request id {request_id!r} is already in flight")
        if len(self._requests) >= self.options.max_in_flight:
            return ErrorChunk(request_id=request_id, code="overloaded",
                              message=f"model {self.model_id!r} has "
                                      f"{self.options.max_in_flight} requests in flight; "
                                      f"retry later")
        return None

    async def _until_ready(self, request_id: str) -> ErrorChunk | None:
        try:
            await self.wait_ready(self.options.ready_wait_s)
        except RunnerUnavailable as error:
            return ErrorChunk(request_id=request_id, code="unavailable", message=str(error))
        return None

    # ---- the process's life -------------------------------------------------------------

    def _own(self, coroutine: Any) -> asyncio.Task:
        """Run coroutine as a task of this runner's (cancelled by shutdown)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _spawn_or_fail(self) -> None:
        try:
            await self._spawn()
        except (OSError, RuntimeError) as error:
            self._fail(f"cannot start a runner for {self.model_id!r}: {error}")

    def _crashed(self, message: str) -> None:
        """The process died after it was ready: count the crash, then restart after the
        backoff, or fail once max_crashes fell within crash_window_s. Its requests are the
        caller's to fail first."""
        self.log.error("%s", message)
        self.last_error = message
        now = time.monotonic()
        window = self.options.crash_window_s
        self._crash_times = [t for t in self._crash_times if now - t < window] + [now]
        if len(self._crash_times) >= self.options.max_crashes:
            self.last_error = (f"{message}; {len(self._crash_times)} crashes within "
                               f"{window:.0f} s, not restarting")
            self._set_state("failed")
            return
        self._set_state("restarting")
        self._own(self._restart(len(self._crash_times)))

    async def _restart(self, crash_count: int) -> None:
        backoff = self.options.restart_backoff_s
        await asyncio.sleep(backoff[min(crash_count, len(backoff)) - 1])
        if self._stopping:
            return
        self.restarts += 1
        await self._spawn_or_fail()

    def _fail(self, message: str) -> None:
        """The runner cannot be served (a load that failed, a start that cannot happen)."""
        self.last_error = message
        self.log.error("%s", message)
        self._set_state("failed")

    def _report_load(self, stage: str, fraction: float) -> None:
        self.load_stage, self.load_progress = stage, fraction
        if self.on_progress is not None:
            self.on_progress(self.model_id, stage, fraction)

    def _set_state(self, state: RunnerState) -> None:
        self.state = state
        if state in ("starting", "restarting"):  # a new load: the last one's report is stale
            self.load_stage, self.load_progress = None, 0.0
        self._state_changed.set()
        self._state_changed = asyncio.Event()

    def _unavailable_message(self) -> str:
        if self.state == "stopped":
            return f"model {self.model_id!r} is not running"
        return f"model {self.model_id!r} is unavailable: {self.last_error or 'failed'}"
