"""A real `shoal serve` subprocess with SmolLM2, driven over HTTP (slow)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    node = start_serve(["--standalone", "--model", "smollm2", "--threads", "2",
                        "--kv-cache-memory", "256MiB"], tmp_path_factory.mktemp("shoal-data"))
    yield node.url
    assert node.stop() == 0, node.log_tail()


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 12, "temperature": 0}


def _health(url) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def test_non_streaming_and_streaming_agree_greedily(server):
    first = httpx.post(server + "/v1/chat/completions", json=CHAT, timeout=60).json()
    text = first["choices"][0]["message"]["content"]
    assert text and first["usage"]["completion_tokens"] <= 12
    models = httpx.get(server + "/v1/models", timeout=5).json()["data"]
    assert models[0]["max_model_len"] >= 1100
    assert first["model"] == "smollm2-135m-instruct"
    streamed = []
    with httpx.stream("POST", server + "/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    streamed.append(choice["delta"].get("content", ""))
    assert "".join(streamed) == text


def test_ps_reports_what_the_model_holds(server, capsys):
    from shoal.cli.app import main

    reply = httpx.post(server + "/v1/chat/completions", json=CHAT, timeout=60)
    assert reply.status_code == 200, reply.text
    tags = httpx.get(server + "/api/tags", timeout=5).json()["models"]
    file_size = next(m["size"] for m in tags if m["model"] == "smollm2-135m-instruct")
    running = httpx.get(server + "/api/ps", timeout=5).json()["models"]
    model = next(m for m in running if m["model"] == "smollm2-135m-instruct")
    held = model["shoal"]
    assert 0 < held["weights_bytes"] <= 1.2 * file_size  # packed GGUF weights
    assert held["rss_bytes"] > held["weights_bytes"]
    assert 0 <= held["kv_bytes_in_use"] <= held["kv_bytes_granted"] < held["kv_bytes_capacity"]
    # What the runner holds (its RSS: weights, the KV it wrote, its floor) and the KV granted
    # it has not written yet; never the capacity, and within twice its RSS.
    touched = held["kv_bytes_in_use"] + (held["kv_bytes_cached"] or 0)
    assert model["size"] == held["rss_bytes"] + max(0, held["kv_bytes_granted"] - touched)
    assert model["size"] <= 2 * held["rss_bytes"]
    assert main(["ps", "--url", server]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if "smollm2-135m-instruct" in line)
    assert "MiB" in row


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    reply = client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=2)
    assert reply.choices[0].message.content
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=5,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**{**CHAT, "model": "no-such-model"})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**CHAT, "top_p": 7})
    assert any(m.id == "smollm2-135m-instruct" for m in client.models.list())


def test_context_length_is_400(server):
    response = httpx.post(server + "/v1/completions", timeout=60,
                          json={"model": "smollm2", "prompt": "hello " * 9000})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_client_disconnect_cancels(server):
    body = {**CHAT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()  # held: a dropped iterator closes the connection
        for line in lines:
            if line.startswith("data: "):
                break
        assert _health(server)["models"][0]["in_flight"] == 1
    deadline = time.monotonic() + 10
    while _health(server)["models"][0]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(server)["models"][0]["in_flight"] == 0


def test_runner_killed_mid_request(server):
    pid = _health(server)["models"][0]["pid"]
    body = {**CHAT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    events = []
    started = time.monotonic()
    with httpx.stream("POST", server + "/v1/chat/completions", json=body,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - started < 30
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "runner_crashed"
    deadline = time.monotonic() + 120
    while _health(server)["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.5)
    after = httpx.post(server + "/v1/chat/completions", json=CHAT, timeout=60)
    assert after.status_code == 200
    assert _health(server)["models"][0]["pid"] != pid


def test_cancel_by_id_ends_a_stream_with_abort(server):
    body = {**CHAT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", server + "/v1/chat/completions", json=body,
                      timeout=60) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 2:
                cancelled = httpx.post(f"{server}/v1/requests/{request_id}/cancel",
                                       timeout=10)
    assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2][6:])
    assert final["id"] == request_id
    assert final["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 100  # ended long before its 1000 tokens
    again = httpx.post(f"{server}/v1/requests/{request_id}/cancel", timeout=10)
    assert again.status_code == 404
    deadline = time.monotonic() + 10
    while _health(server)["models"][0]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(server)["models"][0]["in_flight"] == 0  # the runner let it go


def test_metrics_move_with_traffic(server):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = httpx.get(server + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    model = (("model", "smollm2-135m-instruct"),)
    before = scrape()
    answer = httpx.post(server + "/v1/chat/completions", json=CHAT, timeout=60).json()
    after = scrape()
    generated = ("shoal_generated_tokens_total", model)
    assert after[generated] - before.get(generated, 0) == answer["usage"]["completion_tokens"]
    first_token = ("shoal_time_to_first_token_seconds_count", model)
    assert after[first_token] == before.get(first_token, 0) + 1
    route = ("shoal_http_requests_total", (("model", "smollm2"), ("route",
                                           "/v1/chat/completions"), ("status", "200")))
    assert after[route] == before.get(route, 0) + 1
    kv = {state: after[("shoal_kv_cache_bytes", model + (("state", state),))]
          for state in ("in_use", "cached", "free")}
    assert kv["free"] > 0 and min(kv.values()) >= 0
    assert after[("shoal_model_loads_total", model)] == 1
    assert after[("shoal_runner_restarts_total", model)] >= 1  # the runner killed above
    assert after[("shoal_cluster_nodes", ())] == 1
    assert after.get(("shoal_queue_waiting", model), 0) == 0  # nothing left waiting
