"""The image runner's loop: one pipeline draws one request at a time, in arrival order.

Between denoising steps it sends the step's progress and reads its messages, so a Cancel
stops the request it names at the next step and a Shutdown (or the supervisor gone) stops
the runner there. A setting the pipeline does not take is the request's invalid_request
error; any other failure of one request is its internal error, and the runner serves on.
"""

from __future__ import annotations

import logging
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from shoal.protocol import ErrorChunk, ImageChunk, ImageProgressChunk, ImageRequest, ImagesDone
from shoal.runner.channel import EOF, Channel
from shoal.runner.framing import FrameTooLarge
from shoal.runner.image.messages import IMAGE_RUNNER_TYPES, SubmitImages, parse_to_image_runner
from shoal.runner.memory import MemoryReporter
from shoal.runner.messages import Cancel, ChunkMessage, Shutdown

log = logging.getLogger("shoal.runner")


class Drawer(Protocol):
    """What the loop needs of a pipeline (diffusion/pipeline.py's ImagePipeline)."""

    def draw(self, request: ImageRequest, on_step: Callable[[int, int], None]) -> Any: ...


class Stop(Exception):
    """Raised from a step report (through the pipeline, which lets it pass): the request
    was cancelled, or the runner must stop."""


class ImageRunnerLoop:
    def __init__(self, model_id: str, pipeline: Drawer, channel: Channel,
                 memory: MemoryReporter | None = None) -> None:
        self.model_id = model_id
        self.pipeline = pipeline
        self.channel = channel
        self.memory = memory
        self.waiting: deque[ImageRequest] = deque()
        self.current: str | None = None  # the request being drawn
        self.cancelled = False  # the current one was cancelled
        self.stopping = False  # Shutdown arrived, or the socket closed

    def run(self, early: Sequence[Any] = ()) -> None:
        for raw in early:
            self.handle(raw)
        while not self.stopping:
            if not self.waiting:
                due = self.memory.seconds_until_due() if self.memory else None
                for raw in self.channel.receive(block=True, timeout_s=due):
                    self.handle(raw)
            if self.waiting and not self.stopping:
                self.draw(self.waiting.popleft())
            if self.memory is not None:
                self.memory.maybe_report()

    def handle(self, raw: Any) -> None:
        if raw is EOF:
            self.stopping = True
            return
        if not isinstance(raw, dict):
            return
        if raw.get("type") in ("submit", "embed"):  # never routed here; answered, not left
            self.refuse_text_request(raw)
            return
        if raw.get("type") not in IMAGE_RUNNER_TYPES:
            return  # an engine's message (prefix KV, proposals): nothing to answer
        try:
            message = parse_to_image_runner(raw)
        except ValidationError as error:
            log.error("malformed message for the image runner: %s", error)
            return
        if isinstance(message, SubmitImages):
            self.waiting.append(message.request)
        elif isinstance(message, Cancel):
            self.waiting = deque(r for r in self.waiting if r.request_id != message.request_id)
            self.cancelled = self.cancelled or message.request_id == self.current
        elif isinstance(message, Shutdown):
            self.stopping = True

    def draw(self, request: ImageRequest) -> None:
        self.current, self.cancelled = request.request_id, False
        try:
            drawing = self.pipeline.draw(request, lambda step, steps: self.stepped(
                request.request_id, step, steps))
        except Stop:
            return  # the supervisor has ended the request already
        except (ValueError, TypeError) as error:
            self.send_error(request.request_id, "invalid_request", str(error))
            return
        except Exception as error:  # noqa: BLE001 - one request fails, the runner serves on
            log.error("drawing %s failed:\n%s", request.request_id, traceback.format_exc())
            self.send_error(request.request_id, "internal", f"the pipeline failed: "
                                                 f"{type(error).__name__}: {error}")
            return
        finally:
            self.current = None
        for index, image in enumerate(drawing.images):
            try:
                self.channel.send(ChunkMessage(chunk=ImageChunk(
                    request_id=request.request_id, index=index, png_base64=image.png_base64,
                    width=image.width, height=image.height)))
            except FrameTooLarge as error:
                self.send_error(request.request_id, "invalid_request",
                                f"image {index} is too large to send ({error}); ask for a "
                                f"smaller size")
                return
        self.channel.send(ChunkMessage(chunk=ImagesDone(
            request_id=request.request_id, seed=request.seed, steps=drawing.steps,
            seconds=drawing.seconds)))

    def stepped(self, request_id: str, step: int, steps: int) -> None:
        """A denoising step ended: report it, then read what arrived meanwhile."""
        self.channel.send(ChunkMessage(chunk=ImageProgressChunk(
            request_id=request_id, step=step, steps=steps)))
        for raw in self.channel.receive(block=False):
            self.handle(raw)
        if self.cancelled or self.stopping:
            raise Stop(f"request {request_id} stopped at step {step}")

    def refuse_text_request(self, raw: dict[str, Any]) -> None:
        request = raw.get("request")
        request_id = request.get("request_id") if isinstance(request, dict) else None
        if isinstance(request_id, str):
            self.send_error(request_id, "invalid_request",
                            f"model {self.model_id!r} draws images; it takes no text or "
                            f"embedding requests")

    def send_error(self, request_id: str, code: str, message: str) -> None:
        self.channel.send(ChunkMessage(chunk=ErrorChunk(
            request_id=request_id, code=code, message=message)))
