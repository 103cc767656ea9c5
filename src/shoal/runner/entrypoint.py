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
from shoal.engine.outputs import RequestOutput, TokenLogprob
from shoal.engine.sampling import InvalidParameter
from shoal.protocol import (
    AcceptedChunk,
    ErrorChunk,
    FinishChunk,
    GenerationRequest,
    LogprobItem,
    TokenChunk,
    TopLogprobItem,
    Usage,
)
from shoal.runner.framing import FrameError, recv_frame, send_frame
from shoal.runner.messages import (
    Cancel,
    ChunkMessage,
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

    def receive(self, block: bool) -> list[Any]:
        """All waiting raw messages; with block, wait for at least one."""
        items = [self._inbox.get()] if block else []
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


def resolve_factory(spec: str | None) -> Callable[..., Any]:
    """The engine constructor: the real Engine, or "module:callable" injected by tests."""
    if spec is None:
        from shoal.engine.engine import Engine  # heavy (torch); imported only in the runner

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
    return resolve_factory(load.engine_factory)(config, progress)


def model_info(engine: Any) -> ModelInfo:
    tokenizer = engine.tokenizer
    return ModelInfo(model_id=engine.model_id, max_model_len=engine.max_model_len,
                     vocab_size=engine.vocab_size,
                     has_chat_template=bool(getattr(tokenizer, "has_chat_template", False)))


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

    def run(self) -> None:
        while True:
            block = not self.engine.has_unfinished_requests()
            for raw in self.channel.receive(block):
                if not self.handle(raw):
                    return
            if self.engine.has_unfinished_requests():
                self.step()

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
        elif isinstance(message, Cancel):
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
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            text = self.engine.render_chat(messages)
            return tokenizer.encode(text, add_special_tokens=True)
        if request.prompt is not None:
            return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        raise InvalidParameter("prompt", "one of prompt, messages or prompt_token_ids is needed")

    def submit(self, request: GenerationRequest) -> None:
        request_id = request.request_id
        try:
            ids = self.prompt_token_ids(request)
            self.engine.add_request(request_id, ids, request.sampling)
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
            self.in_flight.add(request_id)
            self.send_chunk(AcceptedChunk(request_id=request_id, prompt_tokens=len(ids)))

    # ---- step -----------------------------------------------------------------------------

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - fail the batch, keep serving
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_in_flight(f"engine step failed: {type(error).__name__}: {error}")
            return
        for output in outputs:
            self.send_output(output)

    def _fail_in_flight(self, message: str) -> None:
        failed, self.in_flight = sorted(self.in_flight), set()
        for request_id in failed:
            self._error(request_id, "internal", message)
            self.engine.abort_request(request_id)
        try:
            self.engine.step()  # reports the aborts; frees their KV blocks
        except Exception as error:  # noqa: BLE001
            raise EngineBroken(f"engine cannot recover after a failed step: {error}") from error
        if self.engine.has_unfinished_requests():
            raise EngineBroken("engine still holds requests after aborting all of them")

    def send_output(self, output: RequestOutput) -> None:
        request_id = output.request_id
        if request_id not in self.in_flight:
            return  # cancelled by the supervisor, or already failed
        if output.text or output.token_ids:
            self.send_chunk(TokenChunk(request_id=request_id, text=output.text,
                                       token_ids=output.token_ids,
                                       logprobs=_logprob_items(output.logprobs)))
        if output.finished:
            self.in_flight.discard(request_id)
            usage = Usage(prompt_tokens=output.prompt_tokens,
                          completion_tokens=output.completion_tokens,
                          cached_tokens=output.cached_tokens)
            self.send_chunk(FinishChunk(request_id=request_id,
                                        finish_reason=output.finish_reason or "stop",
                                        usage=usage))

    def _error(self, request_id: str, code: str, message: str, param: str | None = None) -> None:
        self.send_chunk(ErrorChunk(request_id=request_id, code=code, message=message,
                                   param=param))

    def send_chunk(self, chunk: Any) -> None:
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
        channel.send(Status(state="ready", stage="ready", progress=1.0, model=model_info(engine)))
        loop = RunnerLoop(engine, channel)
        for raw in first[1:]:
            if not loop.handle(raw):
                return 0
        loop.run()
        return 0
    except SupervisorGone:
        return 0
    except EngineBroken as error:
        channel.send(Failed(message=str(error), error_type="EngineBroken"))
        return 4
    except (BrokenPipeError, ConnectionError) as error:
        log.error("runner socket failed: %s", error)
        return 0


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
