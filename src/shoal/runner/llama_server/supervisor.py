"""Owns one llama-server process serving one model: start, health-check, stream requests
over its HTTP API, detect crashes, restart with backoff, stop.

It answers the registry, the pool and the router as RunnerSupervisor does (same states,
same submit stream of chunks, same describe), so a llama-server model is a runner like any
other. A request's chunks come from its own HTTP stream (events.py); a process that dies
ends every in-flight request with ErrorChunk(runner_crashed) as soon as its exit is seen,
and is restarted after restart_backoff_s, max_crashes within crash_window_s failing it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import psutil

from shoal.engine.config import EngineConfig
from shoal.protocol import (
    AcceptedChunk,
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    FinishChunk,
    GenerationRequest,
    Usage,
)
from shoal.runner.inflight import InFlight
from shoal.runner.llama_server.events import EventReader, error_chunk
from shoal.runner.llama_server.launch import (
    LaunchSettings,
    free_port,
    launch_command,
    wait_healthy,
)
from shoal.runner.llama_server.request_body import (
    LlamaServerCall,
    UnsupportedByLlamaServer,
    to_llama_server,
)
from shoal.runner.messages import MemoryUsage, ModelInfo
from shoal.runner.options import SupervisorOptions
from shoal.runner.process import stop_process
from shoal.runner.supervisor import ProgressCallback, RunnerState, RunnerUnavailable

log = logging.getLogger("shoal.llama_server")

BACKEND = "llama-server"
# How often the process's resident memory is read (what the pool and /api/ps show).
_MEMORY_POLL_S = 1.0
# How long a request whose stream broke waits to see whether the process exited.
_EXIT_WAIT_S = 1.0
# The last lines of llama-server's output, kept to say why it failed.
_LOG_TAIL_LINES = 20


class StreamEnded(RuntimeError):
    """llama-server closed a request's stream before its last event."""


