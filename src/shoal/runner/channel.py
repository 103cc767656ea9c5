"""The runner's end of its socket to the supervisor: a reader thread and a locked sender."""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from shoal.runner.framing import FrameError, recv_frame, send_frame
from shoal.runner.messages import (
    RunnerMessage,
    to_wire,
)

log = logging.getLogger("shoal.runner")

EOF = object()  # put in the inbox once the supervisor closed the socket


# raw Inspect -> the answer to send (None: nothing to send)
Answerer = Callable[[dict[str, Any]], RunnerMessage | None]


class Channel:
    """The runner's end of the socket: a reader thread fills an inbox; sends are locked.
    Inspect messages never reach the inbox: the reader thread answers them with answer(),
    so they are answered while the loop is busy (loading, stepping). Nor do the types given
    to intercept(): their handler takes them on the reader thread (answers a step awaits)."""

    def __init__(self, sock: socket.socket, answer: Answerer | None = None) -> None:
        self._sock = sock
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._send_lock = threading.Lock()
        self._answer = answer
        self._intercepts: dict[str, Callable[[dict[str, Any]], None]] = {}
        threading.Thread(target=self._read_loop, name="runner-reader", daemon=True).start()

    def _read_loop(self) -> None:
        while True:
            try:
                raw = recv_frame(self._sock)
            except (OSError, ConnectionError, FrameError, ValueError) as error:
                log.error("runner socket read failed: %s", error)
                raw = None
            if raw is None:
                self._inbox.put(EOF)
                return
            if self._answer is not None and isinstance(raw, dict) \
                    and raw.get("type") == "inspect":
                self._reply(raw)
                continue
            handler = self._intercepts.get(raw.get("type")) if isinstance(raw, dict) else None
            if handler is not None:
                try:
                    handler(raw)
                except Exception:  # noqa: BLE001 - a failing handler must not stop the reader
                    log.exception("handling a %s message failed", raw.get("type"))
                continue
            self._inbox.put(raw)

    def intercept(self, message_type: str, handler: Callable[[dict[str, Any]], None]) -> None:
        """Hand raw messages of message_type to handler on the reader thread."""
        self._intercepts[message_type] = handler

    def _reply(self, raw: dict[str, Any]) -> None:
        try:
            reply = self._answer(raw)  # type: ignore[misc]
            if reply is not None:
                self.send(reply)
        except Exception:  # noqa: BLE001 - an answer that fails must not stop the reader
            log.exception("answering an inspect message failed")

    def receive(self, block: bool, timeout_s: float | None = None) -> list[Any]:
        """All waiting raw messages; with block, wait for at least one (or timeout_s)."""
        items = []
        if block:
            try:
                items.append(self._inbox.get(timeout=timeout_s))
            except queue.Empty:
                return []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def send(self, message: RunnerMessage) -> None:
        with self._send_lock:
            send_frame(self._sock, to_wire(message))


class SupervisorGone(Exception):
    """The socket closed: nobody is left to serve."""
