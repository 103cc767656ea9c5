"""LlamaServerSupervisor's life cycle against a stand-in llama-server
(tests/fake_llama_server.py): start, stream, refuse, cancel, crash and restart, stop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from fakes import fake_engine_config, fake_supervisor_options

from shoal.engine.sampling import SamplingParams
from shoal.protocol import GenerationRequest
from shoal.runner.llama_server.launch import LaunchSettings
from shoal.runner.llama_server.supervisor import LlamaServerSupervisor

FAKE = Path(__file__).parents[1] / "fake_llama_server.py"


@pytest.fixture
def fake_binary(tmp_path) -> Path:
    """The stand-in as one executable, run by this test's Python."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(0o755)
    return binary


def request(request_id: str, prompt: str = "hello there", **sampling) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, model="fake-model", prompt=prompt,
                             sampling=SamplingParams(**sampling))


def run(tmp_path, binary, scenario):
    async def main():
        supervisor = LlamaServerSupervisor(
            fake_engine_config(tmp_path), LaunchSettings(binary=binary, slots=2),
            fake_supervisor_options())
        try:
            await supervisor.start()
            return await scenario(supervisor)
        finally:
            await supervisor.shutdown()
            assert supervisor.state == "stopped" and supervisor.pid is None

    return asyncio.run(main())


def test_it_starts_streams_and_reports_its_memory(tmp_path, fake_binary):
    async def scenario(supervisor):
        assert supervisor.state == "ready" and supervisor.model_info.max_model_len == 512
        chunks = [c async for c in supervisor.submit(request("r1", max_tokens=3))]
        await asyncio.sleep(0.05)
        return supervisor, chunks

    supervisor, chunks = run(tmp_path, fake_binary, scenario)
    assert [c.kind for c in chunks] == ["accepted", "token", "token", "token", "finish"]
    assert chunks[0].prompt_tokens == 2
    assert "".join(c.text for c in chunks[1:4]) == "w0 w1 w2 "
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3
    assert supervisor.generated_tokens == 3


def test_what_it_cannot_do_and_its_own_400s_are_errors_with_their_meaning(tmp_path,
                                                                           fake_binary):
    async def scenario(supervisor):
        refused = [c async for c in supervisor.submit(request("r1", logprobs=True))]
        too_long = [c async for c in supervisor.submit(request("r2", prompt="TOOLONG"))]
        memory = supervisor.memory
        return refused, too_long, memory, supervisor.describe()

    refused, too_long, memory, described = run(tmp_path, fake_binary, scenario)
    assert refused[0].code == "invalid_request" and refused[0].param == "logprobs"
    assert too_long[-1].code == "context_length_exceeded"
    assert memory is not None and memory.rss_bytes > 0
    assert described["backend"] == "llama-server" and described["size_bytes"] > 0


def test_finished_requests_leave_no_socket_to_it_open(tmp_path, fake_binary):
    """Each request's HTTP stream is closed once its last chunk is in, however many run:
    none is left half-closed (CLOSE-WAIT) holding a file descriptor."""
    async def scenario(supervisor):
        for index in range(4):
            chunks = [c async for c in supervisor.submit(request(f"r{index}", max_tokens=2))]
            assert chunks[-1].kind == "finish"
        await asyncio.sleep(0.2)
        command = psutil.Process(supervisor.pid).cmdline()
        port = int(command[command.index("--port") + 1])
        return [c.status for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == port]

    assert run(tmp_path, fake_binary, scenario) == []


def test_closing_a_stream_stops_reading_it(tmp_path, fake_binary):
    async def scenario(supervisor):
        stream = supervisor.submit(request("r1", prompt="SLOW", max_tokens=50))
        assert (await anext(stream)).kind == "accepted"
        await stream.aclose()
        await asyncio.sleep(0.05)
        return supervisor.num_in_flight, len(supervisor._readers)

    assert run(tmp_path, fake_binary, scenario) == (0, 0)


def test_a_crash_fails_in_flight_requests_at_once_then_it_serves_again(tmp_path, fake_binary):
    async def scenario(supervisor):
        first_pid = supervisor.pid
        stream = supervisor.submit(request("r1", prompt="SLOW", max_tokens=50))
        assert (await anext(stream)).kind == "accepted"
        os.kill(first_pid, signal.SIGKILL)
        killed = time.monotonic()
        rest = [chunk async for chunk in stream]
        took = time.monotonic() - killed
        await supervisor.wait_ready(30)
        again = [c async for c in supervisor.submit(request("r2", max_tokens=2))]
        return first_pid, rest, took, again, supervisor

    first_pid, rest, took, again, supervisor = run(tmp_path, fake_binary, scenario)
    assert rest[-1].kind == "error" and rest[-1].code in ("runner_crashed", "unavailable")
    assert took < 2.0
    assert again[-1].kind == "finish" and supervisor.restarts == 1, again


def test_a_binary_that_cannot_load_fails_with_its_output(tmp_path):
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    broken.chmod(0o755)

    async def main():
        supervisor = LlamaServerSupervisor(
            fake_engine_config(tmp_path), LaunchSettings(binary=broken),
            fake_supervisor_options())
        try:
            await supervisor.start()
        except Exception as error:  # noqa: BLE001 - the message is what is tested
            return supervisor.state, str(error)
        finally:
            await supervisor.shutdown()
        return supervisor.state, ""

    state, message = asyncio.run(main())
    assert state == "failed" and "failed to load model" in message
