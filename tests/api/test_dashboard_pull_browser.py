"""The dashboard's pull form in a real headless Chromium (Debian's /usr/bin/chromium, driven
by playwright) against a node on 127.0.0.1 whose pulls go to a registry in this process: the
pull shows under Loading while its bytes arrive, the form says when the model is on disk,
and a bad name is said in the node's words."""

from __future__ import annotations

import os

import pytest
from fakes import fake_engine_config, fake_supervisor_options
from hub_servers import HubServer
from playwright.sync_api import sync_playwright

from shoal.catalog.pull.settings import PullSettings
from shoal.config import ClusterSettings, NodeConfig, ServerConfig
from shoal.node import BackgroundNode
from shoal.runner.supervisor import RunnerSupervisor

pytestmark = pytest.mark.slow  # a browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make install-test` installs Debian's chromium")
    tmp = tmp_path_factory.mktemp("dashboard-pull")
    hub = HubServer()
    hub.add_ollama_model("tiny", "latest", {"model": b"GGUF" + b"\7" * (4 * MIB)})
    hub.delay_s = 0.3  # ~5 s in all: the page's 2 s refresh sees the pull under way
    options = fake_supervisor_options()
    config = NodeConfig(server=ServerConfig(port=0), preload=False, data_dir=tmp / "data",
                        cluster=ClusterSettings(standalone=True),
                        pull=PullSettings(ollama_registry=hub.url))
    background = BackgroundNode(config, make_supervisor=lambda source, _parallel:
                                RunnerSupervisor(fake_engine_config(tmp, source.model_id),
                                                 options))
    background.start()
    yield background
    background.stop()
    hub.close()


def test_the_pull_form_pulls_and_the_loading_panel_shows_it(node):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda error: errors.append(error))
            page.goto(node.url + "/")
            page.fill("#pull-model", "tiny")
            page.click("#pull-form button[type=submit]")
            page.wait_for_selector("#loads li:has-text('tiny pulling') progress",
                                   timeout=15_000)
            page.wait_for_function("document.getElementById('pull-status').textContent"
                                   " === 'tiny is on disk'", timeout=30_000)
            page.fill("#pull-model", "not a name")
            page.click("#pull-form button[type=submit]")
            page.wait_for_function("document.getElementById('pull-status').textContent"
                                   ".includes('not a model name shoal can pull')",
                                   timeout=15_000)
            assert errors == []
        finally:
            browser.close()
