"""The data plane: chunks of one task arrive in order, once, and a failure ends the stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from shoal.cluster.data_plane import ChunkSender, RemoteStreams, StreamLimits, chunk_message
from shoal.cluster.transport import MemoryHub
from shoal.ids import NodeId
from shoal.protocol import FinishChunk, TokenChunk, Usage


def token(i: int) -> TokenChunk:
    return TokenChunk(request_id="r", text=f"t{i}", token_ids=(i,))


FINISH = FinishChunk(request_id="r", finish_reason="stop",
                     usage=Usage(prompt_tokens=1, completion_tokens=3))


def test_chunks_are_reordered_deduplicated_and_end_at_the_terminal_one():
    async def main():
        hub = MemoryHub()
        owner, server = hub.connect("owner"), hub.connect("server")
        streams = RemoteStreams(owner)
        streams.start()
        stream = streams.open("r")
        messages = [chunk_message("r", seq, chunk)
                    for seq, chunk in enumerate([token(0), token(1), token(2), FINISH])]
        for message in (messages[2], messages[0], messages[0], messages[1], messages[3],
                        messages[1], chunk_message("other", 0, token(9)),
                        {"request_id": "r", "seq": "x"}):
            server.send_data(NodeId("owner"), message)
        got = [await stream.next(1.0) for _ in range(4)]
        with pytest.raises(TimeoutError):
            await stream.next(0.05)
        return got, stream.duplicates, streams.unknown

    got, duplicates, unknown = asyncio.run(main())
    assert [c.kind for c in got] == ["token", "token", "token", "finish"]
    assert [c.text for c in got[:3]] == ["t0", "t1", "t2"]
    assert duplicates == 2 and unknown == 1


def test_a_failed_stream_ends_with_one_error_and_ignores_later_chunks():
    async def main():
        hub = MemoryHub()
        owner, server = hub.connect("owner"), hub.connect("server")
        streams = RemoteStreams(owner)
        streams.start()
        stream = streams.open("r")
        sender = ChunkSender(server, NodeId("owner"), "r")
        await sender.send(token(0))
        first = await stream.next(1.0)
        stream.fail("unavailable", "node server left")
        stream.fail("timeout", "second failure is ignored")
        await sender.send(token(1))
        await asyncio.sleep(0.01)
        error = await stream.next(1.0)
        with pytest.raises(ValueError):
            streams.open("r")  # one stream per request id
        return first, error, stream.finished

    first, error, finished = asyncio.run(main())
    assert first.text == "t0"
    assert error.kind == "error" and error.code == "unavailable" and finished


class LosingTransport:
    """A transport that loses the chunk numbered `lost` of every stream it sends."""

    def __init__(self, inner, lost: int) -> None:
        self._inner = inner
        self._lost = lost

    def send_data(self, node, payload) -> None:
        if payload.get("seq") != self._lost:
            self._inner.send_data(node, payload)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_a_lost_chunk_ends_the_stream_with_an_error_long_before_the_silence_bound():
    async def main():
        hub = MemoryHub()
        owner, server = hub.connect("owner"), hub.connect("server")
        streams = RemoteStreams(owner, StreamLimits(gap_timeout_s=0.2))
        streams.start()
        stream = streams.open("r")
        sender = ChunkSender(LosingTransport(server, lost=1), NodeId("owner"), "r")
        for i in range(3):
            await sender.send(token(i))
        await sender.send(FINISH)
        started = time.monotonic()
        got = [await stream.next(60.0), await stream.next(60.0)]
        return got, time.monotonic() - started, stream.failed_here

    got, waited, failed_here = asyncio.run(main())
    assert got[0].text == "t0"
    assert got[1].kind == "error" and got[1].code == "unavailable"
    assert "chunk 1 of this request's stream was lost" in got[1].message
    assert 0.15 <= waited < 1.0 and failed_here


def test_the_reorder_buffer_is_bounded():
    async def main():
        hub = MemoryHub()
        owner, server = hub.connect("owner"), hub.connect("server")
        streams = RemoteStreams(owner, StreamLimits(reorder_limit=4, gap_timeout_s=60.0))
        streams.start()
        stream = streams.open("r")
        for seq in range(1, 8):  # chunk 0 never comes
            server.send_data(NodeId("owner"), chunk_message("r", seq, token(seq)))
        error = await stream.next(1.0)
        server.send_data(NodeId("owner"), chunk_message("r", 0, token(0)))
        await asyncio.sleep(0.01)
        return error, stream._ready.qsize(), len(stream._early)

    error, still_ready, held = asyncio.run(main())
    assert error.kind == "error" and "chunk 0" in error.message
    assert "5 later chunks arrived" in error.message
    assert still_ready == 0 and held == 0
