"""The runner subprocess: one engine, driven over a local socket by its supervisor.

    python -m shoal.runner.entrypoint --socket PATH --parent-pid PID

It connects, waits for Load, builds the engine (reporting progress), reports what it holds
(MemoryUsage, again every few seconds while it runs), then loops: take messages (blocking
only while idle), step the engine, stream chunks back. A crash anywhere
is either a Failed message or an exit the supervisor sees; it never leaves a request hanging.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from shoal import logs
from shoal.diagnostics.flight import FlightLogHandler
from shoal.runner.channel import EOF, Channel, SupervisorGone
from shoal.runner.loop import EngineBroken, RunnerLoop, engine_task
from shoal.runner.memory import MemoryReporter, loading_heap
from shoal.runner.proposals import attach_remote_proposer
from shoal.runner.records import RunnerRecords
from shoal.runner.messages import (
    Failed,
    Load,
    ModelInfo,
    Status,
    parse_to_runner,
)

log = logging.getLogger("shoal.runner")

_PROGRESS_INTERVAL_S = 0.2


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


def build_engine(load: Load, channel: Channel, records: RunnerRecords | None = None) -> Any:
    config = load.engine
    if load.engine_factory is None and config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    last_sent = [0.0]

    def progress(stage: str, fraction: float) -> None:
        if records is not None:
            records.flight.load_progress(stage, fraction)
        now = time.monotonic()
        if now - last_sent[0] >= _PROGRESS_INTERVAL_S or fraction >= 1.0:
            last_sent[0] = now
            channel.send(Status(state="loading", stage=stage,
                                progress=min(max(float(fraction), 0.0), 1.0)))

    progress("starting", 0.0)
    follower = config.parallel is not None and config.parallel.rank > 0
    return resolve_factory(load.engine_factory, config.source.task, follower)(config, progress)



def model_info(engine: Any) -> ModelInfo:
    tokenizer = engine.tokenizer
    embeds = engine_task(engine) == "embed"
    return ModelInfo(model_id=engine.model_id, max_model_len=engine.max_model_len,
                     vocab_size=engine.vocab_size,
                     has_chat_template=bool(getattr(tokenizer, "has_chat_template", False)),
                     task="embed" if embeds else "generate",
                     embedding_dimensions=engine.dimensions if embeds else None)


def start_watchdog(parent_pid: int, interval_s: float = 1.0) -> None:
    """Exit at once when the parent dies (we are re-parented), so no runner is orphaned."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="runner-watchdog", daemon=True).start()


def serve(sock: socket.socket, records: RunnerRecords | None = None) -> int:
    records = records or RunnerRecords()
    channel = Channel(sock, answer=records.answer)
    try:
        first = channel.receive(block=True)
        if first[0] is EOF:
            return 0
        load = parse_to_runner(first[0])
        if not isinstance(load, Load):
            raise ValueError(f"the first message must be load, not {load.type}")
        try:
            with loading_heap():
                engine = build_engine(load, channel, records)
        except Exception as error:  # noqa: BLE001 - reported, then exit
            records.flight.load_failed()
            log.error("loading %s failed:\n%s", load.engine.source.model_id, traceback.format_exc())
            channel.send(Failed(message=str(error) or type(error).__name__,
                                error_type=type(error).__name__))
            return 2
        records.watch(engine)
        attach_remote_proposer(engine, channel)
        with exporting_spans(engine, load):
            return serve_engine(engine, channel, first[1:])
    except SupervisorGone:
        return 0
    except EngineBroken as error:
        channel.send(Failed(message=str(error), error_type="EngineBroken"))
        return 4
    except (BrokenPipeError, ConnectionError) as error:
        log.error("runner socket failed: %s", error)
        return 0


def serve_engine(engine: Any, channel: Channel, early: list[Any]) -> int:
    """Serve the loaded engine: rank 0's loop, or a follower rank's; early: messages that
    came with Load."""
    memory = MemoryReporter(engine, channel.send)
    memory.report()  # before ready: the supervisor knows the figures once it is ready
    if getattr(engine, "is_follower", False):
        return serve_rank(engine, channel, early, memory)
    channel.send(Status(state="ready", stage="ready", progress=1.0, model=model_info(engine)))
    loop = RunnerLoop(engine, channel, memory)
    try:
        for raw in early:
            if not loop.handle(raw):
                return 0
        loop.run()
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()  # the other ranks of a parallel instance stop too
    return 0


@contextlib.contextmanager
def exporting_spans(engine: Any, load: Load) -> Iterator[None]:
    """While serving: the engine's spans also go to OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is
    set (flushed when the runner stops)."""
    tracer = getattr(engine, "tracer", None)
    exporter = None
    if tracer is not None:
        from shoal.tracing.otlp import OtlpExporter

        parallel = load.engine.parallel
        exporter = OtlpExporter.from_env({
            "shoal.role": "runner", "shoal.model": load.engine.source.model_id,
            "shoal.rank": parallel.rank if parallel is not None else 0,
            "process.pid": os.getpid()})
        tracer.spans.exporter = exporter
    try:
        yield
    finally:
        if exporter is not None:
            tracer.spans.exporter = None
            exporter.shutdown()


def serve_rank(engine: Any, channel: Channel, early: list[Any], memory: MemoryReporter) -> int:
    """A rank other than 0: report ready, then follow rank 0's steps until Shutdown (or the
    socket closing), a shutdown plan, or the group failing (reported, then exit)."""
    from shoal.engine.parallel.group import GroupError

    channel.send(Status(state="ready", stage="ready", progress=1.0, model=ModelInfo(
        model_id=engine.model_id, max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size, has_chat_template=False)))
    stop = [any(_ends_serving(raw) for raw in early)]

    def stop_requested() -> bool:  # asked between rank 0's plans (at least every keep-alive)
        stop[0] = stop[0] or any(_ends_serving(raw) for raw in channel.receive(block=False))
        memory.maybe_report()
        return stop[0]

    try:
        engine.run(stop_requested)
    except GroupError as error:
        log.error("%s", error)
        channel.send(Failed(message=str(error), error_type="GroupError"))
        return 5
    return 0


def _ends_serving(raw: Any) -> bool:
    return raw is EOF or (isinstance(raw, dict) and raw.get("type") == "shutdown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal-runner")
    parser.add_argument("--socket", required=True, help="the supervisor's unix socket")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    logs.configure("runner", "runner %(process)d %(levelname)s %(message)s")
    records = RunnerRecords()
    logging.getLogger().addHandler(FlightLogHandler(records.flight))
    start_watchdog(args.parent_pid if args.parent_pid is not None else os.getppid())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    try:
        return serve(sock, records)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
