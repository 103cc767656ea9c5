"""PeerLinks: one TCP connection from each rank of an instance to each other rank.

The messages on a decoded token's critical path ride these links: step plans, sampled
tokens, the hidden states a pipeline rank hands on, and two ranks' all-reduce exchanges.
A gloo send or receive hands each message to gloo's I/O thread and back, and waits for the
receiver's "ready" note before the payload moves: 0.1-1 ms per message on loopback here,
against ~35 µs for a plain socket (bench/distributed.py prints both). A token of a 2-rank
pipeline crosses two such hand-offs; a tensor-parallel token crosses two per layer.

A message is one frame: an int64 length, then the payload. Every wait has a deadline, and a
closed connection (its process died) is a LinkError at once. A link opens with a proof of
the cluster secret both ways (proof.py): a peer that cannot prove it is turned away, and the
listener goes on waiting for the ranks that can.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import time

from shoal.engine.parallel.proof import ProofError, challenge, prove

log = logging.getLogger("shoal.parallel")

_LENGTH = struct.Struct("<q")
_PURPOSE = b"rank link"
# A rank proves itself as soon as it connects; a silent stranger holds the listener 2 s at most.
_STRANGER_S = 2.0
_MAX_MESSAGE = 2**30  # byte messages are plans and answers: far smaller


class LinkError(RuntimeError):
    """A peer closed its link, broke the protocol, or did not answer in time."""


class PeerLinks:
    """This rank's connected sockets, by peer rank; build it with connect()."""

    def __init__(self, rank: int, sockets: dict[int, socket.socket]) -> None:
        self.rank = rank
        self._sockets = sockets

    @classmethod
    def connect(cls, store, rank: int, world_size: int, address: str, timeout_s: float,
                key: bytes) -> PeerLinks:
        """Meet every other rank within timeout_s: each rank listens and publishes its
        address in the group's store (torch.distributed's TCPStore); a rank dials every rank
        below it and accepts the ones above. Both ends of a link prove key to each other."""
        deadline = time.monotonic() + timeout_s
        listener = socket.create_server((address, 0))
        sockets: dict[int, socket.socket] = {}
        try:
            host, port = listener.getsockname()[:2]
            store.set(f"links/{rank}", f"{host} {port}")
            for peer in range(rank):
                host, port = store.get(f"links/{peer}").decode().split()
                sockets[peer] = _dial((host, int(port)), peer, rank, key, deadline)
            while len(sockets) < world_size - 1:
                peer, sock = _accept(listener, rank, world_size, key, deadline)
                if peer in sockets:
                    sock.close()
                    raise LinkError(f"rank {peer} dialed twice")
                sockets[peer] = sock
        except (OSError, LinkError) as error:
            for sock in sockets.values():
                sock.close()
            if isinstance(error, LinkError):
                raise
            raise LinkError(f"rank {rank} could not link up with the other ranks within "
                            f"{timeout_s:.0f} s: {error}") from None
        finally:
            listener.close()
        for sock in sockets.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)  # every transfer waits in poll(), with a deadline
        return cls(rank, sockets)

    def send(self, dst: int, payload, timeout_s: float) -> None:
        """One frame to dst; payload is any bytes-like object (a tensor's numpy view)."""
        data = memoryview(payload).cast("B")
        _transfer(self._socket(dst), _frame(data), [], _Wait(dst, timeout_s, 0.0))

    def recv(self, src: int, timeout_s: float, spin_s: float = 0.0) -> bytes:
        """The next frame from src, whatever its length. A wait polls for spin_s before it
        sleeps: waking a sleeping core costs tens to hundreds of µs per message, and a
        core kept busy stays warm for the work the message brings."""
        sock, wait = self._socket(src), _Wait(src, timeout_s, spin_s)
        size = _read_length(sock, wait)
        if not 0 <= size <= _MAX_MESSAGE:
            raise LinkError(f"rank {src} sent a frame of {size} bytes")
        payload = bytearray(size)
        _transfer(sock, [], [memoryview(payload)], wait)
        return bytes(payload)

    def recv_into(self, src: int, buffer, timeout_s: float, spin_s: float = 0.0) -> None:
        """The next frame from src into buffer, which must be exactly its length."""
        sock, wait = self._socket(src), _Wait(src, timeout_s, spin_s)
        view = memoryview(buffer).cast("B")
        _check_length(_read_length(sock, wait), view, src)
        _transfer(sock, [], [view], wait)

    def exchange(self, peer: int, payload, buffer, timeout_s: float,
                 spin_s: float = 0.0) -> None:
        """Send payload to peer while receiving its frame of the same length into buffer:
        both directions move at once, so neither side blocks on a full socket buffer."""
        into = memoryview(buffer).cast("B")
        header = bytearray(_LENGTH.size)
        _transfer(self._socket(peer), _frame(memoryview(payload).cast("B")),
                  [memoryview(header), into], _Wait(peer, timeout_s, spin_s))
        _check_length(_LENGTH.unpack(header)[0], into, peer)

    def close(self) -> None:
        """Close every link (each peer's next wait on this rank fails at once)."""
        for sock in self._sockets.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._sockets.clear()

    def _socket(self, peer: int) -> socket.socket:
        sock = self._sockets.get(peer)
        if sock is None:
            raise LinkError(f"no link from rank {self.rank} to rank {peer} (closed?)")
        return sock


