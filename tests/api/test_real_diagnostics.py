"""A real `shoal serve --standalone --api-key KEY` with SmolLM2: its node diagnosis holds the
runner's load stages and engine steps, and never the key; `shoal diagnose` (with the key in
SHOAL_API_KEY) writes it to a file and prints the path (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.slow

KEY = "sk-diagnose-me-0451"
SECRET = "cluster-secret-9931"


def test_a_node_diagnosis_holds_runner_phases_and_no_secret(tmp_path):
    node = start_serve(["--standalone", "--model", "smollm2", "--threads", "2",
                        "--kv-cache-memory", "128MiB", "--api-key", KEY,
                        "--cluster-secret", SECRET], tmp_path / "node")
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        reply = httpx.post(node.url + "/v1/completions", headers=auth, timeout=120, json={
            "model": "smollm2", "prompt": "The sea is", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        refused = httpx.get(node.url + "/v1/diagnostics/node", timeout=30)
        response = httpx.get(node.url + "/v1/diagnostics/node", headers=auth, timeout=30)
        port = node.url.rsplit(":", 1)[1]
        output = tmp_path / "report.json"
        written = subprocess.run(
            [sys.executable, "-m", "shoal.cli.app", "diagnose", "--output", str(output)],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "SHOAL_API_KEY": KEY, "SHOAL_PORT": port})
    finally:
        node.stop()
    assert refused.status_code == 401
    assert response.status_code == 200, response.text
    text = response.text
    assert KEY not in text and SECRET not in text
    report = json.loads(text)
    assert report["configuration"]["settings"]["server"]["api_keys"] == "[redacted]"
    assert report["configuration"]["settings"]["cluster"]["secret"] == "[redacted]"
    [runner] = report["runners"]
    stages = [s["stage"] for s in runner["flight"]["load"]]
    assert stages[0] == "starting" and "weights" in stages and stages[-1] == "ready"
    steps = [p for p in runner["flight"]["phases"] if p["phase"] == "step"]
    assert len(steps) >= 5 and all(s["seconds"] > 0 and s["requests"] >= 1 for s in steps)
    assert any(p["phase"] == "load" for p in runner["flight"]["phases"])
    assert report["memory"]["runners"][0]["rss_bytes"] > 0
    assert report["versions"]["torch"] and report["versions"]["zenoh"]

    assert written.returncode == 0, written.stderr
    assert written.stdout.strip() == str(output)
    saved = output.read_text()
    assert KEY not in saved and SECRET not in saved
    assert json.loads(saved)["runners"][0]["model"] == "smollm2-135m-instruct"
