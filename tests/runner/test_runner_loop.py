"""The runner loop reports each engine step's chunks together, in one frame."""

from __future__ import annotations

from fakes import NATURAL_LENGTH, FakeEngine, fake_engine_config

from shoal.engine.sampling import SamplingParams
from shoal.protocol import GenerationRequest
from shoal.runner.loop import RunnerLoop
from shoal.runner.messages import ChunkBatch, ChunkMessage


class RecordingChannel:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)


def test_one_frame_per_step_with_every_request_s_chunks_in_order(tmp_path):
    channel = RecordingChannel()
    loop = RunnerLoop(FakeEngine(fake_engine_config(tmp_path)), channel)
    for request_id in ("a", "b"):
        loop.submit(GenerationRequest(request_id=request_id, model="fake-model",
                                      prompt="hello there", sampling=SamplingParams()))
    accepted = channel.sent[:]
    assert [type(m) for m in accepted] == [ChunkMessage, ChunkMessage]  # not in a step
    for _ in range(NATURAL_LENGTH):
        loop.step()
    frames = channel.sent[len(accepted):]
    assert len(frames) == NATURAL_LENGTH and all(isinstance(f, ChunkBatch) for f in frames)
    assert [(c.kind, c.request_id) for c in frames[0].chunks] == [("token", "a"),
                                                                 ("token", "b")]
    assert [(c.kind, c.request_id) for c in frames[-1].chunks] == [
        ("token", "a"), ("finish", "a"), ("token", "b"), ("finish", "b")]
    assert not loop.in_flight


def test_the_heap_is_trimmed_once_when_a_burst_of_steps_ends(tmp_path, monkeypatch):
    trims = []
    monkeypatch.setattr("shoal.runner.loop.return_freed_heap", lambda: trims.append(1))
    loop = RunnerLoop(FakeEngine(fake_engine_config(tmp_path)), RecordingChannel())
    loop.rest(keepalive=False)
    assert trims == []  # nothing ran: nothing to give back
    loop.submit(GenerationRequest(request_id="a", model="fake-model", prompt="hello there",
                                  sampling=SamplingParams()))
    while loop.has_work():
        loop.step()
    loop.rest(keepalive=False)
    loop.rest(keepalive=False)
    assert trims == [1]


def test_a_request_s_priority_reaches_the_engine(tmp_path):
    engine = FakeEngine(fake_engine_config(tmp_path))
    loop = RunnerLoop(engine, RecordingChannel())
    for request_id, priority in (("urgent", 0), ("batch", 9)):
        loop.submit(GenerationRequest(request_id=request_id, model="fake-model",
                                      prompt="hello there", sampling=SamplingParams(),
                                      priority=priority))
    assert engine.priorities == {"urgent": 0, "batch": 9}
