"""POST /v1/images/generations on a `shoal serve` subprocess over a tiny Stable Diffusion
pipeline of random weights (tests/tiny_pipeline.py): the PNG has the size asked for and
equals the pipeline's own output for the same seed; concurrent requests take turns; bad
input is OpenAI's 400 (a killed runner: tests/runner/test_image_runner.py)."""

from __future__ import annotations

import base64
import io
import json
import threading

import httpx
import numpy as np
import pytest
from serve_process import start_serve, wait_healthy_or_fail
from tiny_pipeline import build_tiny_pipeline

pytestmark = pytest.mark.slow  # a node subprocess and a runner that imports diffusers

PROMPT = "a small red boat"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the node, the pipeline, its directory): the node starts while the pipeline is built."""
    node = start_serve(["--standalone", "--no-preload", "--threads", "2"],
                       tmp_path_factory.mktemp("shoal-images-data"), wait_healthy=False)
    try:
        directory = tmp_path_factory.mktemp("tiny-pipeline")
        pipeline = build_tiny_pipeline(directory)
        wait_healthy_or_fail(node)
    except BaseException:
        node.kill()
        raise
    yield node, pipeline, directory / "tiny-sd"
    assert node.stop() == 0, node.log_tail()


@pytest.fixture(scope="module")
def tiny(served):
    """(the pipeline, its directory)."""
    return served[1], served[2]


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def generate(url: str, timeout_s: float = 120, **body) -> httpx.Response:
    return httpx.post(url + "/v1/images/generations", json=body, timeout=timeout_s)


def pixels(b64_png: str) -> np.ndarray:
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(b64_png)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


def own_output(pipeline, seed: int, n: int, width: int, height: int, steps: int) -> list:
    import torch

    generator = torch.Generator("cpu").manual_seed(seed)
    images = pipeline(PROMPT, height=height, width=width, num_inference_steps=steps,
                      num_images_per_prompt=n, generator=generator).images
    return [np.asarray(image.convert("RGB")) for image in images]


def test_images_have_the_size_asked_for_and_equal_the_pipelines_own(server, tiny):
    pipeline, directory = tiny
    answer = generate(server.url, model=str(directory), prompt=PROMPT, n=2, size="32x24",
                      seed=7, steps=2)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["x_seed"] == 7 and body["size"] == "32x24" and isinstance(body["created"], int)
    ours = [pixels(item["b64_json"]) for item in body["data"]]
    assert [image.shape for image in ours] == [(24, 32, 3)] * 2
    reference = own_output(pipeline, seed=7, n=2, width=32, height=24, steps=2)
    for mine, theirs in zip(ours, reference, strict=True):
        assert np.array_equal(mine, theirs)
    # The same seed again, now naming the model by its id: the same images.
    again = generate(server.url, model="tiny-sd", prompt=PROMPT, n=2, size="32x24", seed=7,
                     num_inference_steps=2).json()
    assert [item["b64_json"] for item in again["data"]] == [i["b64_json"] for i in body["data"]]
    # OpenAI's own client, the extensions in extra_body.
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    drawn = client.images.generate(model="tiny-sd", prompt=PROMPT, n=2, size="32x24",
                                   response_format="b64_json",
                                   extra_body={"seed": 7, "steps": 2})
    assert [item.b64_json for item in drawn.data] == [i["b64_json"] for i in body["data"]]
    other = generate(server.url, model="tiny-sd", prompt=PROMPT, size="32x24", seed=8,
                     steps=2).json()
    assert other["data"][0]["b64_json"] != body["data"][0]["b64_json"]
    health = {m["model"]: m for m in httpx.get(server.url + "/health", timeout=5).json()["models"]}
    assert health["tiny-sd"]["task"] == "image" and health["tiny-sd"]["size_bytes"] > 0


def stream_events(url: str, body: dict, events: list, lock: threading.Lock) -> None:
    with httpx.stream("POST", url + "/v1/images/generations", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                with lock:
                    events.append((body["seed"], name, json.loads(line[len("data: "):])))


def test_two_concurrent_requests_take_turns_and_stream_their_progress(server, tiny):
    _, directory = tiny
    events: list = []
    lock = threading.Lock()
    threads = [threading.Thread(target=stream_events, args=(server.url, {
        "model": "tiny-sd", "prompt": PROMPT, "size": "32x32", "seed": seed, "steps": 6},
        events, lock)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    names = [(seed, name) for seed, name, _ in events]
    for seed in (1, 2):
        mine = [data for s, name, data in events if s == seed]
        assert [d["step"] for d in mine if d["type"] == "image_generation.progress"] == \
            [1, 2, 3, 4, 5, 6]
        assert mine[-1]["type"] == "image_generation.completed" and mine[-1]["x_seed"] == seed
        assert pixels(mine[-1]["b64_json"]).shape == (32, 32, 3)
    # One pipeline draws one request at a time: the second's steps all come after the first
    # has finished (the queue holds it meanwhile).
    first = names[0][0]
    first_done = names.index((first, "image_generation.completed"))
    assert all(seed == first for seed, _ in names[:first_done + 1])


@pytest.mark.parametrize(("body", "param"), [
    ({"size": "31x32"}, "size"),
    ({"size": "big"}, "size"),
    ({"size": "4096x4096"}, "size"),
    ({"n": 11}, "n"),
    ({"n": 0}, "n"),
    ({"response_format": "url"}, "response_format"),
    ({"steps": 0}, "steps"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"model": "smollm2-135m-instruct"}, "model"),
    ({"quality": "hd"}, "quality"),
])
def test_bad_input_is_openais_400(server, body, param):
    request = {"model": "tiny-sd", "prompt": PROMPT, "size": "32x32", "steps": 1, **body}
    request = {k: v for k, v in request.items() if v is not None}
    answer = generate(server.url, **request)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


def test_a_chat_request_naming_an_image_model_is_a_400(server, tiny):
    generate(server.url, model="tiny-sd", prompt=PROMPT, size="16x16", steps=1)  # known
    answer = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny-sd", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "model" and "image model" in error["message"]
    assert "/v1/images/generations" in error["message"]
