"""The runner subprocess: one engine, driven over a local socket by its supervisor.

    python -m shoal.runner.entrypoint --socket PATH --parent-pid PID

It connects, waits for Load, builds the engine (reporting progress), then loops: take
messages (blocking only while idle), step the engine, stream chunks back. A crash anywhere
is either a Failed message or an exit the supervisor sees; it never leaves a request hanging.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from shoal.engine.errors import ContextLengthExceeded
from shoal.engine.grammar_spec import InvalidGrammar
from shoal.engine.outputs import RequestOutput, TokenLogprob
from shoal.engine.sampling import InvalidParameter
from shoal.protocol import (
    AcceptedChunk,
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    FinishChunk,
    GenerationRequest,
    LogprobItem,
    TokenChunk,
    ToolCallChunk,
    TopLogprobItem,
    Usage,
)
from shoal.runner.framing import FrameError, FrameTooLarge, recv_frame, send_frame
from shoal.runner.messages import (
    Cancel,
    ChunkBatch,
    ChunkMessage,
    Embed,
    Failed,
    Load,
    ModelInfo,
    RunnerMessage,
    Shutdown,
    Status,
    Submit,
    parse_to_runner,
    to_wire,
)
from shoal.runner.tool_stream import IndexedCall, ToolCallStream
from shoal.runner.tool_use import (
    TemplateToolSupport,
    chat_prompt,
    check_tools,
    grammar_param,
    offered_tools,
    output_grammar,
)

log = logging.getLogger("shoal.runner")

_EOF = object()  # the supervisor closed the socket
_PROGRESS_INTERVAL_S = 0.2


class Channel:
    """The runner's end of the socket: a reader thread fills an inbox; sends are locked."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read_loop, name="runner-reader", daemon=True).start()

    def _read_loop(self) -> None:
        while True:
            try:
                raw = recv_frame(self._sock)
            except (OSError, ConnectionError, FrameError, ValueError) as error:
                log.error("runner socket read failed: %s", error)
                raw = None
            if raw is None:
                self._inbox.put(_EOF)
                return
            self._inbox.put(raw)

    def receive(self, block: bool, timeout_s: float | None = None) -> list[Any]:
        """All waiting raw messages; with block, wait for at least one (or timeout_s)."""
        items = []
        if block:
            try:
                items.append(self._inbox.get(timeout=timeout_s))
            except queue.Empty:
                return []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def send(self, message: RunnerMessage) -> None:
        with self._send_lock:
            send_frame(self._sock, to_wire(message))


class SupervisorGone(Exception):
    """The socket closed: nobody is left to serve."""


def resolve_factory(spec: str | None, task: str = "generate",
                    follower: bool = False) -> Callable[..., Any]:
    """The engine constructor: the real Engine (EmbeddingEngine for an embedding model,
    FollowerEngine for a rank other than 0), or "module:callable" injected by tests."""
    if spec is None:
        # heavy (torch); imported only in the runner
        if follower:
            from shoal.engine.parallel.follower import FollowerEngine

            return FollowerEngine
        if task == "embed":
            from shoal.engine.embedding import EmbeddingEngine

            return EmbeddingEngine
        from shoal.engine.engine import Engine

        return Engine
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"engine factory must be 'module:callable', not {spec!r}")
    return getattr(importlib.import_module(module_name), attribute)


def build_engine(load: Load, channel: Channel) -> Any:
    config = load.engine
    if load.engine_factory is None and config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    last_sent = [0.0]

    def progress(stage: str, fraction: float) -> None:
        now = time.monotonic()
        if now - last_sent[0] >= _PROGRESS_INTERVAL_S or fraction >= 1.0:
            last_sent[0] = now
            channel.send(Status(state="loading", stage=stage,
                                progress=min(max(float(fraction), 0.0), 1.0)))

    channel.send(Status(state="loading", stage="starting", progress=0.0))
    follower = config.parallel is not None and config.parallel.rank > 0
    return resolve_factory(load.engine_factory, config.source.task, follower)(config, progress)


def engine_task(engine: Any) -> str:
    return getattr(engine, "task", "generate")


def model_info(engine: Any) -> ModelInfo:
    tokenizer = engine.tokenizer
    embeds = engine_task(engine) == "embed"
    return ModelInfo(model_id=engine.model_id, max_model_len=engine.max_model_len,
                     vocab_size=engine.vocab_size,
                     has_chat_template=bool(getattr(tokenizer, "has_chat_template", False)),
                     task="embed" if embeds else "generate",
                     embedding_dimensions=engine.dimensions if embeds else None,
                     size_bytes=_memory_bytes(engine))


