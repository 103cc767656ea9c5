"""Owns one runner subprocess: spawn, load, stream requests, detect crashes, restart, stop.

Every wait is bounded. A runner that dies (exit seen, socket EOF) turns each of its in-flight
requests into ErrorChunk(code="runner_crashed") at once and is restarted with backoff;
max_crashes crashes within crash_window_s stop the retries (state "failed").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from shoal.engine.config import EngineConfig
from shoal.protocol import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    GenerationRequest,
    ImageRequest,
)
from shoal.runner.framing import FrameTooLarge, read_frame, write_frame
from shoal.runner.image.messages import SubmitImages
from shoal.runner.inflight import TERMINAL_KINDS, InFlight
from shoal.runner.messages import (
    AskKV,
    Cancel,
    ChunkBatch,
    ChunkMessage,
    Embed,
    Failed,
    ForgetProposals,
    GrantKV,
    Inspection,
    Load,
    MemoryUsage,
    ModelInfo,
    Propose,
    ReleasedKV,
    RunnerMessage,
    Shutdown,
    Status,
    Submit,
    parse_from_runner,
    to_wire,
)
from shoal.runner.inspections import Inspections
from shoal.runner.options import SupervisorOptions
from shoal.runner.prefix_messages import PrefixMessage
from shoal.runner.process import RunnerProcess, spawn_runner, stop_process
from shoal.runner.process_env import runner_environment
from shoal.runner.proposals import ProposalHook

log = logging.getLogger("shoal.supervisor")

RunnerState = Literal["stopped", "starting", "ready", "restarting", "failed"]
ProgressCallback = Callable[[str, str, float], None]  # (model_id, stage, fraction)


class RunnerUnavailable(RuntimeError):
    """The runner could not be (re)started; the message says why."""


class RunnerSupervisor:
    backend = "engine"  # shoal's own; other backends' supervisors name theirs

    def __init__(self, config: EngineConfig, options: SupervisorOptions | None = None,
                 on_progress: ProgressCallback | None = None) -> None:
        self.config = config
        self.options = options or SupervisorOptions()
        self.on_progress = on_progress
        self.model_id = config.source.model_id
        self.state: RunnerState = "stopped"
        self.model_info: ModelInfo | None = None
        # The runner's latest report of what it holds; None until it reports, or once gone.
        self.memory: MemoryUsage | None = None
        self.last_error: str | None = None
        # The runner's latest load report: stage ("weights", "ready", ...) and its fraction.
        self.load_stage: str | None = None
        self.load_progress = 0.0
        self.restarts = 0
        # Wall-clock time (unix seconds) the router will stop this runner if it stays idle;
        # None when it is kept loaded indefinitely. Set by the router's keep-alive.
        self.expires_at: float | None = None
        self._process: RunnerProcess | None = None
        self._requests = InFlight(self.options.max_buffered_chunks,
                                  self.options.chunk_timeout_s,
                                  lambda request_id: self._send(Cancel(request_id=request_id)))
        self._crash_times: list[float] = []
        self._state_changed = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._stopping = False
        self._inspections = Inspections()
        # Where the runner's prefix messages go (cluster/prefix_share.py), if anywhere.
        self.on_prefix: Callable[[PrefixMessage], None] | None = None
        # Where the runner's asks for guesses go (set by the registry); None: answered "none".
        self.proposals: ProposalHook | None = None
        # Whether the node's budget has room for this many more bytes of KV (set by the
        # registry); None: every ask is granted (no budget to keep).
        self.kv_room: Callable[[int], bool] | None = None
        # KV bytes granted to the current process (grants only grow while it lives).
        self._kv_granted_bytes = 0
        self.generated_tokens = 0  # tokens streamed back over the runner's life (throughput)
        # request id -> (denoising steps done, steps in all): image requests drawing now.
        self.image_steps: dict[str, tuple[int, int]] = {}

    # ---- public -----------------------------------------------------------------------

    def limit_memory(self, limit_bytes: int | None) -> None:
        """The most the runner may hold (its share of the node's budget); set before start."""
        self.config = dataclasses.replace(self.config, memory_limit_bytes=limit_bytes)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.proc.pid

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

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks: AcceptedChunk, TokenChunks, then one Finish or Error chunk.

        Closing the iterator early (client gone) cancels the request in the runner.
        """
        # aclosing: closing this generator closes _stream's at once (its finally cancels).
        async with contextlib.aclosing(self._stream(request.request_id,
                                                    Submit(request=request))) as stream:
            async for chunk in stream:
                yield chunk

    async def generate_images(self, request: ImageRequest) -> AsyncIterator[Any]:
        """An image runner's chunks for request: ImageProgressChunks and ImageChunks, then
        one ImagesDone or ErrorChunk. Closing early cancels it, as submit does."""
        try:
            async with contextlib.aclosing(self._stream(
                    request.request_id, SubmitImages(request=request))) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.image_steps.pop(request.request_id, None)

    async def _stream(self, request_id: str, message: RunnerMessage) -> AsyncIterator[Any]:
        """Send message (one request) and yield its chunks up to its terminal one."""
        refusal = await self._admit(request_id)
        if refusal is not None:
            yield refusal
            return
        pending = self._requests.open(request_id)
        try:
            self._send(message)
            while True:
                chunk = await self._requests.next_chunk(request_id, pending)
                yield chunk
                if chunk.kind in TERMINAL_KINDS:
                    return
        finally:
            self._requests.close(request_id, pending)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk:
        """The request's vectors, or an ErrorChunk; bounded like submit (ready_wait_s to
        start, chunk_timeout_s for the answer). Cancelling the await cancels the request."""
        request_id = request.request_id
        refusal = await self._admit(request_id)
        if refusal is not None:
            return refusal
        pending = self._requests.open(request_id, max_chunks=1)
        try:
            try:
                self._send(Embed(request=request))
            except FrameTooLarge as error:
                pending.finished = True  # never reached the runner
                return ErrorChunk(request_id=request_id, code="invalid_request", param="input",
                                  message=f"the request is too large ({error.size} bytes "
                                          f"encoded, limit {error.limit}); send fewer or "
                                          f"shorter inputs per request")
            return await self._requests.next_chunk(request_id, pending)
        finally:
            self._requests.close(request_id, pending)

    async def inspect(self, what: str, trace_id: str | None = None,
                      timeout_s: float = 1.0) -> dict[str, Any] | None:
        """What the runner recorded (Inspect: a trace's spans, or its flight recorder);
        None when no runner process is up or it did not answer within timeout_s."""
        process = self._process
        if process is None or process.writer is None:
            return None
        return await self._inspections.ask(self._send, what, trace_id, timeout_s)

    def tell(self, message: PrefixMessage) -> None:
        """Pass a prefix message to the runner (dropped when no runner is up)."""
        self._send(message)

    async def cancel(self, request_id: str) -> None:
        self._requests.cancel(request_id, "the request was cancelled by the server")

    async def shutdown(self) -> None:
        """Stop the runner: Shutdown message -> wait -> SIGTERM -> wait -> SIGKILL."""
        self._stopping = True
        for task in list(self._background):
            task.cancel()
        self._requests.fail_all("unavailable", f"model {self.model_id!r} is shutting down")
        process = self._process
        if process is not None:
            self._send(Shutdown())
            await stop_process(process.proc, self.options.shutdown_grace_s,
                                self.options.terminate_grace_s)
            if process.reader_task is not None:
                process.reader_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await process.reader_task
        self._process = None
        self.memory = None
        self._kv_granted_bytes = 0
        self._set_state("stopped")

    def describe(self) -> dict[str, Any]:
        info = self.model_info
        return {"model": self.model_id, "state": self.state, "pid": self.pid,
                "in_flight": self.num_in_flight, "restarts": self.restarts,
                "error": self.last_error,
                "task": info.task if info else self.config.source.task,
                "backend": self.backend,
                "size_bytes": self.memory.footprint_bytes if self.memory else None,
                "expires_at": self.expires_at,
                "load": {"stage": self.load_stage, "progress": self.load_progress},
                "image_steps": [{"request_id": request_id, "step": step, "steps": steps}
                                for request_id, (step, steps) in self.image_steps.items()]}

    # ---- requests ---------------------------------------------------------------------

    async def _admit(self, request_id: str) -> ErrorChunk | None:
        if request_id in self._requests:
            return ErrorChunk(request_id=request_id, code="invalid_request",
                              message=f"request id {request_id!r} is already in flight")
        if len(self._requests) >= self.options.max_in_flight:
            return ErrorChunk(request_id=request_id, code="overloaded",
                              message=f"model {self.model_id!r} has "
                                      f"{self.options.max_in_flight} requests in flight; "
                                      f"retry later")
        try:
            await self.wait_ready(self.options.ready_wait_s)
        except RunnerUnavailable as error:
            return ErrorChunk(request_id=request_id, code="unavailable", message=str(error))
        return None

    def _send(self, message: RunnerMessage) -> None:
        process = self._process
        if process is None or process.writer is None or process.writer.is_closing():
            return  # nothing to tell; a dead runner's requests are failed by _on_exit
        try:
            write_frame(process.writer, to_wire(message))
        except (ConnectionError, RuntimeError) as error:
            log.warning("send to runner %s failed: %s", self.model_id, error)

    # ---- process lifecycle ------------------------------------------------------------

    def _own(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _spawn_or_fail(self) -> None:
        try:
            await self._spawn()
        except (OSError, RuntimeError) as error:
            self.last_error = f"cannot start a runner for {self.model_id!r}: {error}"
            log.error("%s", self.last_error)
            self._set_state("failed")

    async def _spawn(self) -> None:
        def started(proc: asyncio.subprocess.Process) -> None:
            self._process = RunnerProcess(proc=proc)

        streams = await spawn_runner(self.options.runner_command,
                                     runner_environment(self.options.env),
                                     self.options.load_timeout_s,
                                     self.options.terminate_grace_s, started)
        process = self._process
        if process is None:  # shut down meanwhile (shutdown stopped the process)
            if streams is not None:
                streams[1].close()
            return
        if streams is None:
            await self._on_exit(process, "it exited before connecting")
            return
        reader, process.writer = streams
        self._send(Load(engine=self.config))
        process.reader_task = asyncio.get_running_loop().create_task(
            self._read_loop(process, reader))
        self._own(self._load_deadline(process))

    async def _read_loop(self, process: RunnerProcess, reader: asyncio.StreamReader) -> None:
        reason = "its socket closed"
        try:
            while (raw := await read_frame(reader)) is not None:
                self._dispatch(process, parse_from_runner(raw))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a broken stream is a dead runner
            reason = f"its stream broke ({type(error).__name__}: {error})"
            log.error("runner %s: %s", self.model_id, reason)
        if process.writer is not None:
            process.writer.close()
        await stop_process(process.proc, 2.0, self.options.terminate_grace_s)
        await self._on_exit(process, f"{reason}; exit code {process.proc.returncode}")

    def _dispatch(self, process: RunnerProcess, message: Any) -> None:
        if isinstance(message, ChunkMessage):
            self._deliver(message.chunk)
        elif isinstance(message, ChunkBatch):
            for chunk in message.chunks:
                self._deliver(chunk)
        elif isinstance(message, Propose):
            self._own(self._relay_proposal(message))
        elif isinstance(message, ForgetProposals):
            if self.proposals is not None:
                self.proposals.forget(self.model_id, message.request_id)
        elif isinstance(message, MemoryUsage):
            self._record_memory(message)
        elif isinstance(message, AskKV):
            self._send(self._answer_kv(message))
        elif isinstance(message, ReleasedKV):
            # The one way the count of a grant goes down: the runner gave the pages back.
            self._kv_granted_bytes = message.granted_blocks * message.bytes_per_block
            if self.memory is not None:
                self.memory = self.memory.model_copy(
                    update={"kv_bytes_granted": self._kv_granted_bytes})
        elif isinstance(message, Inspection):
            self._inspections.answered(message)
        elif isinstance(message, Status):
            self.load_stage, self.load_progress = message.stage, message.progress
            if message.state == "ready" and message.model is not None:
                process.ready = True
                self.model_info = message.model
                self.last_error = None
                self._set_state("ready")
            if self.on_progress is not None:
                self.on_progress(self.model_id, message.stage, message.progress)
        elif isinstance(message, PrefixMessage):
            if self.on_prefix is not None:
                self.on_prefix(message)
        elif isinstance(message, Failed):
            self.last_error = message.message
            if not process.ready:
                process.load_failed = message.message

    def _deliver(self, chunk: Any) -> None:
        if chunk.kind in ("token", "reasoning"):
            self.generated_tokens += len(chunk.token_ids)
        elif chunk.kind == "image_progress" and chunk.request_id in self._requests:
            self.image_steps[chunk.request_id] = (chunk.step, chunk.steps)
        self._requests.deliver(chunk)

    def _record_memory(self, usage: MemoryUsage) -> None:
        """Keep the runner's report, with a grant it may not have seen yet when it measured
        (a report in flight must not count the KV pool smaller than the node granted)."""
        if usage.kv_bytes_granted is not None:
            self._kv_granted_bytes = max(self._kv_granted_bytes, usage.kv_bytes_granted)
            usage = usage.model_copy(update={"kv_bytes_granted": self._kv_granted_bytes})
        self.memory = usage

    def _answer_kv(self, ask: AskKV) -> GrantKV:
        """Grant the runner more KV blocks if the node's budget has the room; the grant
        counts as held from now on (footprint_bytes), before the runner touches a block."""
        extra = ask.more_blocks * ask.bytes_per_block
        if self.kv_room is not None and not self.kv_room(extra):
            return GrantKV(granted_blocks=ask.granted_blocks)
        granted = ask.granted_blocks + ask.more_blocks
        self._kv_granted_bytes = max(self._kv_granted_bytes, granted * ask.bytes_per_block)
        if self.memory is not None:
            self._record_memory(self.memory)
        return GrantKV(granted_blocks=granted)

    async def _relay_proposal(self, ask: Propose) -> None:
        """Answer the runner's ask for guesses; the relay bounds its own wait."""
        hook = self.proposals or ProposalHook()
        self._send(await hook.ask(self.model_id, ask))

    async def _load_deadline(self, process: RunnerProcess) -> None:
        await asyncio.sleep(self.options.load_timeout_s)
        if self._process is process and not process.ready:
            process.load_failed = f"loading took longer than {self.options.load_timeout_s:.0f} s"
            self.last_error = process.load_failed
            await stop_process(process.proc, 0.1, self.options.terminate_grace_s)

    async def _on_exit(self, process: RunnerProcess, reason: str) -> None:
        if self._process is not process:
            return
        self._process = None
        self.memory = None
        self._kv_granted_bytes = 0
        message = f"the runner for {self.model_id!r} died: {reason}"
        if process.load_failed:
            message = f"loading {self.model_id!r} failed: {process.load_failed}"
        self._requests.fail_all("runner_crashed", message)
        if self._stopping:
            return
        log.error("%s", message)
        self.last_error = message
        if process.load_failed:
            self._set_state("failed")  # deterministic; retrying would fail the same way
            return
        now = time.monotonic()
        self._crash_times = [t for t in self._crash_times if now - t < self.options.crash_window_s]
        self._crash_times.append(now)
        if len(self._crash_times) >= self.options.max_crashes:
            self.last_error = (f"{message}; {len(self._crash_times)} crashes within "
                               f"{self.options.crash_window_s:.0f} s, not restarting")
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
