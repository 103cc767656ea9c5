"""The supervisor and runner subprocess, driven with the fake engine (tests/fakes.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from fakes import fake_engine_config, fake_runner_env, fake_supervisor_options

from shoal.engine.sampling import SamplingParams
from shoal.protocol import GenerationRequest
from shoal.runner.supervisor import RunnerSupervisor, RunnerUnavailable


def request(request_id: str, prompt: str = "hello there", **sampling) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, model="fake-model", prompt=prompt,
                             sampling=SamplingParams(**sampling))


async def collect(supervisor: RunnerSupervisor, req: GenerationRequest) -> list:
    return [chunk async for chunk in supervisor.submit(req)]


def run_with_supervisor(tmp_path, scenario, model_id="fake-model", **options):
    async def main():
        supervisor = RunnerSupervisor(fake_engine_config(tmp_path, model_id),
                                      fake_supervisor_options(**options))
        try:
            await supervisor.start()
            return await scenario(supervisor)
        finally:
            await supervisor.shutdown()

    return asyncio.run(main())


def test_submit_streams_tokens_then_finish(tmp_path):
    async def scenario(supervisor):
        assert supervisor.model_info.max_model_len == 128
        plain = await collect(supervisor, request("a"))
        stopped = await collect(supervisor, request("b", stop=("w3",), logprobs=True,
                                                    top_logprobs=2))
        return plain, stopped

    plain, stopped = run_with_supervisor(tmp_path, scenario)
    assert [c.kind for c in plain] == ["accepted"] + ["token"] * 8 + ["finish"]
    assert plain[0].prompt_tokens == 2
    assert "".join(c.text for c in plain if c.kind == "token") == "".join(
        f"w{i} " for i in range(1, 9))
    assert plain[-1].finish_reason == "stop"
    assert plain[-1].usage.completion_tokens == 8
    assert stopped[-1].finish_reason == "stop"
    assert "".join(c.text for c in stopped if c.kind == "token") == "w1 w2 "
    assert len(stopped[1].logprobs) == 1 and len(stopped[1].logprobs[0].top) == 2


def test_validation_errors_come_back_as_error_chunks(tmp_path):
    async def scenario(supervisor):
        bias = await collect(supervisor, request("a", logit_bias={5000: 1.0}))
        long_prompt = await collect(supervisor, request("b", prompt="x " * 200))
        too_many = await collect(supervisor, request("c", max_tokens=127))
        bad_ids = await collect(supervisor, GenerationRequest(
            request_id="d", model="fake-model", prompt_token_ids=(5, 99999)))
        return bias, long_prompt, too_many, bad_ids

    bias, long_prompt, too_many, bad_ids = run_with_supervisor(tmp_path, scenario)
    assert len(bias) == 1 and bias[0].code == "invalid_request" and bias[0].param == "logit_bias"
    assert long_prompt[0].code == "context_length_exceeded"
    assert too_many[0].code == "context_length_exceeded"
    assert bad_ids[0].code == "invalid_request" and bad_ids[0].param == "prompt"


def test_closing_the_stream_cancels_in_the_engine(tmp_path):
    abort_log = tmp_path / "aborts.txt"

    async def scenario(supervisor):
        stream = supervisor.submit(request("forever", prompt="FOREVER please"))
        kinds = [(await anext(stream)).kind for _ in range(3)]
        await stream.aclose()
        deadline = time.monotonic() + 5
        while not abort_log.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        after = await collect(supervisor, request("next"))
        return kinds, after

    kinds, after = run_with_supervisor(
        tmp_path, scenario, env={**fake_runner_env(), "SHOAL_FAKE_ABORT_LOG": str(abort_log)})
    assert kinds == ["accepted", "token", "token"]
    assert abort_log.read_text().split() == ["forever"]
    assert after[-1].kind == "finish"


def test_step_exception_fails_in_flight_and_runner_keeps_serving(tmp_path):
    async def scenario(supervisor):
        pid = supervisor.pid
        failed = await collect(supervisor, request("a", prompt="RAISE now"))
        ok = await collect(supervisor, request("b"))
        return pid, supervisor.pid, failed, ok

    pid_before, pid_after, failed, ok = run_with_supervisor(tmp_path, scenario)
    assert failed[-1].kind == "error" and failed[-1].code == "internal"
    assert "fake engine step failure" in failed[-1].message
    assert ok[-1].kind == "finish"
    assert pid_before == pid_after


def test_killed_runner_fails_requests_fast_and_restarts(tmp_path):
    async def scenario(supervisor):
        old_pid = supervisor.pid
        stream = supervisor.submit(request("a", prompt="FOREVER SLOW"))
        assert (await anext(stream)).kind == "accepted"
        os.kill(old_pid, signal.SIGKILL)
        started = time.monotonic()
        rest = [chunk async for chunk in stream]
        elapsed = time.monotonic() - started
        await supervisor.wait_ready(20)
        after = await collect(supervisor, request("b"))
        return old_pid, supervisor.pid, rest, elapsed, after, supervisor.restarts

    old_pid, new_pid, rest, elapsed, after, restarts = run_with_supervisor(tmp_path, scenario)
    assert rest[-1].kind == "error" and rest[-1].code == "runner_crashed"
    assert elapsed < 5
    assert new_pid != old_pid and restarts == 1
    assert after[-1].kind == "finish"


def test_crash_loop_stops_after_three_crashes(tmp_path):
    async def main():
        supervisor = RunnerSupervisor(fake_engine_config(tmp_path, "fake-exit-on-load"),
                                      fake_supervisor_options())
        try:
            with pytest.raises(RunnerUnavailable, match="3 crashes"):
                await supervisor.start()
            refused = await collect(supervisor, request("a"))
            return supervisor.state, supervisor.restarts, refused
        finally:
            await supervisor.shutdown()

    state, restarts, refused = asyncio.run(main())
    assert state == "failed" and restarts == 2
    assert refused[0].code == "unavailable" and "not restarting" in refused[0].message


def test_load_failure_is_reported_without_retries(tmp_path):
    async def main():
        supervisor = RunnerSupervisor(fake_engine_config(tmp_path, "fake-fail-load"),
                                      fake_supervisor_options())
        with pytest.raises(RunnerUnavailable, match="not supported"):
            await supervisor.start()
        await supervisor.shutdown()
        return supervisor.restarts

    assert asyncio.run(main()) == 0


def test_overload_and_shutdown(tmp_path):
    async def scenario(supervisor):
        first = supervisor.submit(request("a", prompt="FOREVER"))
        assert (await anext(first)).kind == "accepted"
        second = await collect(supervisor, request("b"))
        await first.aclose()
        return second

    second = run_with_supervisor(tmp_path, scenario, max_in_flight=1)
    assert second[0].code == "overloaded"


def test_shutdown_stops_the_process_and_later_requests_get_unavailable(tmp_path):
    async def main():
        supervisor = RunnerSupervisor(fake_engine_config(tmp_path),
                                      fake_supervisor_options())
        await supervisor.start()
        pid = supervisor.pid
        stream = supervisor.submit(request("a", prompt="FOREVER"))
        assert (await anext(stream)).kind == "accepted"
        await supervisor.shutdown()
        rest = [chunk async for chunk in stream]
        later = await collect(supervisor, request("b"))
        return pid, rest, later

    pid, rest, later = asyncio.run(main())
    assert rest[-1].code == "unavailable"
    assert later[0].code == "unavailable"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
