"""POST /v1/images/generations: OpenAI's image endpoint over a diffusers pipeline.

The body is OpenAI's: prompt, model, n (1..10), size ("WxH", each side a multiple of 8 from
16 to 2048, or "auto": the pipeline's own size) and response_format, which can only be
b64_json (nothing is hosted, so no url). Extensions: seed (the same seed, prompt and
settings give the same images; without one a random seed is drawn and returned as x_seed),
steps or num_inference_steps, guidance_scale, negative_prompt, keep_alive, and shoal's
admission fields (x_priority, x_client_id).

The answer is {"created", "data": [{"b64_json": PNG}], "size", "output_format", "x_seed"}.
With "stream": true it is server-sent events instead: `image_generation.progress`
{"type", "step", "steps"} after each denoising step (all n images step together), then
one `image_generation.completed` per image {"type", "b64_json", "created_at", "size",
"output_format", "x_index", "x_seed"}; an error after the stream began is an `error` event
{"type": "error", "error": {...}}. (OpenAI's partial_image events, previews of an unfinished
image, are not sent: partial_images must be 0 or absent.) The answer's x-request-id
(img-...) is what POST /v1/requests/{id}/cancel takes; a client that leaves cancels too.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from shoal.api.admission import AdmissionFields, admitted
from shoal.api.errors import APIError, invalid_parameter
from shoal.api.generation import CLIENT_CLOSED_REQUEST, ClientGone, until_disconnect
from shoal.api.ollama.options import keep_alive_seconds
from shoal.api.openai.schemas import OpenAIModel
from shoal.api.sse import sse_event, with_keepalive
from shoal.protocol import ImageRequest

router = APIRouter()

MAX_IMAGES = 10  # OpenAI's bound on n
MIN_SIDE, MAX_SIDE, SIDE_MULTIPLE = 16, 2048, 8
MAX_STEPS = 500
MAX_SEED = 2**63 - 1
_SIZE = re.compile(r"([0-9]+)x([0-9]+)")
# OpenAI fields that change the picture in ways a diffusers pipeline has no setting for:
# refused unless absent or "auto", never silently dropped.
_UNSUPPORTED = ("quality", "style", "background", "moderation", "output_compression")


class ImagesBody(OpenAIModel, AdmissionFields):
    model: str = Field(min_length=1)
    prompt: str
    n: int = 1
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    seed: int | None = None
    steps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    stream: bool = False
    partial_images: int | None = None
    user: str | None = None
    keep_alive: float | str | None = None  # extension, as Ollama's: seconds or "5m"
    quality: Any = None
    style: Any = None
    background: Any = None
    moderation: Any = None
    output_compression: Any = None


def parse_size(size: str | None) -> tuple[int, int] | None:
    """(width, height) for "WxH"; None for absent or "auto" (the pipeline's default)."""
    if size is None or size == "auto":
        return None
    match = _SIZE.fullmatch(size.strip())
    if match is None:
        raise invalid_parameter("size", f"size must be \"WIDTHxHEIGHT\" (such as "
                                        f"\"512x512\") or \"auto\", not {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    for side in (width, height):
        if not MIN_SIDE <= side <= MAX_SIDE or side % SIDE_MULTIPLE:
            raise invalid_parameter("size", f"size {size!r} is not supported: width and "
                                            f"height must be multiples of {SIDE_MULTIPLE} "
                                            f"from {MIN_SIDE} to {MAX_SIDE}")
    return width, height


def _check_formats(body: ImagesBody) -> None:
    if body.response_format not in (None, "b64_json"):
        message = ("response_format \"url\" is not supported: shoal hosts no images; use "
                   "\"b64_json\"" if body.response_format == "url" else
                   f"response_format must be \"b64_json\", not {body.response_format!r}")
        raise invalid_parameter("response_format", message)
    if body.output_format not in (None, "png"):
        raise invalid_parameter("output_format", f"output_format must be \"png\", not "
                                                 f"{body.output_format!r}")
    if body.partial_images:
        raise invalid_parameter("partial_images", "partial images are not sent; stream "
                                                  "progress events come instead (omit it)")
    for name in _UNSUPPORTED:
        if getattr(body, name) not in (None, "auto"):
            raise invalid_parameter(name, f"{name} is not supported by diffusers pipelines; "
                                          f"omit it (or pass \"auto\")")


def _steps(body: ImagesBody) -> int | None:
    if body.steps is not None and body.num_inference_steps is not None \
            and body.steps != body.num_inference_steps:
        raise invalid_parameter("steps", "steps and num_inference_steps disagree; pass one")
    steps = body.steps if body.steps is not None else body.num_inference_steps
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise invalid_parameter("steps", f"steps must be from 1 to {MAX_STEPS}, not {steps}")
    return steps


def to_internal(body: ImagesBody, request_id: str) -> ImageRequest:
    """The internal request; APIError(400) naming the parameter for a bad input."""
    if not body.prompt.strip():
        raise invalid_parameter("prompt", "prompt must not be empty")
    if not 1 <= body.n <= MAX_IMAGES:
        raise invalid_parameter("n", f"n must be from 1 to {MAX_IMAGES}, not {body.n}")
    _check_formats(body)
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED:
        raise invalid_parameter("seed", f"seed must be from 0 to {MAX_SEED}, not {body.seed}")
    if body.guidance_scale is not None and not 0 <= body.guidance_scale <= 100:
        raise invalid_parameter("guidance_scale", "guidance_scale must be from 0 to 100")
    size = parse_size(body.size)
    return ImageRequest(
        request_id=request_id, model=body.model, prompt=body.prompt,
        negative_prompt=body.negative_prompt, n=body.n,
        width=size[0] if size else None, height=size[1] if size else None,
        steps=_steps(body), guidance_scale=body.guidance_scale,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**32),
        keep_alive_s=keep_alive_seconds(body.keep_alive))


@router.post("/v1/images/generations")
async def generations(body: ImagesBody, request: Request) -> Response:
    state = request.app.state
    internal = admitted(to_internal(body, f"img-{uuid.uuid4().hex}"), request, body)
    stream = state.router.generate_images(internal)
    try:
        first = await until_disconnect(request, anext(stream))
    except ClientGone:
        await stream.aclose()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except StopAsyncIteration:
        raise APIError(500, "the request ended without a reply", code="internal",
                       error_type="internal_error") from None
    if first.kind == "error":
        await stream.aclose()
        raise APIError.from_chunk(first)
    if body.stream:
        events = with_keepalive(_events(first, stream, internal.seed), state.keepalive_s)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
    try:
        images = await until_disconnect(request, _collect(first, stream))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await stream.aclose()
    size = f"{images[0].width}x{images[0].height}" if images else None
    return JSONResponse({"created": int(time.time()),
                         "data": [{"b64_json": image.png_base64} for image in images],
                         "size": size, "output_format": "png", "x_seed": internal.seed})


async def _chunks(first: Any, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for chunk in stream:
        yield chunk


async def _collect(first: Any, stream: AsyncIterator[Any]) -> list[Any]:
    """Every image of the request, in order; APIError on an error chunk."""
    images = []
    async for chunk in _chunks(first, stream):
        if chunk.kind == "error":
            raise APIError.from_chunk(chunk)
        if chunk.kind == "image":
            images.append(chunk)
        elif chunk.kind == "images_done":
            return sorted(images, key=lambda image: image.index)
    raise APIError(500, "the runner ended the stream without its images", code="internal",
                   error_type="internal_error")


async def _events(first: Any, stream: AsyncIterator[Any], seed: int) -> AsyncIterator[str]:
    try:
        async for chunk in _chunks(first, stream):
            if chunk.kind == "image_progress":
                yield sse_event({"type": "image_generation.progress", "step": chunk.step,
                                 "steps": chunk.steps}, "image_generation.progress")
            elif chunk.kind == "image":
                yield sse_event({"type": "image_generation.completed",
                                 "b64_json": chunk.png_base64, "created_at": int(time.time()),
                                 "size": f"{chunk.width}x{chunk.height}",
                                 "output_format": "png", "x_index": chunk.index,
                                 "x_seed": seed}, "image_generation.completed")
            elif chunk.kind == "error":
                yield sse_event({"type": "error", **APIError.from_chunk(chunk).body()}, "error")
                return
            elif chunk.kind == "images_done":
                return
    finally:
        await stream.aclose()
