"""The runner subprocess: one engine, driven over a local socket by its supervisor.

    python -m shoal.runner.entrypoint --socket PATH --parent-pid PID

It connects, waits for Load, builds the engine with the factory main() was given (shoal's
engines here; tests start runners of fake engines the same way) while reporting progress,
reports what it holds (MemoryUsage, again every few seconds while it runs), then loops:
take messages (blocking only while idle), step the engine, stream chunks back. A crash
anywhere is either a Failed message or an exit the supervisor sees; it never leaves a
request hanging.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from shoal import logs
from shoal.diagnostics.flight import FlightLogHandler
from shoal.engine.core import EngineCore, EngineFactory
from shoal.engine.errors import GroupError
from shoal.runner.channel import EOF, Channel, SupervisorGone
from shoal.runner.chat_format import choose_chat_format
from shoal.runner.loop import EngineBroken, RunnerLoop
from shoal.runner.kv_grant import KVGrantKeeper
from shoal.runner.memory import MemoryReporter, loading_heap
from shoal.runner.messages import Failed, Load, ModelInfo, Status, parse_to_runner
from shoal.runner.proposals import attach_remote_proposer
from shoal.runner.records import RunnerRecords
from shoal.tracing.otlp import OtlpExporter

log = logging.getLogger("shoal.runner")

_PROGRESS_INTERVAL_S = 0.2


def load_engine(load: Load, channel: Channel, engine_factory: EngineFactory,
                records: RunnerRecords | None = None) -> EngineCore:
    """Build the engine Load asks for, reporting its progress (at most every
    _PROGRESS_INTERVAL_S, and its end)."""
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
    return engine_factory(load.engine, progress)


def model_info(engine: EngineCore) -> ModelInfo:
    """What the supervisor learns of a loaded model (a follower rank reads no text: no
    chat template)."""
    tokenizer = engine.tokenizer
    embeds = engine.task == "embed"
    reasons = (tokenizer is not None and not embeds
               and choose_chat_format(tokenizer, engine.render_chat).reasons)
    return ModelInfo(model_id=engine.model_id, max_model_len=engine.max_model_len,
                     vocab_size=engine.vocab_size,
                     has_chat_template=tokenizer is not None and tokenizer.has_chat_template,
                     task=engine.task, reasons=reasons,
                     embedding_dimensions=engine.dimensions if embeds else None)


def start_watchdog(parent_pid: int, interval_s: float = 1.0) -> None:
    """Exit at once when the parent dies (we are re-parented), so no runner is orphaned."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="runner-watchdog", daemon=True).start()


def serve(sock: socket.socket, engine_factory: EngineFactory,
          records: RunnerRecords | None = None) -> int:
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
                engine = load_engine(load, channel, engine_factory, records)
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


def serve_engine(engine: EngineCore, channel: Channel, early: list[Any]) -> int:
    """Serve the loaded engine: rank 0's loop, or a follower rank's; early: messages that
    came with Load."""
    kv_grant = None if engine.is_follower else KVGrantKeeper(engine, channel.send)
    if kv_grant is not None:
        kv_grant.start()  # the first grant, before the first report counts it
    memory = MemoryReporter(engine, channel.send)
    memory.report()  # before ready: the supervisor knows the figures once it is ready
    if engine.is_follower:
        return serve_rank(engine, channel, early, memory)
    channel.send(Status(state="ready", stage="ready", progress=1.0, model=model_info(engine)))
    loop = RunnerLoop(engine, channel, memory, kv_grant)
    try:
        for raw in early:
            if not loop.handle(raw):
                return 0
        loop.run()
    finally:
        engine.close()  # the other ranks of a parallel instance stop too
    return 0


@contextlib.contextmanager
def exporting_spans(engine: EngineCore, load: Load) -> Iterator[None]:
    """While serving: the engine's spans also go to OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is
    set (flushed when the runner stops)."""
    tracer = engine.tracer
    exporter = None
    if tracer is not None:

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


def serve_rank(engine: EngineCore, channel: Channel, early: list[Any],
               memory: MemoryReporter) -> int:
    """A rank other than 0: report ready, then follow rank 0's steps until Shutdown (or the
    socket closing), a shutdown plan, or the group failing (reported, then exit)."""
    channel.send(Status(state="ready", stage="ready", progress=1.0, model=model_info(engine)))
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


def main(argv: list[str] | None, engine_factory: EngineFactory) -> int:
    """Run a runner process: connect to the supervisor's socket (argv: --socket PATH
    [--parent-pid PID]) and serve one engine that engine_factory builds."""
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
        return serve(sock, engine_factory, records)
    finally:
        sock.close()


if __name__ == "__main__":
    # Here, not at the top: the engines load torch, which a runner of fakes never needs.
    from shoal.engine.factory import build_engine

    sys.exit(main(sys.argv[1:], build_engine))
