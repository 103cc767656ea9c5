"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium, driven by
playwright) against two real nodes on 127.0.0.1, one of them with an API key: the page asks
for the key, then shows both nodes and the master, streams a chat reply into the page piece by
piece, lists the instance the chat placed, and renders a non-blank screenshot."""

from __future__ import annotations

import io
import os

import httpx
import pytest
from PIL import Image
from playwright.sync_api import sync_playwright
from test_multinode import start_nodes, wait_for

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
# No sandbox (tests may run as root), no GPU, and nothing that would call out of the machine.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 900}
KEY = "sk-dashboard-browser-test"
UI_TIMEOUT_MS = 15_000
REPLY_TIMEOUT_MS = 120_000  # the model loads on first use, then answers

# Records the length of the reply's text at every change, to see it grow as it streams.
WATCH_REPLY = """() => {
  window.replyLengths = [];
  new MutationObserver(() => {
    const replies = document.querySelectorAll('.message.assistant');
    const last = replies[replies.length - 1];
    if (last) window.replyLengths.push(last.textContent.length);
  }).observe(document.getElementById('chat-log'),
             {childList: true, subtree: true, characterData: true});
}"""


def _formed(nodes) -> bool:
    """Both nodes see both nodes and the same master (node1 answers only with the key)."""
    views = []
    for node, headers in zip(nodes, ({"Authorization": f"Bearer {KEY}"}, {})):
        try:
            response = httpx.get(node.url + "/cluster", headers=headers, timeout=2)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        views.append(response.json())
    masters = {v["master_id"] for v in views}
    return all(len(v["nodes"]) == 2 for v in views) and len(masters) == 1 and None not in masters


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make install-test` installs Debian's chromium")
    nodes = start_nodes(tmp_path_factory.mktemp("dashboard"), 2,
                        extra={0: ["--api-key", KEY]})
    try:
        wait_for(lambda: _formed(nodes), 60, "a two-node cluster")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def browser_page():
    """A fresh page in headless Chromium, and the list its uncaught script errors go to."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            errors = []
            page.on("pageerror", lambda error: errors.append(error))
            yield page, errors
        finally:
            browser.close()


GPU_NODES = """async () => {
  const { renderNodes } = await import("/dashboard/cluster.js");
  const table = document.createElement("table");
  table.createTHead().insertRow().append(document.createElement("th"));
  table.append(document.createElement("tbody"));
  const gib = 2 ** 30;
  const node = (id, extra) => ({ node_id: id, memory_total: 8 * gib, memory_available: 4 * gib,
    memory_held: gib, memory_budget: 6 * gib, cpu_percent: 5, cpu_count: 2, queue_depth: 0,
    last_seen: Date.now() / 1000, ...extra });
  renderNodes(table, { node_id: "a", master_id: "a", nodes: [
    node("a", { gpus: [{ index: 0, name: "NVIDIA L4", memory_total: 24 * gib,
                         memory_available: 20 * gib }],
                device_budget: 20 * gib, device_held: 7.5 * gib }),
    node("b", { gpus: [{ index: 0, name: "NVIDIA T4", memory_total: 16 * gib,
                         memory_available: 16 * gib }], device_budget: null })] });
  return [...table.querySelectorAll("tr[data-node-id]")].map((row) => row.textContent);
}"""


def test_dashboard_shows_the_cluster_and_streams_a_chat_reply(two_nodes, browser_page):
    page, errors = browser_page
    node1 = two_nodes[0]
    page.goto(node1.url + "/", timeout=UI_TIMEOUT_MS)
    # node1 wants a key: the page loads without one and asks for it.
    page.wait_for_selector("#auth-prompt", state="visible", timeout=UI_TIMEOUT_MS)
    page.fill("#api-key", KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#auth-prompt", state="hidden", timeout=UI_TIMEOUT_MS)
    assert page.evaluate("localStorage.getItem('shoal.apiKey')") == KEY

    page.wait_for_function("document.querySelectorAll('#nodes tr[data-node-id]').length === 2",
                           timeout=UI_TIMEOUT_MS)
    names = page.eval_on_selector_all("#nodes .node-name", "cells => cells.map(c => c.textContent)")
    assert sorted(names) == ["node1", "node2"]
    assert page.locator("#nodes .badge.master").count() == 1

    page.wait_for_selector("#chat-model option[value='smollm2-135m-instruct']", state="attached",
                           timeout=UI_TIMEOUT_MS)
    page.select_option("#chat-model", "smollm2-135m-instruct")
    page.fill("#chat-max-tokens", "24")
    page.evaluate(WATCH_REPLY)
    page.fill("#chat-input", "Tell me a short story about a river.")
    page.click("#chat-send")
    page.wait_for_selector(".message.assistant[data-state=done], .message.assistant[data-state=error]",
                           timeout=REPLY_TIMEOUT_MS)
    reply = page.locator(".message.assistant")
    assert reply.get_attribute("data-state") == "done", reply.inner_text()
    text = reply.inner_text()
    lengths = page.evaluate("window.replyLengths")
    growing = sorted({n for n in lengths if 0 < n < len(text)})
    assert text.strip() and growing, (text, lengths)  # partial text showed before the end
    assert lengths == sorted(lengths)  # it only grew

    # The chat placed an instance: the next refreshes list it with its rank's layers.
    page.wait_for_function(
        "[...document.querySelectorAll('#instances tr[data-instance-id]')]"
        ".some(row => row.textContent.includes('smollm2') && row.textContent.includes('ready'))",
        timeout=UI_TIMEOUT_MS)
    assert "layers 0–30" in page.inner_text("#instances")
    assert "smollm2-135m-instruct" in page.inner_text("#models")
    assert errors == []

    # A node with a GPU that llama-server drives shows what models hold there; one whose
    # GPU no backend drives says so (rendered from a made-up answer: no GPU here).
    gpu_rows = page.evaluate(GPU_NODES)
    assert "GPU 7.5 GiB / 20.0 GiB (NVIDIA L4)" in gpu_rows[0]
    assert "GPU NVIDIA T4: no backend drives it" in gpu_rows[1]

    shot = Image.open(io.BytesIO(page.screenshot()))
    assert shot.format == "PNG" and shot.size == (VIEWPORT["width"], VIEWPORT["height"])
    colours = shot.convert("RGB").getcolors(maxcolors=4096)
    assert colours is None or len(colours) > 20  # text, tables and bars, not a blank page
