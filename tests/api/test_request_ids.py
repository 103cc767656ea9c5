"""x-request-id on every response (the id the body reports, when there is one) and
POST /v1/requests/{id}/cancel."""

from __future__ import annotations

import pytest
from fakes import ScriptedRouter
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.api.auth import ApiKeys

HI = [{"role": "user", "content": "hi"}]
WITH_ID = {
    "/v1/chat/completions": {"model": "m", "messages": HI},
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/responses": {"model": "m", "input": "hi"},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": HI},
}


class CancellingRouter(ScriptedRouter):
    """Knows one request in flight, "chatcmpl-live"."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> bool:
        if request_id != "chatcmpl-live":
            return False
        self.cancelled.append(request_id)
        return True


@pytest.fixture(scope="module")
def app_router():
    router = CancellingRouter()
    return router, TestClient(create_app(router, list_available=list))


@pytest.mark.parametrize("path", WITH_ID)
def test_the_header_carries_the_id_the_body_reports(app_router, path):
    router, client = app_router
    response = client.post(path, json=WITH_ID[path])
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == response.json()["id"]
    assert response.headers["x-request-id"] == router.requests[-1].request_id


def test_streams_and_ollama_routes_carry_the_internal_id(app_router):
    router, client = app_router
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": "m", "messages": HI, "stream": True}) as response:
        header = response.headers["x-request-id"]
        text = "".join(response.iter_text())
    assert header == router.requests[-1].request_id and header in text
    ollama = client.post("/api/generate", json={"model": "m", "prompt": "hi",
                                                "stream": False})
    assert ollama.headers["x-request-id"] == router.requests[-1].request_id


def test_responses_without_a_generation_get_a_fresh_id(app_router):
    _, client = app_router
    first = client.get("/v1/models").headers["x-request-id"]
    second = client.get("/v1/models").headers["x-request-id"]
    assert first.startswith("req-") and first != second
    refused = TestClient(create_app(ScriptedRouter(), list_available=list,
                                    api_keys=ApiKeys(["k"]))).get("/v1/models")
    assert refused.status_code == 401 and refused.headers["x-request-id"].startswith("req-")


def test_cancel_ends_a_request_in_flight_and_404s_an_unknown_one(app_router):
    router, client = app_router
    done = client.post("/v1/requests/chatcmpl-live/cancel")
    assert done.status_code == 200
    assert done.json() == {"id": "chatcmpl-live", "object": "request.cancellation",
                           "cancelled": True}
    assert router.cancelled == ["chatcmpl-live"]
    unknown = client.post("/v1/requests/chatcmpl-gone/cancel")
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "request_not_found" and "chatcmpl-gone" in error["message"]
