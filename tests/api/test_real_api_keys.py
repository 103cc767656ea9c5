"""`shoal serve` with API keys, as a real process: 401 without the key, served with it, the
key never in the log; an unreadable keys file stops it at start; an open non-loopback
address is warned about."""

from __future__ import annotations

import httpx
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.slow

KEY = "sk-real-node-key-42"


def test_a_node_with_a_key_refuses_requests_without_it(tmp_path):
    node = start_serve(["--standalone", "--no-preload", "--api-key", KEY], tmp_path / "node")
    try:
        refused = httpx.get(node.url + "/v1/models", timeout=10)
        allowed = httpx.get(node.url + "/v1/models", timeout=10,
                            headers={"Authorization": f"Bearer {KEY}"})
        anthropic = httpx.post(node.url + "/v1/messages", timeout=10, json={})
        health = httpx.get(node.url + "/health", timeout=10)
    finally:
        node.stop()
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert allowed.status_code == 200
    assert anthropic.status_code == 401
    assert anthropic.json()["error"]["type"] == "authentication_error"
    assert health.status_code == 200
    assert KEY not in node.log_tail(100_000)


def test_an_unreadable_keys_file_stops_the_node_at_start(tmp_path):
    missing = tmp_path / "no-such-keys"
    node = start_serve(["--standalone", "--no-preload", "--api-keys-file", str(missing)],
                       tmp_path / "node", wait_healthy=False)
    code = node.proc.wait(60)
    assert code != 0
    log = node.log_tail()
    assert "cannot read the API keys file" in log and "no-such-keys" in log


def test_serving_every_address_without_a_key_warns(tmp_path):
    node = start_serve(["--standalone", "--no-preload", "--host", "0.0.0.0"],
                       tmp_path / "node")
    try:
        answered = httpx.get(node.url + "/v1/models", timeout=10).status_code
    finally:
        node.stop()
    assert answered == 200
    assert "with no API key" in node.log_tail()