def _frame(payload: memoryview) -> list[memoryview]:
    """A frame as buffers to send in turn: header and payload joined when small (one send)."""
    header = _LENGTH.pack(payload.nbytes)
    if payload.nbytes <= 65536:
        return [memoryview(header + payload)]
    return [memoryview(header), payload]


def _read_length(sock: socket.socket, wait: _Wait) -> int:
    """A frame's length header."""
    header = bytearray(_LENGTH.size)
    _transfer(sock, [], [memoryview(header)], wait)
    return _LENGTH.unpack(header)[0]


def _check_length(size: int, buffer: memoryview, peer: int) -> None:
    """A frame bound for a buffer of known size must be exactly that size."""
    if size != buffer.nbytes:
        raise LinkError(f"rank {peer} sent {size} bytes where {buffer.nbytes} were due")


class _Wait:
    """One transfer's bounds: the peer it waits on, its deadline, and its polling."""

    def __init__(self, peer: int, timeout_s: float, spin_s: float) -> None:
        now = time.monotonic()
        self.peer = peer
        self.deadline = now + timeout_s
        self.spin_until = now + min(spin_s, timeout_s)


def _transfer(sock: socket.socket, out: list[memoryview], into: list[memoryview],
              wait: _Wait) -> None:
    """Send every buffer of out and fill every buffer of into, in order, by the deadline,
    each direction as the socket allows."""
    sending = [part for part in out if part.nbytes]
    filling = [part for part in into if part.nbytes]
    peer = wait.peer
    while sending or filling:
        moved = False
        if sending:
            sent = _attempt(sock.send, sending[0], peer)
            if sent:
                _consume(sending, sent)
                moved = True
        if filling:
            count = _attempt(sock.recv_into, filling[0], peer)
            if count == 0:
                raise LinkError(f"rank {peer} closed its link")
            if count:
                _consume(filling, count)
                moved = True
        if moved:
            continue
        if time.monotonic() < wait.spin_until:
            os.sched_yield()  # a thread with work on this core goes first
            continue
        remaining = wait.deadline - time.monotonic()
        poller = select.poll()  # not select(): a server's descriptors may pass 1024
        poller.register(sock, (select.POLLIN if filling else 0)
                        | (select.POLLOUT if sending else 0))
        if remaining <= 0 or not poller.poll(remaining * 1e3):
            raise LinkError(f"rank {peer} did not answer in time")


def _consume(buffers: list[memoryview], count: int) -> None:
    """Drop count bytes from the front of buffers[0] (and the buffer once it is done)."""
    buffers[0] = buffers[0][count:]
    if not buffers[0].nbytes:
        buffers.pop(0)


def _attempt(operation, buffer: memoryview, peer: int) -> int | None:
    """operation(buffer) on a non-blocking socket: its byte count, None if it would block."""
    try:
        return operation(buffer)
    except BlockingIOError:
        return None
    except OSError as error:  # reset, broken pipe: the peer's process is gone
        raise LinkError(f"link to rank {peer}: {error.strerror or error}") from None


def _dial(address: tuple[str, int], peer: int, rank: int, key: bytes,
          deadline: float) -> socket.socket:
    """A link to peer, both sides proven (the peer may still be dialing others: the proof
    waits for it, up to the deadline)."""
    sock = socket.create_connection(address, _remaining(deadline))
    try:
        prove(sock, key, _PURPOSE, rank, _remaining(deadline))
    except ProofError as error:
        sock.close()
        raise LinkError(f"rank {rank} could not link up with rank {peer}: {error}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def _accept(listener: socket.socket, rank: int, world_size: int, key: bytes,
            deadline: float) -> tuple[int, socket.socket]:
    """The next rank above this one to dial in and prove the cluster secret; strangers and
    failed proofs are turned away."""
    while True:
        listener.settimeout(_remaining(deadline))
        sock, origin = listener.accept()
        try:
            peer = challenge(sock, key, _PURPOSE, min(_remaining(deadline), _STRANGER_S))
        except ProofError as error:
            log.warning("rank %d: a link from %s:%d was refused: %s", rank, *origin[:2], error)
            sock.close()
            continue
        except OSError:  # silent or gone before proving anything
            sock.close()
            continue
        if rank < peer < world_size:
            return peer, sock
        log.warning("rank %d: a link from %s:%d claimed rank %d; closed", rank, *origin[:2],
                    peer)
        sock.close()


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise LinkError("the other ranks did not all link up in time")
    return remaining

