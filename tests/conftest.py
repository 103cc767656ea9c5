"""Shared by every test directory: tests/ is on sys.path (fakes.py, serve_process.py).

No test reaches a model hub: pulls go to a closed port on 127.0.0.1 unless a test points
them at its own server (tests/catalog/hub_servers.py). Set here, before any test runs, so
node subprocesses inherit it too."""

import os
import socket

import pytest


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_NOWHERE = f"http://127.0.0.1:{_closed_port()}"
os.environ["HF_ENDPOINT"] = _NOWHERE
os.environ["SHOAL_OLLAMA_REGISTRY"] = _NOWHERE


@pytest.fixture(scope="session")
def llama_server_binary():
    """llama.cpp's llama-server as tests/llama_server_build.py built it for this CPU (the
    Makefile's test install step). Missing under CI=true is a failure: the build step was
    meant to run; elsewhere the test is skipped, saying how to build it."""
    from llama_server_build import cached_binary

    binary = cached_binary()
    if binary is None:
        how = "run `python tests/llama_server_build.py` (make test's install step does)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"llama-server was not built for the tests: {how}")
        pytest.skip(f"llama-server is not built here: {how}")
    return binary


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run where this machine has an NVIDIA GPU (NVML sees one), and are
    skipped elsewhere (CI has none)."""
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if not gpu_tests:
        return
    from shoal.cluster.telemetry import gpu_readings

    if gpu_readings():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none found here)")
    for item in gpu_tests:
        item.add_marker(skip)
