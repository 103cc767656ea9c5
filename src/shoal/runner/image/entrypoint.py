"""The image runner subprocess: one diffusers pipeline, driven over a local socket.

    python -m shoal.runner.image.entrypoint --socket PATH --parent-pid PID

It connects, waits for Load (the model's EngineConfig: its source is a diffusers pipeline
directory, its dtype applies), loads the pipeline, reports what it holds and that it is
ready, then draws requests one at a time (loop.py). A failed load is a Failed message; a
crash is an exit its supervisor sees.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from shoal import logs
from shoal.engine.config import EngineConfig
from shoal.runner.channel import EOF, Channel
from shoal.runner.entrypoint import start_watchdog
from shoal.runner.image import INSTALL_HINT, diffusers_installed
from shoal.runner.image.loop import ImageRunnerLoop
from shoal.runner.image.messages import parse_to_image_runner
from shoal.runner.memory import MemoryReporter
from shoal.runner.messages import Failed, Load, ModelInfo, Status
from shoal.runner.records import RunnerRecords

log = logging.getLogger("shoal.runner")

PipelineLoader = Callable[[EngineConfig], Any]


def load_pipeline(config: EngineConfig) -> Any:
    if not diffusers_installed():
        raise RuntimeError(f"model {config.source.model_id!r} is a diffusers pipeline, and "
                           f"diffusers is not installed: {INSTALL_HINT}")
    # Here, not at the top: torch and diffusers load only in a process that draws.
    from shoal.diffusion.pipeline import ImagePipeline

    source = config.source
    return ImagePipeline.load(source.model_id, source.path, config.dtype)


def serve(sock: socket.socket, loader: PipelineLoader = load_pipeline) -> int:
    channel = Channel(sock, answer=RunnerRecords().answer)
    first = channel.receive(block=True)
    if first[0] is EOF:
        return 0
    load = parse_to_image_runner(first[0])
    if not isinstance(load, Load):
        raise ValueError(f"the first message must be load, not {load.type}")
    model_id = load.engine.source.model_id
    channel.send(Status(state="loading", stage="pipeline", progress=0.0))
    try:
        pipeline = loader(load.engine)
    except Exception as error:  # noqa: BLE001 - reported, then exit
        log.error("loading %s failed:\n%s", model_id, traceback.format_exc())
        channel.send(Failed(message=str(error) or type(error).__name__,
                            error_type=type(error).__name__))
        return 2
    memory = MemoryReporter(pipeline, channel.send)
    memory.report()  # before ready: the supervisor knows the figures once it is ready
    # A pipeline has no context or vocabulary to speak of.
    channel.send(Status(state="ready", stage="ready", progress=1.0, model=ModelInfo(
        model_id=model_id, max_model_len=0, vocab_size=0, has_chat_template=False,
        task="image")))
    try:
        ImageRunnerLoop(model_id, pipeline, channel, memory).run(first[1:])
    except (BrokenPipeError, ConnectionError) as error:
        log.error("runner socket failed: %s", error)
    return 0


def main(argv: list[str] | None, loader: PipelineLoader = load_pipeline) -> int:
    parser = argparse.ArgumentParser(prog="shoal-image-runner")
    parser.add_argument("--socket", required=True, help="the supervisor's unix socket")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    logs.configure("runner", "image runner %(process)d %(levelname)s %(message)s")
    start_watchdog(args.parent_pid if args.parent_pid is not None else os.getppid())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    try:
        return serve(sock, loader)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
