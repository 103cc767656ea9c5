"""x_priority / x_client_id (or the X-Shoal-Priority / X-Shoal-Client headers) and the
keep_alive extension reach the internal request on every dialect, and bad values are a 400 in
the route's own error shape."""

from __future__ import annotations

import pytest
from fakes import ScriptedRouter
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.protocol import EmbeddingResult

HI = [{"role": "user", "content": "hi"}]
GENERATION = {
    "openai-chat": ("/v1/chat/completions", {"model": "m", "messages": HI}),
    "openai-completions": ("/v1/completions", {"model": "m", "prompt": "hi"}),
    "openai-responses": ("/v1/responses", {"model": "m", "input": "hi"}),
    "ollama-chat": ("/api/chat", {"model": "m", "messages": HI, "stream": False}),
    "ollama-generate": ("/api/generate", {"model": "m", "prompt": "hi", "stream": False}),
    "anthropic-messages": ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": HI}),
    "anthropic-count-tokens": ("/v1/messages/count_tokens", {"model": "m", "messages": HI}),
}
EMBEDDING = {
    "openai-embeddings": ("/v1/embeddings", {"model": "m", "input": "hi"}),
    "ollama-embed": ("/api/embed", {"model": "m", "input": "hi"}),
    "ollama-embeddings": ("/api/embeddings", {"model": "m", "prompt": "hi"}),
}
ROUTES = {**GENERATION, **EMBEDDING}
KEEP_ALIVE_ROUTES = ("openai-chat", "openai-completions", "openai-responses",
                     "openai-embeddings", "anthropic-messages")


class RecordingRouter(ScriptedRouter):
    """A ScriptedRouter that also answers embeddings, recording each EmbeddingRequest."""

    async def embed(self, request):
        self.requests.append(request)
        vectors = tuple((0.5, 0.5) for _ in range(request.num_inputs))
        return EmbeddingResult(request_id=request.request_id, embeddings=vectors,
                               prompt_tokens=1)


@pytest.fixture(scope="module")
def recorded():
    router = RecordingRouter()
    return router, TestClient(create_app(router, list_available=list))


def internal_request(recorded, route, extra=None, headers=None):
    router, client = recorded
    path, body = ROUTES[route]
    response = client.post(path, json={**body, **(extra or {})}, headers=headers)
    assert response.status_code == 200, response.text
    return router.requests[-1]


def error_message(path: str, body: dict) -> str:
    """The message of an error body in the dialect path speaks."""
    if path.startswith("/api/"):
        return body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def refused(recorded, route, extra=None, headers=None) -> str:
    router, client = recorded
    path, body = ROUTES[route]
    seen = len(router.requests)
    response = client.post(path, json={**body, **(extra or {})}, headers=headers)
    assert response.status_code == 400, response.text
    assert len(router.requests) == seen  # nothing reached the router
    return error_message(path, response.json())


@pytest.mark.parametrize("route", ROUTES)
def test_body_fields_arrive(recorded, route):
    internal = internal_request(recorded, route, {"x_priority": 0, "x_client_id": "team-a"})
    assert (internal.priority, internal.client_id) == (0, "team-a")


@pytest.mark.parametrize("route", ROUTES)
def test_headers_when_the_body_has_none(recorded, route):
    internal = internal_request(recorded, route,
                                headers={"X-Shoal-Priority": "9", "X-Shoal-Client": "batch"})
    assert (internal.priority, internal.client_id) == (9, "batch")


@pytest.mark.parametrize("route", ROUTES)
def test_body_wins_over_header(recorded, route):
    internal = internal_request(recorded, route, {"x_priority": 1, "x_client_id": "body"},
                                headers={"X-Shoal-Priority": "8", "X-Shoal-Client": "header"})
    assert (internal.priority, internal.client_id) == (1, "body")


@pytest.mark.parametrize("route", ROUTES)
def test_defaults(recorded, route):
    internal = internal_request(recorded, route)
    assert (internal.priority, internal.client_id) == (5, None)


