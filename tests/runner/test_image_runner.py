"""The image runner subprocess under its supervisor, over a fake pipeline
(tests/fake_image_runner.py): chunks in order, a request at a time, cancellation between
steps, a bad setting or a failing pipeline as the request's error, a crash as a clear
error and a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest
from fake_image_runner import FAKE_IMAGE_RUNNER
from fakes import fake_runner_env, fake_supervisor_options

from shoal.engine.config import EngineConfig, ModelSource
from shoal.protocol import ImageRequest
from shoal.runner.supervisor import RunnerSupervisor


def pipeline_config(tmp_path) -> EngineConfig:
    directory = tmp_path / "fake-pipeline"
    directory.mkdir(exist_ok=True)
    (directory / "model_index.json").write_text("{}")
    return EngineConfig(source=ModelSource(model_id="fake-pipeline", format="diffusers",
                                           path=directory, task="image"))


def image_request(request_id: str, prompt: str = "a boat", **settings) -> ImageRequest:
    return ImageRequest(request_id=request_id, model="fake-pipeline", prompt=prompt,
                        seed=settings.pop("seed", 3), **settings)


def run_with_image_supervisor(tmp_path, scenario):
    async def main():
        options = fake_supervisor_options(runner_command=(sys.executable, FAKE_IMAGE_RUNNER),
                                          env=fake_runner_env())
        supervisor = RunnerSupervisor(pipeline_config(tmp_path), options)
        try:
            await supervisor.start()
            return await scenario(supervisor)
        finally:
            await supervisor.shutdown()

    return asyncio.run(main())


async def drain(supervisor: RunnerSupervisor, request: ImageRequest) -> list:
    return [chunk async for chunk in supervisor.generate_images(request)]


def test_progress_then_images_then_done_and_requests_run_one_at_a_time(tmp_path):
    async def scenario(supervisor):
        assert supervisor.model_info.task == "image"
        first, second = await asyncio.gather(
            drain(supervisor, image_request("a", n=2, width=16, height=8, steps=3)),
            drain(supervisor, image_request("b", steps=2, seed=9)))
        return first, second, supervisor.memory

    first, second, memory = run_with_image_supervisor(tmp_path, scenario)
    assert [c.kind for c in first] == ["image_progress"] * 3 + ["image"] * 2 + ["images_done"]
    assert [(c.step, c.steps) for c in first[:3]] == [(1, 3), (2, 3), (3, 3)]
    assert [(c.index, c.width, c.height) for c in first[3:5]] == [(0, 16, 8), (1, 16, 8)]
    assert first[-1].seed == 3 and first[-1].steps == 3
    assert [c.kind for c in second][-1] == "images_done" and second[-1].seed == 9
    assert memory is not None and memory.weights_bytes == 1000


def test_the_dashboard_sees_the_steps_of_a_drawing(tmp_path):
    async def scenario(supervisor):
        seen = []
        async for chunk in supervisor.generate_images(image_request("a", steps=3)):
            if chunk.kind == "image_progress":
                seen.append(supervisor.describe()["image_steps"])
        return seen, supervisor.describe()["image_steps"]

    seen, after = run_with_image_supervisor(tmp_path, scenario)
    assert seen[-1] == [{"request_id": "a", "step": 3, "steps": 3}]
    assert after == []


def test_a_closed_stream_cancels_its_drawing_between_steps(tmp_path):
    async def scenario(supervisor):
        stream = supervisor.generate_images(image_request("long", steps=200))
        assert (await anext(stream)).kind == "image_progress"
        started = time.monotonic()
        await stream.aclose()
        # The next request is served at once: the cancelled one stopped at its next step.
        after = await drain(supervisor, image_request("next", steps=1))
        return time.monotonic() - started, after

    elapsed, after = run_with_image_supervisor(tmp_path, scenario)
    assert after[-1].kind == "images_done" and elapsed < 3


def test_a_setting_the_pipeline_refuses_or_a_failure_is_the_requests_error(tmp_path):
    async def scenario(supervisor):
        refused = await drain(supervisor, image_request("a", prompt="refuse"))
        failed = await drain(supervisor, image_request("b", prompt="fail"))
        fine = await drain(supervisor, image_request("c", steps=1))
        return refused, failed, fine

    refused, failed, fine = run_with_image_supervisor(tmp_path, scenario)
    assert refused == [refused[0]] and refused[0].code == "invalid_request"
    assert "negative_prompt" in refused[0].message
    assert failed[0].code == "internal" and "broke" in failed[0].message
    assert fine[-1].kind == "images_done"


def test_a_killed_runner_fails_its_request_clearly_and_restarts(tmp_path):
    async def scenario(supervisor):
        old_pid = supervisor.pid
        stream = supervisor.generate_images(image_request("a", steps=500))
        assert (await anext(stream)).kind == "image_progress"
        os.kill(old_pid, signal.SIGKILL)
        started = time.monotonic()
        rest = [chunk async for chunk in stream]
        elapsed = time.monotonic() - started
        await supervisor.wait_ready(20)
        after = await drain(supervisor, image_request("b", steps=1))
        return old_pid, supervisor.pid, rest, elapsed, after

    old_pid, new_pid, rest, elapsed, after = run_with_image_supervisor(tmp_path, scenario)
    assert rest[-1].kind == "error" and rest[-1].code == "runner_crashed"
    assert elapsed < 2 and new_pid != old_pid
    assert after[-1].kind == "images_done"


def test_a_text_request_sent_to_an_image_runner_is_answered_with_an_error(tmp_path):
    from shoal.protocol import GenerationRequest

    async def scenario(supervisor):
        text = GenerationRequest(request_id="t", model="fake-pipeline", prompt="hello")
        return [chunk async for chunk in supervisor.submit(text)]

    chunks = run_with_image_supervisor(tmp_path, scenario)
    assert [c.kind for c in chunks] == ["error"] and chunks[0].code == "invalid_request"
    assert "draws images" in chunks[0].message


def test_without_diffusers_loading_says_how_to_install_it(tmp_path, monkeypatch):
    from shoal.runner.image import entrypoint

    monkeypatch.setattr(entrypoint, "diffusers_installed", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install 'shoal\[image\]'"):
        entrypoint.load_pipeline(pipeline_config(tmp_path))
