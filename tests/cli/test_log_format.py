"""--log-format json: every line `shoal serve` and its runners write to stderr is one JSON
object; a bad format is refused."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from serve_process import start_serve

from shoal import logs


def test_the_json_formatter_writes_one_object_per_record():
    formatter = logs.JsonFormatter("node")
    record = logging.LogRecord("shoal.x", logging.WARNING, __file__, 1, "disk %s full",
                               ("/data",), None)
    entry = json.loads(formatter.format(record))
    assert entry["message"] == "disk /data full" and entry["level"] == "WARNING"
    assert entry["logger"] == "shoal.x" and entry["role"] == "node" and "time" in entry


def test_a_bad_format_is_refused(monkeypatch):
    monkeypatch.setenv("SHOAL_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="text or json"):
        logs.log_format()
    assert logs.log_format("json") == "json"


@pytest.mark.slow
def test_a_node_and_its_runner_log_json_lines(tmp_path):
    node = start_serve(["--standalone", "--model", "smollm2", "--threads", "2",
                        "--log-format", "json"], tmp_path / "node")
    try:
        answer = httpx.post(node.url + "/v1/completions", timeout=60,
                            json={"model": "smollm2", "prompt": "hi", "max_tokens": 2})
    finally:
        node.stop()
    assert answer.status_code == 200
    lines = [line for line in node.log_tail(1_000_000).splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # each line parses
    roles = {entry["role"] for entry in entries}
    assert roles == {"node", "runner"}
    assert any("shoal is serving on" in entry["message"] for entry in entries)
