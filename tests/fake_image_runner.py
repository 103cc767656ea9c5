"""An image runner process over a fake pipeline (no torch, no diffusers), for tests that
spawn image runners:

    python tests/fake_image_runner.py --socket PATH --parent-pid PID

It is shoal's image runner (shoal.runner.image.entrypoint.main) given FakeDrawer as its
pipeline. FakeDrawer sleeps STEP_S per step and draws solid PNGs whose colour is the seed;
a prompt "refuse" is a setting the pipeline does not take (ValueError), "fail" breaks it.
"""

from __future__ import annotations

import base64
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.runner.image.entrypoint import main

FAKE_IMAGE_RUNNER = str(Path(__file__).resolve())
STEP_S = 0.05
DEFAULT_STEPS = 4


@dataclass(frozen=True)
class FakeImage:
    png_base64: str
    width: int
    height: int


@dataclass(frozen=True)
class FakeDrawing:
    images: tuple[FakeImage, ...]
    steps: int
    seconds: float


def solid_png(width: int, height: int, seed: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (seed % 256, 0, 0)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class FakeDrawer:
    def weight_bytes(self) -> int:
        return 1000

    def stats(self) -> dict:
        return {}

    def kv_bytes_per_block(self) -> None:
        return None

    def draw(self, request, on_step) -> FakeDrawing:
        if request.prompt == "refuse":
            raise ValueError("this pipeline does not take negative_prompt")
        if request.prompt == "fail":
            raise RuntimeError("the pipeline broke")
        steps = request.steps or DEFAULT_STEPS
        for step in range(1, steps + 1):
            time.sleep(STEP_S)
            on_step(step, steps)
        width, height = request.width or 8, request.height or 8
        image = FakeImage(solid_png(width, height, request.seed), width, height)
        return FakeDrawing(images=(image,) * request.n, steps=steps, seconds=steps * STEP_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], loader=lambda config: FakeDrawer()))
