"""Length-prefixed msgpack frames over a local stream socket.

A frame is a 4-byte big-endian payload length followed by one msgpack map. Both sides bound
the frame size, so a corrupt length can never make a reader allocate gigabytes.
The asyncio side serves the supervisor; the blocking side serves the runner subprocess.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack

MAX_FRAME_BYTES = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")


class FrameTooLarge(ValueError):
    """A frame's payload exceeds the agreed maximum (a bug or a corrupt stream)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte limit")
        self.size = size
        self.limit = limit


class FrameError(ValueError):
    """A frame's payload is not a msgpack map."""


def encode_frame(message: dict[str, Any], max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > max_bytes:
        raise FrameTooLarge(len(payload), max_bytes)
    return _HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict[str, Any]:
    try:
        # strict_map_key off: logit_bias travels as {token_id: bias} with int keys.
        message = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as error:
        raise FrameError(f"undecodable frame: {error}") from error
    if not isinstance(message, dict):
        raise FrameError(f"frame holds {type(message).__name__}, not a map")
    return message


def _payload_size(header: bytes, max_bytes: int) -> int:
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        raise FrameTooLarge(size, max_bytes)
    return size


# ---- asyncio side (supervisor) ------------------------------------------------------------

async def read_frame(reader: asyncio.StreamReader,
                     max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any] | None:
    """The next frame, or None at a clean end of stream (EOF between frames)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise ConnectionError("stream ended inside a frame header") from error
    size = _payload_size(header, max_bytes)
    try:
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError as error:
        raise ConnectionError("stream ended inside a frame") from error
    return decode_payload(payload)


def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any],
                max_bytes: int = MAX_FRAME_BYTES) -> None:
    """Queue one frame on the transport (callers await writer.drain() when they can)."""
    writer.write(encode_frame(message, max_bytes))


# ---- blocking side (runner) ---------------------------------------------------------------

def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    """size bytes, or None if the peer closed before the first byte."""
    buffer = bytearray()
    while len(buffer) < size:
        part = sock.recv(size - len(buffer))
        if not part:
            if not buffer:
                return None
            raise ConnectionError("stream ended inside a frame")
        buffer += part
    return bytes(buffer)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any] | None:
    """The next frame, or None at a clean end of stream."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    size = _payload_size(header, max_bytes)
    payload = _recv_exactly(sock, size) if size else b""
    if payload is None:
        raise ConnectionError("stream ended inside a frame")
    return decode_payload(payload)


def send_frame(sock: socket.socket, message: dict[str, Any],
               max_bytes: int = MAX_FRAME_BYTES) -> None:
    sock.sendall(encode_frame(message, max_bytes))
