"""Run by test_data_dir_faults.py inside a user and mount namespace (tests/namespaces.py):
a node whose data dir is a read-only tmpfs, and one on a full tmpfs, warn in /health and
go on serving."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fakes import fake_engine_config, fake_supervisor_options  # noqa: E402
from namespaces import mount_tmpfs, remount_read_only, require_namespace  # noqa: E402

from shoal.catalog.resolve import ModelNotFound  # noqa: E402
from shoal.config import ClusterSettings, NodeConfig, ServerConfig  # noqa: E402
from shoal.diagnostics.data_dir import check_data_dir  # noqa: E402
from shoal.node import BackgroundNode  # noqa: E402
from shoal.runner.supervisor import RunnerSupervisor  # noqa: E402

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4}


def serve(models: Path, data_dir: Path) -> BackgroundNode:
    """A standalone node serving the fake engine, its data dir at data_dir."""
    source = fake_engine_config(models).source

    def resolve(name: str):
        if name != "fake-model":
            raise ModelNotFound(f"model {name!r} not found")
        return source

    options = fake_supervisor_options()
    node = BackgroundNode(
        NodeConfig(server=ServerConfig(port=0), models=("fake-model",), data_dir=data_dir,
                   cluster=ClusterSettings(standalone=True)),
        make_supervisor=lambda source, _parallel: RunnerSupervisor(
            fake_engine_config(models, source.model_id), options),
        resolve=resolve, list_available=list)
    node.start()
    return node


def dashboard_warnings(url: str) -> list[str]:
    """The warnings the dashboard shows, read in headless Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = browser.new_page()
            page.goto(url + "/", wait_until="domcontentloaded")
            page.wait_for_selector("#warnings li", timeout=15_000)
            return page.locator("#warnings li").all_inner_texts()
        finally:
            browser.close()


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_node_warns_of_its_data_dir_in_health_and_goes_on_serving(tmp_path, fault):
    require_namespace()
    models, data_dir = tmp_path / "models", tmp_path / "data"
    models.mkdir()
    mount_tmpfs(data_dir, "512k")
    if fault == "read-only":
        remount_read_only(data_dir)
    else:
        with open(data_dir / "filler", "wb") as filler:
            with pytest.raises(OSError):
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
    expected = "read-only disk" if fault == "read-only" else "full"
    assert expected in check_data_dir(data_dir)
    node = serve(models, data_dir)
    try:
        health = httpx.get(node.url + "/health", timeout=10).json()
        reply = httpx.post(node.url + "/v1/chat/completions", json=CHAT, timeout=30)
        shown = dashboard_warnings(node.url) if fault == "read-only" else health["warnings"]
    finally:
        node.stop()
    assert health["status"] == "ok"
    assert len(health["warnings"]) == 1 and expected in health["warnings"][0]
    assert "serving goes on" in health["warnings"][0]
    assert shown == health["warnings"]  # the dashboard shows it too
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]


def test_a_healthy_data_dir_has_no_warning(tmp_path):
    require_namespace()
    mount_tmpfs(tmp_path / "data", "1m")
    assert check_data_dir(tmp_path / "data", min_free_bytes=0) is None
    assert "nearly full" in check_data_dir(tmp_path / "data", min_free_bytes=2**21)
