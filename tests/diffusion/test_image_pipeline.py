"""ImagePipeline over stand-in pipelines (no weights): the call it makes for a request,
settings a pipeline does not take refused by name, step reports, PNG output, devices."""

from __future__ import annotations

import base64
import io

import pytest

from shoal.diffusion.pipeline import ImagePipeline, choose_device, choose_dtype
from shoal.protocol import ImageRequest


class Output:
    def __init__(self, images) -> None:
        self.images = images


class StepsPipeline:
    """Takes what Stable Diffusion takes; runs `num_inference_steps` steps of nothing."""

    num_timesteps = 0

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, prompt, negative_prompt=None, num_inference_steps=50, width=None,
                 height=None, guidance_scale=7.5, num_images_per_prompt=1, generator=None,
                 output_type="pil", callback_on_step_end=None):
        from PIL import Image

        self.calls.append(dict(prompt=prompt, negative_prompt=negative_prompt,
                               steps=num_inference_steps, width=width, height=height,
                               n=num_images_per_prompt, seed=generator.initial_seed()))
        self.num_timesteps = num_inference_steps
        for index in range(num_inference_steps):
            callback_on_step_end(self, index, None, {})
        size = (width or 8, height or 8)
        return Output([Image.new("RGB", size, (index, 0, 0))
                       for index in range(num_images_per_prompt)])


class PlainPipeline:
    """Takes only a prompt and a generator (no negative prompt, no size, no callback)."""

    def __call__(self, prompt, generator=None, output_type="pil"):
        from PIL import Image

        return Output([Image.new("RGB", (4, 4))])


def request(**settings) -> ImageRequest:
    return ImageRequest(request_id="r", model="m", prompt="a boat", seed=5, **settings)


def test_a_request_becomes_the_pipeline_call_and_its_steps_are_reported():
    pipeline = StepsPipeline()
    reports = []
    drawing = ImagePipeline("m", pipeline, "cpu").draw(
        request(n=2, width=16, height=8, steps=3, negative_prompt="fog"),
        lambda step, steps: reports.append((step, steps)))
    assert pipeline.calls == [dict(prompt="a boat", negative_prompt="fog", steps=3, width=16,
                                   height=8, n=2, seed=5)]
    assert reports == [(1, 3), (2, 3), (3, 3)] and drawing.steps == 3
    from PIL import Image

    images = [Image.open(io.BytesIO(base64.b64decode(i.png_base64))) for i in drawing.images]
    assert [(i.format, i.size) for i in images] == [("PNG", (16, 8))] * 2
    assert [i.getpixel((0, 0)) for i in images] == [(0, 0, 0), (1, 0, 0)]


def test_a_setting_the_pipeline_does_not_take_is_refused_by_name():
    plain = ImagePipeline("m", PlainPipeline(), "cpu")
    assert len(plain.draw(request(), lambda step, steps: None).images) == 1
    with pytest.raises(ValueError, match="negative_prompt, num_inference_steps"):
        plain.arguments(request(steps=2, negative_prompt="fog"))


def test_what_a_step_report_raises_stops_the_drawing():
    class Stop(Exception):
        pass

    def stop(step, steps):
        raise Stop()

    with pytest.raises(Stop):
        ImagePipeline("m", StepsPipeline(), "cpu").draw(request(steps=5), stop)


def test_device_and_dtype():
    import torch

    assert choose_device({"SHOAL_IMAGE_DEVICE": "cuda:1"}) == "cuda:1"
    assert choose_dtype("auto", "cpu") == torch.float32
    assert choose_dtype("auto", "cuda") == torch.float16
    assert choose_dtype("bfloat16", "cuda") == torch.bfloat16
