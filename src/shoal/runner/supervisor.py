"""Owns one shoal runner subprocess: spawn, load, stream requests over its socket, detect
crashes, stop. The states, the restarts with backoff and the shutdown order are
RunnerLifecycle's (lifecycle.py), shared with the llama-server runner.

Every wait is bounded. A runner that dies (exit seen, socket EOF) turns each of its in-flight
requests into ErrorChunk(code="runner_crashed") at once and is restarted with backoff;
max_crashes crashes within crash_window_s stop the retries (state "failed").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

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
from shoal.runner.inflight import TERMINAL_KINDS
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
from shoal.runner.lifecycle import (
    ProgressCallback,
    RunnerLifecycle,
    RunnerState,
    RunnerUnavailable,
)
from shoal.runner.options import SupervisorOptions
from shoal.runner.prefix_messages import PrefixMessage
from shoal.runner.process import RunnerProcess, spawn_runner, stop_process
from shoal.runner.process_env import runner_environment
from shoal.runner.proposals import ProposalHook

# The names other layers import from here (the registry, the pool).
__all__ = ["ProgressCallback", "RunnerState", "RunnerSupervisor", "RunnerUnavailable"]


class RunnerSupervisor(RunnerLifecycle):
    backend = "engine"  # shoal's own; other backends' supervisors name theirs

    def __init__(self, config: EngineConfig, options: SupervisorOptions | None = None,
                 on_progress: ProgressCallback | None = None) -> None:
        super().__init__(config.source.model_id, options, on_progress)
        self.config = config
        self._process: RunnerProcess | None = None
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
        # request id -> (denoising steps done, steps in all): image requests drawing now.
        self.image_steps: dict[str, tuple[int, int]] = {}

    # ---- public -----------------------------------------------------------------------

    def limit_memory(self, limit_bytes: int | None) -> None:
        """The most the runner may hold (its share of the node's budget); set before start."""
        self.config = dataclasses.replace(self.config, memory_limit_bytes=limit_bytes)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.proc.pid

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks: AcceptedChunk, TokenChunks, then one Finish or Error chunk.

        Closing the iterator early (client gone) cancels the request in the runner.
        """
        if request.has_images:
            yield ErrorChunk(request_id=request.request_id, code="invalid_request",
                             param="messages", message=f"model {self.model_id!r} does not "
                             "take images: shoal's engine serves text; a GGUF model with its "
                             "mmproj file served by llama-server takes them")
            return
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

    async def _stop_process(self) -> None:
        """Shutdown message -> wait -> SIGTERM -> wait -> SIGKILL."""
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
        self._kv_granted_bytes = 0

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

    def _cancel_in_runner(self, request_id: str) -> None:
        self._send(Cancel(request_id=request_id))

    def _send(self, message: RunnerMessage) -> None:
        process = self._process
        if process is None or process.writer is None or process.writer.is_closing():
            return  # nothing to tell; a dead runner's requests are failed by _on_exit
        try:
            write_frame(process.writer, to_wire(message))
        except (ConnectionError, RuntimeError) as error:
            self.log.warning("send to runner %s failed: %s", self.model_id, error)

    # ---- the process ------------------------------------------------------------------

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
            self.log.error("runner %s: %s", self.model_id, reason)
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
            self._report_load(message.stage, message.progress)
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
        if process.load_failed:
            self._fail(message)  # deterministic; retrying would fail the same way
            return
        self._crashed(message)
