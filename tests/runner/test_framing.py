"""Frames: round trips on both sides, bounded sizes, clean EOF."""

from __future__ import annotations

import asyncio
import socket

import pytest

from shoal.runner.framing import (
    FrameTooLarge,
    encode_frame,
    read_frame,
    recv_frame,
    send_frame,
    write_frame,
)

MESSAGE = {"type": "submit", "text": "héllo ✓", "ids": [1, 2, 3], "bias": {5: -1.5},
           "nested": {"none": None, "flag": True}, "blob": b"\x00\xff"}


def test_blocking_round_trip_and_eof():
    left, right = socket.socketpair()
    send_frame(left, MESSAGE)
    send_frame(left, {"empty": []})
    left.close()
    assert recv_frame(right) == MESSAGE
    assert recv_frame(right) == {"empty": []}
    assert recv_frame(right) is None  # clean end of stream


def test_oversize_frame_is_refused_on_both_ends():
    with pytest.raises(FrameTooLarge, match="exceeds"):
        encode_frame({"x": "a" * 200}, max_bytes=100)
    left, right = socket.socketpair()
    send_frame(left, {"x": "a" * 200})
    with pytest.raises(FrameTooLarge):
        recv_frame(right, max_bytes=100)


def test_truncated_frame_is_an_error_not_eof():
    left, right = socket.socketpair()
    left.sendall(encode_frame(MESSAGE)[:-3])
    left.close()
    with pytest.raises(ConnectionError):
        recv_frame(right)


def test_asyncio_round_trip_with_blocking_peer():
    async def scenario():
        left, right = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=left)
        write_frame(writer, MESSAGE)
        await writer.drain()
        echoed = await asyncio.to_thread(recv_frame, right)
        await asyncio.to_thread(send_frame, right, {"echo": echoed})
        right.close()
        first = await read_frame(reader)
        second = await read_frame(reader)
        writer.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert first == {"echo": MESSAGE}
    assert second is None


def test_asyncio_oversize_header():
    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data((10_000).to_bytes(4, "big"))
        reader.feed_eof()
        return await read_frame(reader, max_bytes=100)

    with pytest.raises(FrameTooLarge):
        asyncio.run(scenario())
