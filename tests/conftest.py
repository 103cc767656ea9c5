"""Shared by every test directory: tests/ is on sys.path (fakes.py, serve_process.py).

No test reaches a model hub: pulls go to a closed port on 127.0.0.1 unless a test points
them at its own server (tests/catalog/hub_servers.py). Set here, before any test runs, so
node subprocesses inherit it too."""

import os
import socket


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_NOWHERE = f"http://127.0.0.1:{_closed_port()}"
os.environ["HF_ENDPOINT"] = _NOWHERE
os.environ["SHOAL_OLLAMA_REGISTRY"] = _NOWHERE
