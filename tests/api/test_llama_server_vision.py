"""A vision model served by llama-server: a random-weight text GGUF with its projector
(`mmproj-*.gguf`) beside it, both made offline (tests/tiny_vision_model.py), takes images in
every dialect. The image reaches the model: it adds its tokens to the prompt, two images
give different greedy replies, and the same image gives the same reply whichever dialect
carried it. A model without a projector, and bad images, are the dialect's 400. One node
for the module (slow)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from random_gguf import write_random_llama_gguf
from shoal.api.image_input import MAX_IMAGE_BYTES
from shoal.config import (
    BackendSettings,
    ClusterSettings,
    EngineDefaults,
    NodeConfig,
    PoolSettings,
    ServerConfig,
)
from shoal.node import BackgroundNode
from shoal.pool.queue import QueueLimits
from tiny_vision_model import IMAGE_MARKER_TOKENS, TEXT_WIDTH, tiny_projector

pytestmark = pytest.mark.slow

VISION = "tiny-vision"
TEXT_ONLY = "tiny-text"  # the same kind of text model, without a projector
QUESTION = "What is in this picture?"
GREEDY = {"temperature": 0, "max_tokens": 8}


def _png(pixels: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


RED = _png(np.full((32, 32, 3), (255, 0, 0), np.uint8))
BLUE = _png(np.full((32, 32, 3), (0, 0, 255), np.uint8))


@pytest.fixture(scope="module")
def node(tmp_path_factory, llama_server_binary):
    tmp = tmp_path_factory.mktemp("vision-node")
    (tmp / "vision").mkdir()
    (tmp / "text").mkdir()
    vision = tmp / "vision" / f"{VISION}.gguf"
    text_only = tmp / "text" / f"{TEXT_ONLY}.gguf"
    for path in (vision, text_only):
        write_random_llama_gguf(path, hidden=TEXT_WIDTH, layers=2, ffn=128, heads=4,
                                extra_tokens=IMAGE_MARKER_TOKENS)
    tiny_projector(tmp / "vision" / f"mmproj-{VISION}-F32.gguf")
    config = NodeConfig(
        server=ServerConfig(port=0), models=(str(vision), str(text_only)), data_dir=tmp,
        cluster=ClusterSettings(standalone=True),
        engine=EngineDefaults(max_model_len=1024, threads=2),
        pool=PoolSettings(queue=QueueLimits(parallel=2)),
        backends=BackendSettings(llama_server=llama_server_binary,
                                 assigned=((VISION, "llama-server"),
                                           (TEXT_ONLY, "llama-server"))))
    background = BackgroundNode(config, start_timeout_s=300)
    background.start()
    yield background.url
    background.stop()


def post(node: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(node + path, json=body, timeout=60)


def openai_chat(node: str, image: str | None, model: str = VISION,
                url: str | None = None) -> httpx.Response:
    content: list[dict] = [{"type": "text", "text": QUESTION}]
    if image is not None or url is not None:
        url = url or f"data:image/png;base64,{image}"
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return post(node, "/v1/chat/completions", {
        "model": model, **GREEDY, "messages": [{"role": "user", "content": content}]})


def responses_input(node: str, image: str | None, model: str = VISION) -> httpx.Response:
    content: list[dict] = [{"type": "input_text", "text": QUESTION}]
    if image is not None:
        content.insert(0, {"type": "input_image",
                           "image_url": f"data:image/png;base64,{image}"})
    return post(node, "/v1/responses", {"model": model, "temperature": 0,
                                        "max_output_tokens": 8,
                                        "input": [{"role": "user", "content": content}]})


def ollama_chat(node: str, image: str | None, model: str = VISION) -> httpx.Response:
    message = {"role": "user", "content": QUESTION}
    if image is not None:
        message["images"] = [image]
    return post(node, "/api/chat", {"model": model, "stream": False, "messages": [message],
                                    "options": {"temperature": 0, "num_predict": 8,
                                                "repeat_penalty": 1.0}})


def anthropic_message(node: str, image: str | None, model: str = VISION) -> httpx.Response:
    content: list[dict] = [{"type": "text", "text": QUESTION}]
    if image is not None:
        content.insert(0, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": image}})
    return post(node, "/v1/messages", {"model": model, **GREEDY,
                                       "messages": [{"role": "user", "content": content}]})


def openai_reply(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def responses_reply(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    text = "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    return text, body["usage"]["input_tokens"]


def ollama_reply(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["message"]["content"], body["prompt_eval_count"]


def anthropic_reply(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["usage"]  # prompt tokens read from llama-server's cache are counted apart
    return "".join(b["text"] for b in body["content"] if b["type"] == "text"), \
        usage["input_tokens"] + usage["cache_read_input_tokens"]


DIALECTS = [(openai_chat, openai_reply), (responses_input, responses_reply),
            (ollama_chat, ollama_reply), (anthropic_message, anthropic_reply)]


@pytest.mark.parametrize("ask,reply", DIALECTS,
                         ids=["openai", "responses", "ollama", "anthropic"])
def test_each_dialects_image_reaches_the_model(node, ask, reply):
    _, plain_tokens = reply(ask(node, None))
    red, red_tokens = reply(ask(node, RED))
    blue, blue_tokens = reply(ask(node, BLUE))
    # The projector's tokens (4 for a 32x32 image) and the markers around them.
    assert red_tokens == blue_tokens >= plain_tokens + 4
    assert red != blue  # the model saw the pixels, not just a placeholder
    assert reply(ask(node, RED))[0] == red  # greedy: the same image, the same reply


def test_the_same_image_gives_the_same_reply_in_every_dialect(node):
    replies = {ask.__name__: reply(ask(node, BLUE)) for ask, reply in DIALECTS}
    assert len(set(replies.values())) == 1, replies


def test_ollama_generate_takes_images_and_show_says_vision(node):
    def generate(images: list[str]) -> tuple[str, int]:
        response = post(node, "/api/generate", {
            "model": VISION, "prompt": QUESTION, "images": images, "stream": False,
            "options": {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}})
        assert response.status_code == 200, response.text
        return response.json()["response"], response.json()["prompt_eval_count"]

    (plain, plain_tokens), (red, red_tokens) = generate([]), generate([RED])
    assert red_tokens >= plain_tokens + 4 and red != plain
    shown = post(node, "/api/show", {"model": VISION}).json()
    assert "vision" in shown["capabilities"]


def test_a_model_without_a_projector_refuses_images_in_each_dialect(node):
    assert openai_reply(openai_chat(node, None, TEXT_ONLY))  # it serves text
    for ask, _ in DIALECTS:
        response = ask(node, RED, TEXT_ONLY)
        assert response.status_code == 400, response.text
        assert f"model '{TEXT_ONLY}' does not take images" in response.text
    assert "vision" not in post(node, "/api/show", {"model": TEXT_ONLY}).json()["capabilities"]


def test_bad_images_are_400_naming_the_field(node):
    remote = openai_chat(node, None, url="https://example.com/cat.png")
    assert remote.status_code == 400
    assert remote.json()["error"]["param"] == "messages.0.content.0.image_url.url"
    assert "only data URLs" in remote.json()["error"]["message"]
    corrupt = ollama_chat(node, "iVBORw0KGgo!!!")
    assert corrupt.status_code == 400
    assert "messages.0.images.0: the image is not valid base64" in corrupt.json()["error"]
    oversize = anthropic_message(node, base64.b64encode(b"\0" * (MAX_IMAGE_BYTES + 1)).decode())
    assert oversize.status_code == 400
    assert oversize.json()["error"]["type"] == "invalid_request_error"
    assert "larger than" in oversize.json()["error"]["message"]
    # A PNG's signature over bytes that are no image: llama-server's own refusal, a 400.
    broken = openai_chat(node, base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode())
    assert broken.status_code == 400, broken.text



def test_counting_tokens_counts_the_images(node):
    counted = post(node, "/v1/messages/count_tokens", {"model": VISION, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": RED}},
            {"type": "text", "text": QUESTION}]}]})
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == anthropic_reply(anthropic_message(node, RED))[1]