@pytest.mark.parametrize("value", [10, -1, "3", 2.5, True])
@pytest.mark.parametrize("route", ROUTES)
def test_bad_x_priority_is_400(recorded, route, value):
    message = refused(recorded, route, {"x_priority": value})
    assert "x_priority" in message and "0" in message and "9" in message


@pytest.mark.parametrize("value", ["high", "10", "-1", "2.5"])
@pytest.mark.parametrize("route", ["openai-chat", "ollama-generate", "anthropic-messages",
                                   "ollama-embed"])
def test_bad_priority_header_is_400(recorded, route, value):
    assert "X-Shoal-Priority" in refused(recorded, route, headers={"X-Shoal-Priority": value})


@pytest.mark.parametrize("value", ["", "c" * 129, 7])
@pytest.mark.parametrize("route", ["openai-completions", "ollama-chat", "anthropic-messages",
                                   "openai-embeddings"])
def test_bad_x_client_id_is_400(recorded, route, value):
    assert "x_client_id" in refused(recorded, route, {"x_client_id": value})


@pytest.mark.parametrize(("raw", "seconds"), [("5m", 300.0), (0, 0.0), (-1, -1.0),
                                              (None, None)])
@pytest.mark.parametrize("route", KEEP_ALIVE_ROUTES)
def test_keep_alive_extension(recorded, route, raw, seconds):
    assert internal_request(recorded, route, {"keep_alive": raw}).keep_alive_s == seconds


@pytest.mark.parametrize("route", KEEP_ALIVE_ROUTES)
def test_bad_keep_alive_is_400(recorded, route):
    assert "keep_alive" in refused(recorded, route, {"keep_alive": "soon"})


def _overloaded(request):
    from shoal.protocol import ErrorChunk

    return [ErrorChunk(request_id=request.request_id, code="overloaded", retry_after_s=7,
                       message="this node's queue is full: 3 request(s) waiting (--max-queue 3)")]


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
     429),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "stream": False}, 503),
    ("/v1/messages", {"model": "m", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hi"}]}, 529),
])
def test_a_full_queue_is_each_dialect_s_overload_answer_with_retry_after(path, body, status):
    from fastapi.testclient import TestClient

    from shoal.api.app import create_app

    client = TestClient(create_app(ScriptedRouter(_overloaded), list_available=list))
    refused = client.post(path, json=body)
    assert refused.status_code == status
    assert refused.headers["Retry-After"] == "7"
    assert "--max-queue 3" in refused.text


@pytest.mark.parametrize("route", GENERATION)
@pytest.mark.parametrize("choice", ["off", "ngram", "draft"])
def test_speculation_choice_reaches_the_engine(recorded, route, choice):
    internal = internal_request(recorded, route, {"x_speculative": choice})
    assert internal.sampling.speculative == choice


@pytest.mark.parametrize("route", GENERATION)
def test_without_a_choice_the_model_decides(recorded, route):
    assert internal_request(recorded, route).sampling.speculative is None


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("bad", ["medusa", "", 1, True, ["ngram"]])
def test_a_bad_speculation_choice_is_refused_naming_the_field(recorded, route, bad):
    message = refused(recorded, route, {"x_speculative": bad})
    assert "x_speculative" in message and '"ngram"' in message


@pytest.mark.parametrize("route", GENERATION)
def test_a_session_id_reaches_the_router(recorded, route):
    assert internal_request(recorded, route, {"x_session_id": "chat-42"}).session_id == "chat-42"
    assert internal_request(recorded, route).session_id is None


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("bad", ["", "x" * 257, 7, True, ["chat"], {"id": "chat"}])
def test_a_bad_session_id_is_refused_naming_the_field(recorded, route, bad):
    message = refused(recorded, route, {"x_session_id": bad})
    assert "x_session_id" in message and "256 characters" in message