class LlamaServerSupervisor:
    backend = BACKEND

    def __init__(self, config: EngineConfig, launch: LaunchSettings,
                 options: SupervisorOptions | None = None,
                 on_progress: ProgressCallback | None = None) -> None:
        self.config = config
        self.launch = launch
        self.options = options or SupervisorOptions()
        self.on_progress = on_progress
        self.model_id = config.source.model_id
        self.state: RunnerState = "stopped"
        self.model_info: ModelInfo | None = None
        self.memory: MemoryUsage | None = None
        self.last_error: str | None = None
        self.load_stage: str | None = None
        self.load_progress = 0.0
        self.restarts = 0
        self.expires_at: float | None = None
        self.generated_tokens = 0
        # Prefix sharing and remote proposers are shoal's engine's; kept for the registry.
        self.on_prefix: Callable[[Any], None] | None = None
        self.proposals: Any = None
        self._process: asyncio.subprocess.Process | None = None
        self._base_url = ""
        self._client = _new_client()
        self._readers: dict[str, asyncio.Task] = {}
        self._supports_tools = True  # whether the model's chat template takes tools (/props)
        self._requests = InFlight(self.options.max_buffered_chunks,
                                  self.options.chunk_timeout_s, self._stop_reading)
        self._log_tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL_LINES)
        self._crash_times: list[float] = []
        self._state_changed = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._stopping = False

    # ---- what the registry and the pool ask -------------------------------------------

    def limit_memory(self, limit_bytes: int | None) -> None:
        """llama-server sizes its own buffers; its share is what placement counted."""

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def describe(self) -> dict[str, Any]:
        return {"model": self.model_id, "state": self.state, "pid": self.pid,
                "in_flight": self.num_in_flight, "restarts": self.restarts,
                "error": self.last_error, "task": "generate", "backend": BACKEND,
                "size_bytes": self.memory.rss_bytes if self.memory else None,
                "expires_at": self.expires_at,
                "load": {"stage": self.load_stage, "progress": self.load_progress}}

    async def inspect(self, what: str, trace_id: str | None = None,
                      timeout_s: float = 1.0) -> dict[str, Any] | None:
        return None  # llama-server records no shoal spans

    def tell(self, message: Any) -> None:
        """Prefix messages are for shoal's engine; llama-server keeps its own cache."""

    async def start(self) -> None:
        if self.state in ("ready", "starting", "restarting"):
            await self.wait_ready(self.options.load_timeout_s)
            return
        self._stopping = False
        self._crash_times.clear()
        if self._client.is_closed:  # started again after a shutdown
            self._client = _new_client()
        self._set_state("starting")
        self._own(self._spawn())
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
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._state_changed.wait()

    async def shutdown(self) -> None:
        self._stopping = True
        for task in list(self._background):
            task.cancel()
        self._requests.fail_all("unavailable", f"model {self.model_id!r} is shutting down")
        for reader in list(self._readers.values()):
            reader.cancel()
        process, self._process = self._process, None
        if process is not None:
            # llama-server has no shutdown request: SIGTERM at once, then SIGKILL.
            await stop_process(process, 0.01, self.options.terminate_grace_s)
        await self._client.aclose()
        self.memory = None
        self._set_state("stopped")

    # ---- requests ----------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks: AcceptedChunk, deltas, then one Finish or Error chunk.
        Closing the iterator early closes its HTTP stream, which stops llama-server's slot."""
        request_id = request.request_id
        admitted = await self._admit(request)
        if isinstance(admitted, ErrorChunk):
            yield admitted
            return
        pending = self._requests.open(request_id)
        self._readers[request_id] = asyncio.get_running_loop().create_task(
            self._read(request, admitted))
        try:
            while True:
                chunk = await self._requests.next_chunk(request_id, pending)
                yield chunk
                if chunk.kind in ("finish", "error"):
                    return
        finally:
            # An unfinished request's reader is cancelled here (InFlight calls _stop_reading);
            # a finished one closes its HTTP stream itself: cancelled while closing, it
            # would leave the socket open.
            self._requests.close(request_id, pending)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk:
        return ErrorChunk(request_id=request.request_id, code="invalid_request", param="model",
                          message=f"model {self.model_id!r} is served by llama-server for "
                                  "generation; embeddings come from shoal's engine")

    async def cancel(self, request_id: str) -> None:
        self._requests.cancel(request_id, "the request was cancelled by the server")

    async def _admit(self, request: GenerationRequest) -> LlamaServerCall | ErrorChunk:
        """The HTTP call that serves request, or why it is refused."""
        request_id = request.request_id
        if request_id in self._requests:
            return ErrorChunk(request_id=request_id, code="invalid_request",
                              message=f"request id {request_id!r} is already in flight")
        if len(self._requests) >= self.options.max_in_flight:
            return ErrorChunk(request_id=request_id, code="overloaded",
                              message=f"model {self.model_id!r} has "
                                      f"{self.options.max_in_flight} requests in flight; "
                                      f"retry later")
        try:
            call = to_llama_server(request)
        except UnsupportedByLlamaServer as error:
            return ErrorChunk(request_id=request_id, code="invalid_request",
                              param=error.param, message=f"{error} (model {self.model_id!r} "
                                                         "is served by llama-server)")
        try:
            await self.wait_ready(self.options.ready_wait_s)
        except RunnerUnavailable as error:
            return ErrorChunk(request_id=request_id, code="unavailable", message=str(error))
        if request.tools and request.tool_choice != "none" and not self._supports_tools:
            # llama-server would render the chat without them and answer in prose.
            return ErrorChunk(request_id=request_id, code="invalid_request", param="tools",
                              message=f"model {self.model_id!r} is served by llama-server, "
                                      "and its chat template does not take tools")
        return call

    def _stop_reading(self, request_id: str) -> None:
        reader = self._readers.pop(request_id, None)
        if reader is not None and not reader.done():
            reader.cancel()

    async def _read(self, request: GenerationRequest, call: LlamaServerCall) -> None:
        """Stream request from llama-server into its InFlight queue; any failure becomes its
        one ErrorChunk."""
        request_id = request.request_id
        try:
            if request.count_only:
                for chunk in await self._count(request, call):
                    self._requests.deliver(chunk)
                return
            await self._stream(call, request_id)
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, StreamEnded, ValueError, KeyError) as error:
            # A broken stream is most often a dead process: see it gone (bounded) so that
            # every request of it fails as crashed and the restart begins now.
            process = self._process
            if process is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_EXIT_WAIT_S):
                        await process.wait()
                if process.returncode is not None:
                    self._gone(process)
            self._requests.deliver(ErrorChunk(
                request_id=request_id, code="unavailable",
                message=f"llama-server for {self.model_id!r} broke off: "
                        f"{type(error).__name__}: {error}"))
        finally:
            self._readers.pop(request_id, None)

    async def _stream(self, call: LlamaServerCall, request_id: str) -> None:
        reader = EventReader(request_id, call.chat, self.model_id)
        async with self._client.stream("POST", self._base_url + call.path,
                                       json=call.body) as response:
            if response.status_code != 200:
                body = await response.aread()
                self._requests.deliver(error_chunk(request_id, _error_of(body),
                                                   response.status_code))
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                for chunk in reader.feed(json.loads(payload)):
                    self._deliver(chunk)
                if reader.finished:
                    break
        for chunk in reader.close():
            self._deliver(chunk)
        if not reader.finished:
            raise StreamEnded("llama-server ended the stream before finishing")

    def _deliver(self, chunk: Any) -> None:
        if chunk.kind == "finish":
            self.generated_tokens += chunk.usage.completion_tokens
        self._requests.deliver(chunk)

    async def _count(self, request: GenerationRequest, call: LlamaServerCall) -> list[Any]:
        """Count the prompt's tokens, generating nothing (GenerationRequest.count_only)."""
        if request.messages is not None:
            applied = await self._post("/apply-template", {
                key: call.body[key] for key in ("messages", "tools", "tool_choice",
                                                "chat_template_kwargs") if key in call.body})
            # Tokenized as llama-server tokenizes a chat's rendered prompt.
            tokens = (await self._post("/tokenize", {"content": applied["prompt"],
                                                     "add_special": True,
                                                     "parse_special": True}))["tokens"]
        elif request.prompt is not None:
            tokens = (await self._post("/tokenize", {"content": request.prompt,
                                                     "add_special": True}))["tokens"]
        else:
            tokens = list(request.prompt_token_ids or ())
        request_id = request.request_id
        return [AcceptedChunk(request_id=request_id, prompt_tokens=len(tokens),
                              model=self.model_id),
                FinishChunk(request_id=request_id, finish_reason="stop",
                            usage=Usage(prompt_tokens=len(tokens), completion_tokens=0))]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._client.post(self._base_url + path, json=body)
        response.raise_for_status()
        return response.json()

    # ---- the process --------------------------------------------------------------------

    def _own(self, coroutine: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _spawn(self) -> None:
        port = free_port()
        command = launch_command(self.launch, self.model_id, self.config.source.path, port)
        self._log_tail.clear()
        self._report("starting", 0.0)
        try:
            process = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT)
        except OSError as error:
            self._fail(f"cannot start llama-server for {self.model_id!r}: {error}")
            return
        self._process = process
        self._base_url = f"http://127.0.0.1:{port}"
        output = self._own(self._keep_log(process))
        why = await wait_healthy(self._client, self._base_url, process,
                                 self.options.load_timeout_s)
        if self._process is not process:
            return  # shut down meanwhile
        if why is None:
            try:
                self.model_info = await self._model_info()
            except (httpx.HTTPError, StreamEnded, ValueError, KeyError) as error:
                why = f"llama-server did not describe its model: {error}"
        if why is not None:
            await stop_process(process, 0.01, self.options.terminate_grace_s)
            with contextlib.suppress(TimeoutError):  # its last words say why
                async with asyncio.timeout(1.0):
                    await asyncio.shield(output)
            self._process = None
            self._fail(f"loading {self.model_id!r} in llama-server failed: {why}"
                       f"{self._tail_text()}")
            return
        self.last_error = None
        self._own(self._watch(process))
        self._own(self._poll_memory(process))
        self._report("ready", 1.0)
        self._set_state("ready")

    async def _model_info(self) -> ModelInfo:
        props = await self._get("/props")
        models = await self._get("/v1/models")
        meta = (models.get("data") or [{}])[0].get("meta") or {}
        settings = props.get("default_generation_settings") or {}
        self._supports_tools = bool((props.get("chat_template_caps") or {}).get(
            "supports_tools", True))
        return ModelInfo(model_id=self.model_id,
                         max_model_len=int(settings.get("n_ctx") or props.get("n_ctx") or 0),
                         vocab_size=int(meta.get("n_vocab") or 0),
                         has_chat_template=bool(props.get("chat_template")))

    async def _get(self, path: str) -> dict[str, Any]:
        response = await self._client.get(self._base_url + path)
        response.raise_for_status()
        return response.json()

    async def _keep_log(self, process: asyncio.subprocess.Process) -> None:
        """Drain llama-server's output (a full pipe would stall it), keeping the tail."""
        assert process.stdout is not None
        while line := await process.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            self._log_tail.append(text)
            log.debug("llama-server %s: %s", self.model_id, text)

    async def _poll_memory(self, process: asyncio.subprocess.Process) -> None:
        """The process's resident memory, as the pool, /api/ps and /metrics count it."""
        weights = self.config.source.path.stat().st_size
        while process.returncode is None:
            try:
                rss = psutil.Process(process.pid).memory_info().rss
            except psutil.Error:
                return
            self.memory = MemoryUsage(weights_bytes=weights, rss_bytes=rss)
            await asyncio.sleep(_MEMORY_POLL_S)

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        await process.wait()
        self._gone(process)

    def _gone(self, process: asyncio.subprocess.Process) -> None:
        """process has exited: fail its requests and restart it after the backoff (once,
        whoever saw the exit first)."""
        if self._process is not process or self._stopping:
            return
        self._process = None
        self.memory = None
        message = (f"llama-server for {self.model_id!r} died with exit code "
                   f"{process.returncode}{self._tail_text()}")
        self._requests.fail_all("runner_crashed", message)
        log.error("%s", message)
        self.last_error = message
        now = time.monotonic()
        window = self.options.crash_window_s
        self._crash_times = [t for t in self._crash_times if now - t < window] + [now]
        if len(self._crash_times) >= self.options.max_crashes:
            self._fail(f"{message}; {len(self._crash_times)} crashes within {window:.0f} s, "
                       "not restarting")
            return
        self._set_state("restarting")
        self._own(self._restart(len(self._crash_times)))

    async def _restart(self, crash_count: int) -> None:
        backoff = self.options.restart_backoff_s
        await asyncio.sleep(backoff[min(crash_count, len(backoff)) - 1])
        if not self._stopping:
            self.restarts += 1
            await self._spawn()

    def _fail(self, message: str) -> None:
        self.last_error = message
        log.error("%s", message)
        self._set_state("failed")

    def _tail_text(self) -> str:
        lines = [line for line in self._log_tail if line.strip()][-3:]
        return "; its last output: " + " | ".join(lines) if lines else ""

    def _report(self, stage: str, fraction: float) -> None:
        self.load_stage, self.load_progress = stage, fraction
        if self.on_progress is not None:
            self.on_progress(self.model_id, stage, fraction)

    def _set_state(self, state: RunnerState) -> None:
        self.state = state
        self._state_changed.set()
        self._state_changed = asyncio.Event()

    def _unavailable_message(self) -> str:
        if self.state == "stopped":
            return f"model {self.model_id!r} is not running"
        return f"model {self.model_id!r} is unavailable: {self.last_error or 'failed'}"


def _new_client() -> httpx.AsyncClient:
    # No read timeout: InFlight bounds the silence between two chunks (chunk_timeout_s).
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None),
                             limits=httpx.Limits(max_connections=None))


def _error_of(body: bytes) -> Any:
    try:
        return json.loads(body).get("error") or body.decode(errors="replace")
    except ValueError:
        return body.decode(errors="replace")
