"""The dashboard's serving: GET / gives browsers the page and every other client Ollama's
liveness text; the page's files come from package data with their content types and stay
open when the node has API keys (the data routes the page reads do not); the routes the page
reads carry what it shows (load progress on /health, CPU load on /cluster)."""

from __future__ import annotations

import re
from importlib import resources

import httpx
import pytest
from fakes import ScriptedRouter
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.api.auth import ApiKeys
from shoal.api.dashboard.routes import ASSETS, wants_html

KEY = "sk-dashboard-test"
# What Chromium and Firefox send for a page load.
BROWSER_ACCEPT = ("text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,"
                  "image/webp,*/*;q=0.8")


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(ScriptedRouter(), list_available=list,
                                 api_keys=ApiKeys([KEY])))


@pytest.mark.parametrize("accept,html", [
    (BROWSER_ACCEPT, True),
    ("text/html", True),
    ("TEXT/HTML; q=0.5", True),
    ("", False),
    ("*/*", False),
    ("application/json", False),
    ("text/html;q=0, */*", False),
    ("text/htmlx", False),
])
def test_wants_html_reads_the_accept_header(accept, html):
    assert wants_html(accept) is html


def test_browsers_get_the_page_and_other_clients_the_ollama_answer_without_a_key(client):
    page = client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert '<script type="module" src="/dashboard/dashboard.js">' in page.text
    assert page.headers["vary"] == "Accept"
    for accept in ("*/*", "application/json"):
        plain = client.get("/", headers={"Accept": accept})
        assert plain.status_code == 200 and plain.text == "Ollama is running"
        assert plain.headers["content-type"].startswith("text/plain")
    assert client.head("/", headers={"Accept": BROWSER_ACCEPT}).status_code == 200
    assert client.head("/").status_code == 200


@pytest.mark.parametrize("name", sorted(ASSETS))
def test_each_file_of_the_page_is_served_open_with_its_content_type(client, name):
    response = client.get(f"/dashboard/{name}")  # no key: the page must load to ask for one
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == ASSETS[name]
    assert response.headers["cache-control"] == "no-cache"
    assert response.content == resources.files("shoal.api.dashboard").joinpath(name).read_bytes()


def test_every_file_the_page_refers_to_is_listed_and_every_listed_file_exists():
    package = resources.files("shoal.api.dashboard")
    shipped = {p.name for p in package.iterdir() if p.name.endswith((".html", ".css", ".js"))}
    assert shipped == set(ASSETS)
    referred = set(re.findall(r'"/dashboard/([^"]+)"', package.joinpath("index.html").read_text()))
    for name in ASSETS:
        if name.endswith(".js"):
            referred |= set(re.findall(r'from "\./([^"]+)"', package.joinpath(name).read_text()))
    assert referred and referred <= set(ASSETS)


def test_unknown_files_are_404_and_data_routes_still_want_the_key(client):
    for path in ("/dashboard/nope.js", "/dashboard/routes.py", "/dashboard/__init__.py"):
        assert client.get(path).status_code == 404, path
    assert client.get("/dashboard/../v1/models").status_code in (401, 404)
    for path in ("/v1/models", "/api/ps", "/metrics"):
        assert client.get(path).status_code == 401, path
        authorized = client.get(path, headers={"Authorization": f"Bearer {KEY}"})
        assert authorized.status_code == 200, path


def test_health_reports_load_progress_and_cluster_reports_cpu_load(fake_node):
    model = httpx.get(fake_node.url + "/health", timeout=10).json()["models"][0]
    assert model["state"] == "ready"
    assert model["load"] == {"stage": "ready", "progress": 1.0}
    node = httpx.get(fake_node.url + "/cluster", timeout=10).json()["nodes"][0]
    assert node["cpu_count"] >= 1 and 0.0 <= node["cpu_percent"] <= 100.0 * node["cpu_count"]
