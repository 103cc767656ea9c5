"""GET /v1/diagnostics/node and /cluster on a node with a fake runner: versions, the
configuration, memory, the runner's flight recorder and the node's recent errors; and
`shoal diagnose` writing them to a file."""

from __future__ import annotations

import json
import logging

import httpx


def test_node_diagnostics_describe_the_node_and_its_runners(fake_node):
    httpx.post(fake_node.url + "/v1/completions", timeout=30,
               json={"model": "fake-model", "prompt": "hello", "max_tokens": 2})
    logging.getLogger("shoal.test").error("something broke here")
    report = httpx.get(fake_node.url + "/v1/diagnostics/node", timeout=30).json()
    assert report["versions"]["shoal"] and report["versions"]["python"]
    assert set(report["cpu"]) >= {"model", "features", "missing", "logical_cores"}
    assert report["configuration"]["settings"]["server"]["api_keys"] == []
    assert report["memory"]["total_bytes"] >= report["memory"]["available_bytes"] > 0
    [runner] = [r for r in report["runners"] if r["model"] == "fake-model"]
    assert runner["state"] == "ready" and runner["pid"]
    stages = [s["stage"] for s in runner["flight"]["load"]]
    assert stages[0] == "starting" and stages[-1] == "ready"
    assert any(m["runner"].startswith("fake-model rank 0") for m in report["memory"]["runners"])
    messages = [e["message"] for e in report["recent_errors"]["errors"]]
    assert "something broke here" in messages


def test_cluster_diagnostics_hold_this_node(fake_node):
    report = httpx.get(fake_node.url + "/v1/diagnostics/cluster", timeout=30).json()
    assert list(report["nodes"]) == [report["asked_by"]] and report["unanswered"] == {}


def test_shoal_diagnose_writes_the_report_and_prints_its_path(fake_node, tmp_path,
                                                              capsys, monkeypatch):
    from shoal.cli.app import main

    monkeypatch.chdir(tmp_path)
    assert main(["diagnose", "--url", fake_node.url]) == 0
    [written] = list(tmp_path.glob("shoal-diagnostics-*.json"))
    assert capsys.readouterr().out.strip() == str(written.relative_to(tmp_path))
    assert json.loads(written.read_text())["node"]["node_id"]
    target = tmp_path / "cluster.json"
    assert main(["diagnose", "--cluster", "--url", fake_node.url, "-o", str(target)]) == 0
    assert "nodes" in json.loads(target.read_text())


def test_shoal_diagnose_says_when_no_node_answers(tmp_path, capsys):
    from shoal.cli.app import main

    assert main(["diagnose", "--url", "http://127.0.0.1:9", "-o", str(tmp_path / "x")]) == 1
    assert "no shoal node answers" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
