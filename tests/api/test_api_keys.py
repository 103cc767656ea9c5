"""API keys: with keys set, every API route wants one (Bearer or x-api-key) and answers a
missing or wrong key with 401 in its own dialect; /health and / stay open; keys never show."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import ScriptedRouter
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.api.auth import ApiKeys, presented_key, read_keys_file
from shoal.config import build_node_config

KEY = "sk-shoal-test-0123456789"
HI = [{"role": "user", "content": "hi"}]
POSTS = {
    "/v1/chat/completions": {"model": "m", "messages": HI},
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/responses": {"model": "m", "input": "hi"},
    "/api/chat": {"model": "m", "messages": HI, "stream": False},
    "/api/generate": {"model": "m", "prompt": "hi", "stream": False},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": HI},
}
GETS = ("/v1/models", "/api/tags", "/api/ps", "/api/version")


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(ScriptedRouter(), list_available=list,
                                 api_keys=ApiKeys([KEY, "second-key"])))


def unauthorized_message(path: str, response) -> str:
    """The 401's message, checking the body has the shape path's dialect uses."""
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    body = response.json()
    if path.startswith("/api/"):
        return body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        return body["error"]["message"]
    assert body["error"]["code"] == "invalid_api_key"
    return body["error"]["message"]


@pytest.mark.parametrize("path", POSTS)
def test_each_dialect_refuses_a_missing_or_wrong_key_and_serves_a_good_one(client, path):
    missing = client.post(path, json=POSTS[path])
    assert "requires an API key" in unauthorized_message(path, missing)
    wrong = client.post(path, json=POSTS[path], headers={"Authorization": "Bearer nope"})
    message = unauthorized_message(path, wrong)
    assert "not valid" in message and "nope" not in message
    good = client.post(path, json=POSTS[path], headers={"Authorization": f"Bearer {KEY}"})
    assert good.status_code == 200, good.text
    other = client.post(path, json=POSTS[path], headers={"x-api-key": "second-key"})
    assert other.status_code == 200, other.text


@pytest.mark.parametrize("path", GETS)
def test_listing_routes_want_a_key_too(client, path):
    assert client.get(path).status_code == 401
    assert client.get(path, headers={"x-api-key": KEY}).status_code == 200


def test_health_and_the_root_stay_open(client):
    assert client.get("/health").status_code == 200
    assert client.get("/").status_code == 200


def test_an_app_without_keys_is_open():
    open_client = TestClient(create_app(ScriptedRouter(), list_available=list))
    assert open_client.get("/v1/models").status_code == 200


def test_the_key_is_taken_from_bearer_then_x_api_key():
    assert presented_key({"authorization": "Bearer abc"}) == "abc"
    assert presented_key({"authorization": "bearer  abc "}) == "abc"
    assert presented_key({"authorization": "Basic abc", "x-api-key": "k"}) == "k"
    assert presented_key({}) is None
    keys = ApiKeys(["abc"])
    assert keys.allows("abc") and not keys.allows("abd") and not keys.allows(None)
    assert "abc" not in repr(keys)
    with pytest.raises(ValueError):
        ApiKeys([" "])


def test_keys_come_from_flags_the_environment_and_a_file(tmp_path: Path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nfirst-key\n\n  second-key  \n")
    assert read_keys_file(keys_file) == ("first-key", "second-key")
    config = build_node_config(api_keys=["flag-key"], api_keys_file=str(keys_file), env={})
    assert config.server.api_keys == ("flag-key", "first-key", "second-key")
    assert "flag-key" not in repr(config)
    from_env = build_node_config(env={"SHOAL_API_KEY": "env-key"})
    assert from_env.server.api_keys == ("env-key",)
    assert build_node_config(env={}).server.api_keys == ()


def test_an_unreadable_or_empty_keys_file_is_an_error_naming_it(tmp_path: Path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="cannot read the API keys file .*missing"):
        build_node_config(api_keys_file=str(missing), env={})
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no keys"):
        read_keys_file(empty)
