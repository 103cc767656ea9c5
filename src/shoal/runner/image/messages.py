"""What the supervisor sends an image runner: the runner protocol's Load, Cancel and
Shutdown (runner/messages.py), and SubmitImages. Answers are the protocol's Status,
MemoryUsage, ChunkMessage (ImageProgressChunk, ImageChunk, ImagesDone, ErrorChunk) and
Failed."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from shoal.protocol import ImageRequest
from shoal.runner.messages import Cancel, Load, Shutdown
from shoal.runner.prefix_messages import RunnerMessage


class SubmitImages(RunnerMessage):
    type: Literal["submit_images"] = "submit_images"
    request: ImageRequest


ToImageRunner = Annotated[Load | SubmitImages | Cancel | Shutdown, Field(discriminator="type")]
_to_image_runner = TypeAdapter(ToImageRunner)
# What an image runner reads (anything else it is sent is not for it, and ignored).
IMAGE_RUNNER_TYPES = ("load", "submit_images", "cancel", "shutdown")


def parse_to_image_runner(raw: dict[str, Any]) -> RunnerMessage:
    return _to_image_runner.validate_python(raw)
