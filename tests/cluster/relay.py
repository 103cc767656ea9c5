"""A TCP relay between network namespaces that adds latency and the cost of lost packets.

The kernel here has no `netem`, so links are impaired in user space. Each relayed connection
carries bytes both ways; every chunk read is held `latency_s` before it is written on. Loss
cannot be copied byte for byte onto TCP (a relay that dropped bytes would corrupt the
stream, where a real lost segment is sent again): a lost segment costs the stream one
retransmission timeout, during which nothing behind it is delivered. So with probability
`loss` a chunk is held a further `retransmit_s` (Linux's minimum RTO, 200 ms), and every
chunk after it waits behind it, in order.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass
class Impairment:
    latency_s: float = 0.0
    loss: float = 0.0
    retransmit_s: float = 0.2


class Relay:
    """Listens on listen (host, port) and relays each connection to target (host, port)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int],
                 impairment: Impairment, seed: int = 0) -> None:
        self.target = target
        self.impairment = impairment  # read per chunk: a test may change it while running
        self._random = random.Random(seed)
        self._server = socket.create_server(listen, reuse_port=False)
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self._server]
        self.chunks = 0
        self.stalled = 0  # chunks held for a retransmission
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:  # the target is cut off: refuse, as it would
                client.close()
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Read chunks from source; a writer thread sends each on sink once it is due."""
        due: deque[tuple[float, bytes]] = deque()
        ready = threading.Condition()
        writer = threading.Thread(target=self._write, args=(due, ready, sink), daemon=True)
        writer.start()
        last_due = 0.0
        while True:
            try:
                chunk = source.recv(65536)
            except OSError:
                chunk = b""
            with ready:
                if chunk:
                    impairment = self.impairment
                    at = time.monotonic() + impairment.latency_s
                    if impairment.loss and self._random.random() < impairment.loss:
                        at += impairment.retransmit_s
                        self.stalled += 1
                    last_due = max(last_due, at)  # in order: none overtakes a held chunk
                    self.chunks += 1
                due.append((last_due, chunk))
                ready.notify()
            if not chunk:
                return

    @staticmethod
    def _write(due: deque, ready: threading.Condition, sink: socket.socket) -> None:
        while True:
            with ready:
                while not due:
                    ready.wait()
                at, chunk = due[0]
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with ready:
                due.popleft()
            if not chunk:
                try:
                    sink.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                sink.sendall(chunk)
            except OSError:
                return
