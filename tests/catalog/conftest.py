import os
import sys

import pytest

# tests/ holds hub_servers.py (shared with the API tests).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hub_servers import HubServer


@pytest.fixture(scope="module")
def hub():
    """Hugging Face's file API and Ollama's registry, on 127.0.0.1 in this process."""
    server = HubServer()
    yield server
    server.close()


@pytest.fixture
def hub_env(hub, monkeypatch, tmp_path):
    """Pulls in this test go to hub only, with no token and no shared caches."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("SHOAL_OLLAMA_REGISTRY", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    hub.log.clear()
    return hub
