"""A diffusers pipeline loaded for serving: the device and dtype it runs on, and one
request's images drawn with a seeded generator, reporting each denoising step (the report
may raise to stop between steps).

Device: CUDA, else Apple's MPS, else the CPU, as torch finds them (SHOAL_IMAGE_DEVICE names
one). dtype "auto" is float32 on the CPU and float16 on an accelerator; float32 and
bfloat16 are taken as asked. The seed drives a CPU generator whatever the device, so a seed
means the same starting noise everywhere.
"""

from __future__ import annotations

import base64
import inspect
import io
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging

from shoal.diffusion.files import weights_variant
from shoal.protocol import ImageRequest

DEVICE_ENV = "SHOAL_IMAGE_DEVICE"
# How the request's settings reach the pipeline's __call__ (request field -> argument).
_OPTIONAL_ARGUMENTS = {"negative_prompt": "negative_prompt", "steps": "num_inference_steps",
                       "guidance_scale": "guidance_scale"}

# (steps done, steps in all); what it raises ends the drawing (a cancelled request).
StepReport = Callable[[int, int], None]


def choose_device(environ: dict[str, str] | os._Environ = os.environ) -> str:
    named = environ.get(DEVICE_ENV)
    if named:
        return named
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def choose_dtype(requested: str, device: str) -> torch.dtype:
    if requested == "float32":
        return torch.float32
    if requested == "bfloat16":
        return torch.bfloat16
    return torch.float32 if device == "cpu" else torch.float16


@dataclass(frozen=True)
class DrawnImage:
    png_base64: str
    width: int
    height: int


@dataclass(frozen=True)
class Drawing:
    images: tuple[DrawnImage, ...]
    steps: int
    seconds: float


class ImagePipeline:
    """One loaded pipeline. weight_bytes / stats / kv_bytes_per_block are what the runner's
    MemoryReporter asks of an engine (a pipeline keeps no KV cache)."""

    def __init__(self, model_id: str, pipeline: Any, device: str) -> None:
        self.model_id = model_id
        self.pipeline = pipeline
        self.device = device
        self._parameters = set(inspect.signature(pipeline.__call__).parameters)

    @classmethod
    def load(cls, model_id: str, directory: Path, dtype: str = "auto") -> ImagePipeline:
        device = choose_device()
        _quiet_progress_bars()
        with warnings.catch_warnings():
            # torch_dtype: the name every diffusers release below 1.0 (pyproject's bound)
            # reads; the newest call it deprecated in favour of dtype, which older ones lack.
            warnings.filterwarnings("ignore", message=".*torch_dtype.*")
            pipeline = DiffusionPipeline.from_pretrained(
                str(directory), torch_dtype=choose_dtype(dtype, device),
                local_files_only=True, variant=weights_variant(directory))
        pipeline = pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        return cls(model_id, pipeline, device)

    def weight_bytes(self) -> int:
        modules = [c for c in self.pipeline.components.values()
                   if isinstance(c, torch.nn.Module)]
        return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())

    def stats(self) -> dict[str, Any]:
        return {}

    def kv_bytes_per_block(self) -> None:
        return None

    def draw(self, request: ImageRequest, on_step: StepReport) -> Drawing:
        """request's images as PNGs; ValueError for a setting this pipeline does not take;
        what on_step raises passes through."""
        started = time.monotonic()
        arguments = self.arguments(request)
        steps_done = [0]
        if "callback_on_step_end" in self._parameters:
            def step_ended(pipeline: Any, index: int, _timestep: Any,
                           tensors: dict[str, Any]) -> dict[str, Any]:
                steps_done[0] = index + 1
                on_step(index + 1, int(getattr(pipeline, "num_timesteps", 0) or index + 1))
                return tensors
            arguments["callback_on_step_end"] = step_ended
        with torch.inference_mode():
            output = self.pipeline(**arguments)
        images = tuple(_png(image) for image in output.images)
        return Drawing(images=images, steps=steps_done[0],
                       seconds=time.monotonic() - started)

    def arguments(self, request: ImageRequest) -> dict[str, Any]:
        """The pipeline call for request: the same arguments a caller of the pipeline would
        pass (a CPU generator seeded with request.seed)."""
        arguments: dict[str, Any] = {
            "prompt": request.prompt,
            "generator": torch.Generator("cpu").manual_seed(request.seed),
            "output_type": "pil"}
        if request.n > 1:
            arguments["num_images_per_prompt"] = request.n
        if request.width is not None:
            arguments.update(width=request.width, height=request.height)
        for field, name in _OPTIONAL_ARGUMENTS.items():
            value = getattr(request, field)
            if value is not None:
                arguments[name] = value
        unknown = sorted(name for name in arguments if name not in self._parameters)
        if unknown:
            raise ValueError(f"model {self.model_id!r} ({type(self.pipeline).__name__}) does "
                             f"not take {', '.join(unknown)}")
        return arguments


def _quiet_progress_bars() -> None:
    """No tqdm bars from loading in the runner's log (its Status reports the load)."""
    diffusers_logging.disable_progress_bar()
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # a pipeline without text encoders needs no transformers
        return
    transformers_logging.disable_progress_bar()


def _png(image: Any) -> DrawnImage:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return DrawnImage(png_base64=base64.b64encode(buffer.getvalue()).decode("ascii"),
                      width=image.width, height=image.height)
