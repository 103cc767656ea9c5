"""Images in chat requests, every dialect, against shoal's engine (the fake node): each
bad image is the dialect's 400 naming its field, and a good one is refused by a model that
takes no images, never dropped. A model that takes them: test_llama_server_vision.py."""

from __future__ import annotations

import base64

import httpx
import pytest

from random_gguf import write_random_llama_gguf
from shoal.api.image_input import MAX_IMAGE_BYTES
from shoal.catalog.projector import projector_beside
from shoal.cluster.model_facts import model_facts_from_source
from shoal.engine.config import ModelSource
from shoal.protocol import ChatMessage, GenerationRequest, ImageInput
from shoal.runner.llama_server.launch import LaunchSettings, launch_command
from shoal.runner.llama_server.request_body import to_llama_server

# The first bytes of a PNG are what decides its type here; llama-server decodes the rest.
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 24
PNG_B64 = base64.b64encode(PNG).decode()
OVERSIZE_B64 = base64.b64encode(PNG + b"\0" * MAX_IMAGE_BYTES).decode()


def post(node, path, body):
    return httpx.post(node.url + path, json=body, timeout=20)


def _openai(url: str) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": url}}]}]}


def _responses(url: str) -> dict:
    return {"model": "fake-model", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": url}]}]}


def _ollama(image: str) -> dict:
    return {"model": "fake-model", "stream": False, "messages": [
        {"role": "user", "content": "what is this?", "images": [image]}]}


def _anthropic(source: dict) -> dict:
    return {"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": source}, {"type": "text", "text": "what is this?"}]}]}


def _base64_source(data: str) -> dict:
    return {"type": "base64", "media_type": "image/png", "data": data}


def _openai_error(response) -> tuple[str, str]:
    error = response.json()["error"]
    return error["param"], error["message"]


def _ollama_error(response) -> tuple[str, str]:
    return "", response.json()["error"]


def _anthropic_error(response) -> tuple[str, str]:
    body = response.json()
    assert body["error"]["type"] == "invalid_request_error"
    return "", body["error"]["message"]


URL_PARAM = "messages.0.content.1.image_url.url"
CASES = [
    ("/v1/chat/completions", _openai(f"data:image/png;base64,{PNG_B64}"), _openai_error,
     "does not take images"),
    ("/v1/chat/completions", _openai("https://example.com/cat.png"), _openai_error,
     f"{URL_PARAM}|only data URLs"),
    ("/v1/chat/completions", _openai("data:image/png;base64,@@not base64@@"), _openai_error,
     f"{URL_PARAM}|not valid base64"),
    ("/v1/chat/completions", _openai(f"data:image/png;base64,{OVERSIZE_B64}"), _openai_error,
     f"{URL_PARAM}|larger than"),
    ("/v1/chat/completions", _openai("data:image/png;base64,aGVsbG8="), _openai_error,
     f"{URL_PARAM}|not a PNG, JPEG, GIF or BMP"),
    ("/v1/responses", _responses(f"data:image/png;base64,{PNG_B64}"), _openai_error,
     "does not take images"),
    ("/v1/responses", _responses("https://example.com/cat.png"), _openai_error,
     "input.0.content.1.image_url|only data URLs"),
    ("/api/chat", _ollama(PNG_B64), _ollama_error, "does not take images"),
    ("/api/chat", _ollama("@@not base64@@"), _ollama_error,
     "messages.0.images.0: the image is not valid base64"),
    ("/api/chat", _ollama(OVERSIZE_B64), _ollama_error, "messages.0.images.0: the image is "
                                                        "larger than"),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "images": [PNG_B64],
                       "stream": False}, _ollama_error, "does not take images"),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "images": [PNG_B64], "raw": True,
                       "stream": False}, _ollama_error, "images need the model's "
                                                        "chat template"),
    ("/v1/messages", _anthropic(_base64_source(PNG_B64)), _anthropic_error,
     "does not take images"),
    ("/v1/messages", _anthropic({"type": "url", "url": "https://example.com/cat.png"}),
     _anthropic_error, "messages.0.content.0.source: only base64 image sources"),
    ("/v1/messages", _anthropic(_base64_source("@@")), _anthropic_error,
     "messages.0.content.0.source.data: the image is not valid base64"),
    ("/v1/messages", _anthropic(_base64_source(OVERSIZE_B64)), _anthropic_error,
     "messages.0.content.0.source.data: the image is larger than"),
]


@pytest.mark.parametrize("path,body,error_of,expected", CASES)
def test_images_are_checked_and_never_dropped(fake_node, path, body, error_of, expected):
    response = post(fake_node, path, body)
    assert response.status_code == 400, response.text
    param, message = error_of(response)
    if "|" in expected:
        expected_param, expected = expected.split("|")
        assert param == expected_param
    assert expected in message
    if expected == "does not take images":
        assert "'fake-model'" in message


def test_llama_server_gets_images_as_data_url_parts():
    image = ImageInput(media_type="image/png", data=PNG)
    request = GenerationRequest(request_id="r", model="m", messages=(
        ChatMessage(role="user", content="look", images=(image,)),))
    content = to_llama_server(request).body["messages"][0]["content"]
    assert content == [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}},
        {"type": "text", "text": "look"}]


def test_a_projector_beside_the_model_is_passed_and_counted(tmp_path):
    model = tmp_path / "tiny-Q8_0.gguf"
    write_random_llama_gguf(model, hidden=64, layers=1, ffn=128, heads=4)
    source = ModelSource(model_id="tiny", format="gguf", path=model)
    alone = model_facts_from_source(source).weight_bytes
    assert projector_beside(model) is None
    (tmp_path / "mmproj-tiny-F32.gguf").write_bytes(b"\0" * 2000)
    (tmp_path / "mmproj-tiny-F16.gguf").write_bytes(b"\0" * 1000)
    projector = projector_beside(model)
    assert projector == tmp_path / "mmproj-tiny-F16.gguf"
    assert model_facts_from_source(source).weight_bytes == alone + 1000  # placement holds it
    command = launch_command(LaunchSettings(binary=tmp_path / "llama-server"), "m", model,
                             8080, projector)
    assert command[command.index("--mmproj") + 1] == str(projector)
    assert "--mmproj" not in launch_command(LaunchSettings(binary=tmp_path / "x"), "m",
                                            model, 8080)