def _memory_bytes(engine: Any) -> int | None:
    """Weights plus KV cache, as reserved at load; None when the engine cannot tell."""
    if callable(getattr(engine, "weight_bytes", None)):
        return int(engine.weight_bytes())
    loaded, runner = getattr(engine, "loaded", None), getattr(engine, "runner", None)
    if loaded is None:
        return None
    caches = getattr(runner, "kv_caches", None) or []
    return int(loaded.weight_bytes + sum(t.numel() * t.element_size() for t in caches))


def _logprob_items(logprobs: tuple[TokenLogprob, ...]) -> tuple[LogprobItem, ...]:
    return tuple(
        LogprobItem(token_id=lp.token_id, token=lp.token, logprob=lp.logprob,
                    top=tuple(TopLogprobItem(token_id=t.token_id, token=t.token,
                                             logprob=t.logprob) for t in lp.top))
        for lp in logprobs)


class RunnerLoop:
    """Serves Submit/Cancel against one engine until Shutdown or the socket closes."""

    def __init__(self, engine: Any, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self.in_flight: set[str] = set()
        self.embeds = engine_task(engine) == "embed"
        self.tool_streams: dict[str, ToolCallStream] = {}  # requests that offer tools
        self._tool_support: TemplateToolSupport | None = None
        self._outbox: list[Any] | None = None  # chunks of the step being reported

    def run(self) -> None:
        # Rank 0 of a parallel instance wakes while idle to keep its ranks' waits alive.
        parallel = getattr(getattr(self.engine, "config", None), "parallel", None)
        tick_s = parallel.keepalive_s / 2 if parallel is not None else None
        while True:
            block = not self.has_work()
            for raw in self.channel.receive(block, tick_s):
                if not self.handle(raw):
                    return
            if self.has_work():
                self.step()
            elif tick_s is not None:
                self.idle()

    def idle(self) -> None:
        try:
            self.engine.idle()
        except Exception as error:
            raise EngineBroken(f"the instance lost a rank: {error}") from error

    def has_work(self) -> bool:
        # An embedding engine answers each request at once; it never has work left over.
        return not self.embeds and self.engine.has_unfinished_requests()

    def handle(self, raw: Any) -> bool:
        """Apply one incoming message; False means stop serving."""
        if raw is _EOF:
            raise SupervisorGone()
        try:
            message = parse_to_runner(raw)
        except ValidationError as error:
            self._reject_unparsable(raw, error)
            return True
        if isinstance(message, Submit):
            self.submit(message.request)
        elif isinstance(message, Embed):
            self.embed(message.request)
        elif isinstance(message, Cancel):
            if not self.embeds:  # embeddings finish within handle(): nothing to abort
                self.engine.abort_request(message.request_id)
        elif isinstance(message, Shutdown):
            return False
        else:
            log.warning("ignoring %s after the engine is loaded", message.type)
        return True

    def _reject_unparsable(self, raw: Any, error: ValidationError) -> None:
        request = raw.get("request") if isinstance(raw, dict) else None
        request_id = request.get("request_id") if isinstance(request, dict) else None
        log.error("unparsable message from the supervisor: %s", error)
        if isinstance(request_id, str):
            self.send_chunk(ErrorChunk(request_id=request_id, code="invalid_request",
                                       message=f"malformed request: {error}"))

    # ---- submit ---------------------------------------------------------------------------

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise InvalidParameter("prompt", f"token id {bad[0]} is outside the "
                                                  f"vocabulary (size {self.engine.vocab_size})")
            return ids
        if request.messages is not None:
            text = chat_prompt(request, self.tool_support, self.engine.render_chat)
            return tokenizer.encode(text, add_special_tokens=True)
        if request.prompt is not None:
            return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        raise InvalidParameter("prompt", "one of prompt, messages or prompt_token_ids is needed")

    def submit(self, request: GenerationRequest) -> None:
        request_id = request.request_id
        if self.embeds:
            self._error(request_id, "invalid_request", f"model {self.engine.model_id!r} is an "
                        f"embedding model; it cannot generate text", "model")
            return
        try:
            check_tools(request)
            ids = self.prompt_token_ids(request)
            if not request.count_only:
                grammar = output_grammar(request, self.tool_support.call_format)
                self.engine.add_request(request_id, ids, request.sampling, grammar=grammar)
        except InvalidGrammar as error:
            param = grammar_param(request)
            self._error(request_id, "invalid_request",
                        f"{param}: the schema cannot be enforced: {error}", param)
        except InvalidParameter as error:
            self._error(request_id, "invalid_request", str(error), error.param)
        except ContextLengthExceeded as error:
            self._error(request_id, "context_length_exceeded", str(error), "messages"
                        if request.messages is not None else "prompt")
        except ValueError as error:  # a duplicate id, a template that rejects the messages
            self._error(request_id, "invalid_request", str(error))
        except Exception as error:  # noqa: BLE001 - a bug must not take the runner down
            log.error("submit %s failed:\n%s", request_id, traceback.format_exc())
            self._error(request_id, "internal", f"{type(error).__name__}: {error}")
        else:
            if request.count_only:
                self.send_chunk(AcceptedChunk(request_id=request_id, prompt_tokens=len(ids)))
                self.send_chunk(FinishChunk(request_id=request_id, finish_reason="stop",
                                            usage=Usage(prompt_tokens=len(ids),
                                                        completion_tokens=0)))
                return
            self.in_flight.add(request_id)
            if offered_tools(request):
                self.tool_streams[request_id] = ToolCallStream(
                    [tool.name for tool in offered_tools(request)])
            self.send_chunk(AcceptedChunk(request_id=request_id, prompt_tokens=len(ids)))

    @property
    def tool_support(self) -> TemplateToolSupport:
        if self._tool_support is None:
            template = self.engine.tokenizer.chat_template
            self._tool_support = TemplateToolSupport.of(template.source, template.uses_tools)
        return self._tool_support

    # ---- embed ----------------------------------------------------------------------------

    def embed(self, request: EmbeddingRequest) -> None:
        """Answer at once: one EmbeddingResult or ErrorChunk (the batch runs synchronously)."""
        request_id = request.request_id
        if not self.embeds:
            self._error(request_id, "invalid_request", f"model {self.engine.model_id!r} "
                        f"generates text; it does not produce embeddings", "model")
            return
        try:
            if request.texts is not None:
                ids = self.engine.tokenize(request.texts, request.truncate)
            else:
                ids = self.engine.check_token_ids(request.token_ids or (), request.truncate)
            vectors = self.engine.embed(ids) if ids else None  # [B, dimensions] float32
        except InvalidParameter as error:
            self._error(request_id, "invalid_request", str(error), error.param)
        except ContextLengthExceeded as error:
            self._error(request_id, "context_length_exceeded", str(error), "input")
        except Exception as error:  # noqa: BLE001 - a bug must not take the runner down
            log.error("embed %s failed:\n%s", request_id, traceback.format_exc())
            self._error(request_id, "internal", f"{type(error).__name__}: {error}")
        else:
            rows = () if vectors is None else tuple(map(tuple, vectors.tolist()))
            try:
                self.send_chunk(EmbeddingResult(request_id=request_id, embeddings=rows,
                                                prompt_tokens=sum(len(i) for i in ids)))
            except FrameTooLarge as error:  # raised before anything is written
                self._error(request_id, "invalid_request", f"the embeddings of this batch are "
                            f"too large to return ({error.size} bytes encoded, limit "
                            f"{error.limit}); send fewer inputs per request", "input")

    # ---- step -----------------------------------------------------------------------------

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - fail the batch, keep serving
            log.error("engine step failed:\n%s", traceback.format_exc())
            if type(error).__name__ == "GroupError":  # a rank of the instance is gone
                self._fail_in_flight(f"the model's instance lost a rank: {error}",
                                     code="unavailable")
            else:
                self._fail_in_flight(f"engine step failed: {type(error).__name__}: {error}")
            return
        self._outbox = []
        try:
            for output in outputs:
                self.send_output(output)
        finally:
            chunks, self._outbox = self._outbox, None
        if chunks:
            self._send_batch(chunks)

    def _send_batch(self, chunks: list[Any]) -> None:
        try:
            self.channel.send(ChunkBatch(chunks=tuple(chunks)))
        except FrameTooLarge:  # raised before anything is written
            for chunk in chunks:
                self.channel.send(ChunkMessage(chunk=chunk))

    def _fail_in_flight(self, message: str, code: str = "internal") -> None:
        failed, self.in_flight = sorted(self.in_flight), set()
        for request_id in failed:
            self._error(request_id, code, message)
            self.engine.abort_request(request_id)
        try:
            self.engine.step()  # reports the aborts; frees their KV blocks
        except Exception as error:
            raise EngineBroken(f"engine cannot recover after a failed step: {error}") from error
        if self.engine.has_unfinished_requests():
            raise EngineBroken("engine still holds requests after aborting all of them")

    def send_output(self, output: RequestOutput) -> None:
        request_id = output.request_id
        if request_id not in self.in_flight:
            self.tool_streams.pop(request_id, None)
            return  # cancelled by the supervisor, or already failed
        tool_stream = self.tool_streams.get(request_id)
        if tool_stream is not None:
            self._send_with_tool_calls(request_id, tool_stream, output)
        elif output.text or output.token_ids:
            self.send_chunk(TokenChunk(request_id=request_id, text=output.text,
                                       token_ids=output.token_ids,
                                       logprobs=_logprob_items(output.logprobs)))
        if output.finished:
            self.in_flight.discard(request_id)
            finish_reason = output.finish_reason or "stop"
            if tool_stream is not None:
                finish_reason = tool_stream.finish_reason(finish_reason)
                del self.tool_streams[request_id]
            usage = Usage(prompt_tokens=output.prompt_tokens,
                          completion_tokens=output.completion_tokens,
                          cached_tokens=output.cached_tokens)
            self.send_chunk(FinishChunk(request_id=request_id, finish_reason=finish_reason,
                                        usage=usage, stop_sequence=output.stop_string))

    def _send_with_tool_calls(self, request_id: str, stream: ToolCallStream,
                              output: RequestOutput) -> None:
        for piece in stream.feed(output):
            if isinstance(piece, IndexedCall):
                self.send_chunk(ToolCallChunk(request_id=request_id, index=piece.index,
                                              call=piece.call))
            else:
                self.send_chunk(TokenChunk(request_id=request_id, text=piece.text,
                                           token_ids=piece.token_ids,
                                           logprobs=_logprob_items(piece.logprobs)))

    def _error(self, request_id: str, code: str, message: str, param: str | None = None) -> None:
        self.send_chunk(ErrorChunk(request_id=request_id, code=code, message=message,
                                   param=param))

    def send_chunk(self, chunk: Any) -> None:
        if self._outbox is not None:  # inside step(): sent with the step's other chunks
            self._outbox.append(chunk)
        else:
            self.channel.send(ChunkMessage(chunk=chunk))


class EngineBroken(RuntimeError):
    """The engine's state is no longer trustworthy; the runner exits to be restarted."""


def start_watchdog(parent_pid: int, interval_s: float = 1.0) -> None:
    """Exit at once when the parent dies (we are re-parented), so no runner is orphaned."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="runner-watchdog", daemon=True).start()


def serve(sock: socket.socket) -> int:
    channel = Channel(sock)
    try:
        first = channel.receive(block=True)
        if first[0] is _EOF:
            return 0
        load = parse_to_runner(first[0])
        if not isinstance(load, Load):
            raise ValueError(f"the first message must be load, not {load.type}")
        try:
            engine = build_engine(load, channel)
        except Exception as error:  # noqa: BLE001 - reported, then exit
            log.error("loading %s failed:\n%s", load.engine.source.model_id, traceback.format_exc())
            channel.send(Failed(message=str(error) or type(error).__name__,
                                error_type=type(error).__name__))
            return 2
        if getattr(engine, "is_follower", False):
            return serve_rank(engine, channel, first[1:])
        channel.send(Status(state="ready", stage="ready", progress=1.0, model=model_info(engine)))
        loop = RunnerLoop(engine, channel)
        try:
            for raw in first[1:]:
                if not loop.handle(raw):
                    return 0
            loop.run()
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()  # the other ranks of a parallel instance stop too
        return 0
    except SupervisorGone:
        return 0
    except EngineBroken as error:
        channel.send(Failed(message=str(error), error_type="EngineBroken"))
        return 4
    except (BrokenPipeError, ConnectionError) as error:
        log.error("runner socket failed: %s", error)
        return 0


def serve_rank(engine: Any, channel: Channel, early: list[Any]) -> int:
    """A rank other than 0: report ready, then follow rank 0's steps until Shutdown (or the
    socket closing), a shutdown plan, or the group failing (reported, then exit)."""
    from shoal.engine.parallel.group import GroupError

    channel.send(Status(state="ready", stage="ready", progress=1.0, model=ModelInfo(
        model_id=engine.model_id, max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size, has_chat_template=False,
        size_bytes=_memory_bytes(engine))))
    stop = [any(_ends_serving(raw) for raw in early)]

    def stop_requested() -> bool:
        stop[0] = stop[0] or any(_ends_serving(raw) for raw in channel.receive(block=False))
        return stop[0]

    try:
        engine.run(stop_requested)
    except GroupError as error:
        log.error("%s", error)
        channel.send(Failed(message=str(error), error_type="GroupError"))
        return 5
    return 0


def _ends_serving(raw: Any) -> bool:
    return raw is _EOF or (isinstance(raw, dict) and raw.get("type") == "shutdown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal-runner")
    parser.add_argument("--socket", required=True, help="the supervisor's unix socket")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="runner %(process)d %(levelname)s %(message)s")
    start_watchdog(args.parent_pid if args.parent_pid is not None else os.getppid())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    try:
        return serve(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
