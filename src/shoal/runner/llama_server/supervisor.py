"""Owns one llama-server process serving one model: start, health-check, stream requests
over its HTTP API, detect crashes, stop. The states, the restarts with backoff and the
shutdown order are RunnerLifecycle's (runner/lifecycle.py), as for shoal's own runner.

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
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import psutil

from shoal.catalog.projector import projector_beside
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
from shoal.runner.llama_server.buffers import DeviceBuffers
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
from shoal.runner.lifecycle import ProgressCallback, RunnerLifecycle
from shoal.runner.messages import MemoryUsage, ModelInfo
from shoal.runner.options import SupervisorOptions
from shoal.runner.process import stop_process

BACKEND = "llama-server"
# How often the process's resident memory is read (what the pool and /api/ps show).
_MEMORY_POLL_S = 1.0
# How long a request whose stream broke waits to see whether the process exited.
_EXIT_WAIT_S = 1.0
# The last lines of llama-server's output, kept to say why it failed.
_LOG_TAIL_LINES = 20


class StreamEnded(RuntimeError):
    """llama-server closed a request's stream before its last event."""


class LlamaServerSupervisor(RunnerLifecycle):
    backend = BACKEND
    log = logging.getLogger("shoal.llama_server")

    def __init__(self, config: EngineConfig, launch: LaunchSettings,
                 options: SupervisorOptions | None = None,
                 on_progress: ProgressCallback | None = None) -> None:
        super().__init__(config.source.model_id, options, on_progress)
        self.config = config
        self.launch = launch
        # Prefix sharing and remote proposers are shoal's engine's; kept for the registry.
        self.on_prefix: Callable[[Any], None] | None = None
        self.proposals: Any = None
        self._process: asyncio.subprocess.Process | None = None
        self._base_url = ""
        self._client = _new_client()
        self._readers: dict[str, asyncio.Task] = {}
        self._supports_tools = True  # whether the model's chat template takes tools (/props)
        self._log_tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL_LINES)
        self._buffers = DeviceBuffers(launch.devices)  # what it put on GPUs, from its log

    # ---- what the registry and the pool ask -------------------------------------------

    def limit_memory(self, limit_bytes: int | None) -> None:
        """llama-server sizes its own buffers; its share is what placement counted."""

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def describe(self) -> dict[str, Any]:
        return {"model": self.model_id, "state": self.state, "pid": self.pid,
                "in_flight": self.num_in_flight, "restarts": self.restarts,
                "error": self.last_error, "task": "generate", "backend": BACKEND,
                "size_bytes": self.memory.rss_bytes if self.memory else None,
                "device_bytes": self.memory.device_bytes if self.memory else None,
                "expires_at": self.expires_at,
                "load": {"stage": self.load_stage, "progress": self.load_progress}}

    async def inspect(self, what: str, trace_id: str | None = None,
                      timeout_s: float = 1.0) -> dict[str, Any] | None:
        return None  # llama-server records no shoal spans

    def tell(self, message: Any) -> None:
        """Prefix messages are for shoal's engine; llama-server keeps its own cache."""

    async def start(self) -> None:
        if self._client.is_closed:  # started again after a shutdown
            self._client = _new_client()
        await super().start()

    async def _stop_process(self) -> None:
        for reader in list(self._readers.values()):
            reader.cancel()
        process, self._process = self._process, None
        if process is not None:
            # llama-server has no shutdown request: SIGTERM at once, then SIGKILL.
            await stop_process(process, 0.01, self.options.terminate_grace_s)
        await self._client.aclose()

    # ---- requests ----------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks: AcceptedChunk, deltas, then one Finish or Error chunk.
        Closing the iterator early closes its HTTP stream, which stops llama-server's slot."""
        request_id = request.request_id
        admitted = await self._admit_call(request)
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
            # An unfinished request's reader is cancelled here (InFlight calls
            # _cancel_in_runner); a finished one closes its HTTP stream itself: cancelled
            # while closing, it would leave the socket open.
            self._requests.close(request_id, pending)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk:
        return ErrorChunk(request_id=request.request_id, code="invalid_request", param="model",
                          message=f"model {self.model_id!r} is served by llama-server for "
                                  "generation; embeddings come from shoal's engine")

    async def _admit_call(self, request: GenerationRequest) -> LlamaServerCall | ErrorChunk:
        """The HTTP call that serves request, or why it is refused."""
        request_id = request.request_id
        refusal = self._refusal(request_id)
        if refusal is not None:
            return refusal
        try:
            call = to_llama_server(request)
        except UnsupportedByLlamaServer as error:
            return ErrorChunk(request_id=request_id, code="invalid_request",
                              param=error.param, message=f"{error} (model {self.model_id!r} "
                                                         "is served by llama-server)")
        not_ready = await self._until_ready(request_id)
        if not_ready is not None:
            return not_ready
        if request.tools and request.tool_choice != "none" and not self._supports_tools:
            # llama-server would render the chat without them and answer in prose.
            return ErrorChunk(request_id=request_id, code="invalid_request", param="tools",
                              message=f"model {self.model_id!r} is served by llama-server, "
                                      "and its chat template does not take tools")
        if request.has_images and not (self.model_info and self.model_info.takes_images):
            return ErrorChunk(request_id=request_id, code="invalid_request", param="messages",
                              message=f"model {self.model_id!r} does not take images: "
                                      "llama-server serves it without a projector (an "
                                      "mmproj*.gguf file beside the model)")
        return call

    def _cancel_in_runner(self, request_id: str) -> None:
        """Stop reading the request's HTTP stream: closing it stops llama-server's slot."""
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
        if request.has_images:
            # An image's tokens are known only once the projector encodes it: run the
            # prompt with one token to generate (0 still generates one), then read its
            # length; the prompt stays in llama-server's cache for the request that follows.
            body = {**call.body, "stream": False, "max_tokens": 1}
            body.pop("stream_options", None)
            count = int((await self._post(call.path, body))["usage"]["prompt_tokens"])
        elif request.messages is not None:
            applied = await self._post("/apply-template", {
                key: call.body[key] for key in ("messages", "tools", "tool_choice",
                                                "chat_template_kwargs") if key in call.body})
            # Tokenized as llama-server tokenizes a chat's rendered prompt.
            count = len((await self._post("/tokenize", {"content": applied["prompt"],
                                                        "add_special": True,
                                                        "parse_special": True}))["tokens"])
        elif request.prompt is not None:
            count = len((await self._post("/tokenize", {"content": request.prompt,
                                                        "add_special": True}))["tokens"])
        else:
            count = len(request.prompt_token_ids or ())
        request_id = request.request_id
        return [AcceptedChunk(request_id=request_id, prompt_tokens=count, model=self.model_id),
                FinishChunk(request_id=request_id, finish_reason="stop",
                            usage=Usage(prompt_tokens=count, completion_tokens=0))]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._client.post(self._base_url + path, json=body)
        response.raise_for_status()
        return response.json()

    # ---- the process --------------------------------------------------------------------

    async def _spawn(self) -> None:
        port = free_port()
        model_path = self.config.source.path
        command = launch_command(self.launch, self.model_id, model_path, port,
                                 projector_beside(model_path))
        self._log_tail.clear()
        self._buffers.reset()
        self._report_load("starting", 0.0)
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
        self._report_load("ready", 1.0)
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
                         has_chat_template=bool(props.get("chat_template")),
                         # It loaded a projector (--mmproj): its chats take images.
                         takes_images=bool((props.get("modalities") or {}).get("vision")))

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
            self._buffers.read(text)
            self.log.debug("llama-server %s: %s", self.model_id, text)

    async def _poll_memory(self, process: asyncio.subprocess.Process) -> None:
        """The process's resident memory and its buffers on devices, as the pool, /api/ps
        and /metrics count them. Its whole RSS: the weights it keeps on the CPU are its
        mapping of the file (llama.cpp unmaps what it copied to a device)."""
        weights = self.config.source.path.stat().st_size
        while process.returncode is None:
            try:
                rss = psutil.Process(process.pid).memory_info().rss
            except psutil.Error:
                return
            self.memory = MemoryUsage(weights_bytes=weights, rss_bytes=rss,
                                      device_bytes=self._buffers.total_bytes)
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
        self._crashed(message)

    def _tail_text(self) -> str:
        lines = [line for line in self._log_tail if line.strip()][-3:]
        return "; its last output: " + " | ".join(lines) if lines else ""


def _new_client() -> httpx.AsyncClient:
    # No read timeout: InFlight bounds the silence between two chunks (chunk_timeout_s).
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None),
                             limits=httpx.Limits(max_connections=None))


def _error_of(body: bytes) -> Any:
    try:
        return json.loads(body).get("error") or body.decode(errors="replace")
    except ValueError:
        return body.decode(errors="replace")
