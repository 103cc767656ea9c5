"""A model file's bytes from one node to another over a direct TCP stream: the fast path of a
peer copy (model_transfer.py), where the data plane's messages would cap the rate.

The asker asks the holder on the data plane; the holder opens a one-off listener on the
address it is reachable at (its API host, where rank groups meet it too) and answers with
that endpoint and a random token. The asker connects within a bounded time (mutual TLS under
the cluster CA when the cluster runs --cluster-tls, as its Zenoh links do), sends the token,
and reads the range it asked for as pieces: each the 32-byte sha256 of its bytes, then the
bytes. Pieces split the file at multiples of the offer's piece size, so a whole piece is one
of the chunks FileHashes hashed when the holder listed the file: the holder sends those with
their cached digest through os.sendfile (plain) or big buffered writes (TLS), hashing only
the pieces it has no digest for. The asker checks every piece (on a few threads) and writes
it in file order, so what it wrote is always a verified prefix of its range to resume from;
each written piece starts its way to disk at once (start_writeback), so the copy's final
fsync waits for little more than the last piece.

Blocking: StreamServer.run and StreamReceiver.run run on threads; cancel() from any thread
ends either within a moment.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import hmac
import os
import secrets
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from shoal.catalog.file_hashes import DIGEST_BYTES
from shoal.cluster.tls import ClusterTls

TOKEN_BYTES = 32
SLICE_BYTES = 1024 * 1024  # the most one send or receive call moves (pacing's step)
HASH_THREADS = 2  # pieces the asker checks at once (hashlib lets go of the GIL)
MIN_PIECE_BYTES, MAX_PIECE_BYTES = 4096, 64 * 1024 * 1024


def paced_buffer_bytes(rate: float | None) -> int | None:
    """A paced stream's socket buffer: an eighth of a second at its rate (the kernel's own
    tuning when unpaced): a slow asker does not have its holder queue megabytes ahead."""
    if rate is None:
        return None
    return int(min(4 * 1024 * 1024, max(16 * 1024, rate / 8)))


class StreamUnavailable(Exception):
    """No stream could be opened (refused, unreachable, TLS refused): nothing was read."""


class StreamBroken(Exception):
    """The stream failed part-way; reached: the offset up to which verified bytes were
    written."""

    def __init__(self, reached: int, reason: str) -> None:
        super().__init__(reason)
        self.reached = reached


@dataclass(frozen=True)
class Offer:
    """The holder's answer: where to connect, and the token that proves the asker."""

    host: str
    port: int
    token: bytes = field(repr=False)
    piece_bytes: int

    def to_wire(self) -> dict[str, object]:
        return {"host": self.host, "port": self.port, "token": self.token.hex(),
                "piece_bytes": self.piece_bytes}

    @classmethod
    def from_wire(cls, wire: dict[str, object]) -> Offer:
        """ValueError for anything malformed."""
        try:
            offer = cls(host=str(wire["host"]), port=int(wire["port"]),  # type: ignore[arg-type]
                        token=bytes.fromhex(str(wire["token"])),
                        piece_bytes=int(wire["piece_bytes"]))  # type: ignore[arg-type]
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed stream offer: {error}") from None
        if not (0 < offer.port < 65536 and len(offer.token) == TOKEN_BYTES
                and MIN_PIECE_BYTES <= offer.piece_bytes <= MAX_PIECE_BYTES):
            raise ValueError("malformed stream offer")
        return offer


def pieces(begin: int, end: int, piece_bytes: int) -> Iterator[tuple[int, int]]:
    """[start, stop) of each piece of [begin, end): split at multiples of piece_bytes."""
    at = begin
    while at < end:
        stop = min(end, (at // piece_bytes + 1) * piece_bytes)
        yield at, stop
        at = stop


def server_context(tls: ClusterTls) -> ssl.SSLContext:
    """Shows the node certificate and accepts only askers the cluster CA signed (names are not
    checked, as on the Zenoh links: every node holds the same CA-signed key)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.node_cert, tls.node_key)
    context.load_verify_locations(tls.ca_cert)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: ClusterTls) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.load_cert_chain(tls.node_cert, tls.node_key)
    context.load_verify_locations(tls.ca_cert)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


class StreamServer:
    """One offer: listens on host until the asker connects with the token (or wait_s passes),
    then sends the bytes [begin, end) of path. on_sent(n) after each piece."""

    def __init__(self, host: str, path: Path, begin: int, end: int, *,
                 chunk_digests: bytes | None, piece_bytes: int, wait_s: float,
                 context: ssl.SSLContext | None, on_sent: Callable[[int], None],
                 rate: float | None = None) -> None:
        self.path, self.begin, self.end = path, begin, end
        self._buffer_bytes = paced_buffer_bytes(rate)
        self._digests = chunk_digests
        self._piece_bytes = piece_bytes
        self._wait_s = wait_s
        self._context = context
        self._on_sent = on_sent
        self._version = _version(os.stat(path))
        self._stopped = False
        self._connection: socket.socket | None = None
        self.token = secrets.token_bytes(TOKEN_BYTES)
        # OSError (no such address here, say) goes to the caller: no offer is made.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=4)
        self.offer = Offer(host, self._listener.getsockname()[1], self.token, piece_bytes)

    def run(self) -> None:
        try:
            connection = self._accept()
        finally:
            self._listener.close()
        if connection is None:
            return
        with connection, open(self.path, "rb") as file:
            self._send(connection, file)

    def cancel(self) -> None:
        self._stopped = True
        for sock in (self._listener, self._connection):
            _shut(sock)

    def close(self) -> None:
        """Withdraw an offer that run() will never serve."""
        self._listener.close()

    def _accept(self) -> socket.socket | None:
        """The first connection that shows the token within wait_s (others are closed: a
        stranger who connects first does not spoil the offer); None when none does."""
        deadline = time.monotonic() + self._wait_s
        while not self._stopped and (left := deadline - time.monotonic()) > 0:
            self._listener.settimeout(left)
            try:
                connection, _ = self._listener.accept()
            except OSError:  # the wait ran out, or cancel() closed the listener
                return None
            _bound(connection, self._wait_s, plain=self._context is None)
            # A piece's 32-byte digest goes out at once, not held for the last piece's ACK.
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._buffer_bytes is not None:
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._buffer_bytes)
            try:
                if self._context is not None:
                    connection = self._context.wrap_socket(connection, server_side=True)
                shown = _read_exactly(connection, TOKEN_BYTES)
            except (OSError, EOFError):
                connection.close()
                continue
            if hmac.compare_digest(shown, self.token):
                self._connection = connection
                return connection
            connection.close()
        return None

    def _send(self, connection: socket.socket, file) -> None:
        size = self._version[0]
        for start, stop in pieces(self.begin, self.end, self._piece_bytes):
            if self._stopped or _version(os.fstat(file.fileno())) != self._version:
                return  # the asker sees the stream end: rewritten files are not served
            digest = self._cached_digest(start, stop, size)
            try:
                if digest is not None and self._context is None:
                    connection.sendall(digest)
                    _send_file(connection, file, start, stop - start)
                else:
                    data = os.pread(file.fileno(), stop - start, start)
                    if len(data) != stop - start or \
                            _version(os.fstat(file.fileno())) != self._version:
                        return  # rewritten while read: a digest of it would prove nothing
                    connection.sendall(digest or hashlib.sha256(data).digest())
                    view = memoryview(data)
                    for at in range(0, len(view), SLICE_BYTES):
                        connection.sendall(view[at:at + SLICE_BYTES])
            except (OSError, EOFError):
                return  # the asker went away or fell silent past the timeout
            self._on_sent(stop - start)

    def _cached_digest(self, start: int, stop: int, size: int) -> bytes | None:
        """The digest FileHashes kept for this piece, when it is one whole chunk."""
        index = start // self._piece_bytes
        whole = start == index * self._piece_bytes and \
            stop == min(size, (index + 1) * self._piece_bytes)
        at = index * DIGEST_BYTES
        if not whole or self._digests is None or at + DIGEST_BYTES > len(self._digests):
            return None
        return self._digests[at:at + DIGEST_BYTES]


class StreamReceiver:
    """Reads [begin, end) of a file from an offer into fd at the same offsets, each piece
    checked against its sha256 before it is written, in order; paced to rate bytes a second
    (None: unbounded); on_piece(start, length) after each piece is written."""

    def __init__(self, offer: Offer, begin: int, end: int, fd: int, *,
                 context: ssl.SSLContext | None, connect_timeout_s: float,
                 read_timeout_s: float, rate: float | None,
                 on_piece: Callable[[int, int], None]) -> None:
        self.offer, self.begin, self.end = offer, begin, end
        self._fd = fd
        self._context = context
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._rate = rate
        self._on_piece = on_piece
        self._stopped = False
        self._sock: socket.socket | None = None
        self._started, self._received = time.monotonic(), 0

    def cancel(self) -> None:
        self._stopped = True
        _shut(self._sock)

    def run(self) -> None:
        """StreamUnavailable when no stream opens; StreamBroken (with how far it got) when
        it fails part-way."""
        sock = self._connect()
        self._sock, reached = sock, self.begin
        # (piece start, its buffer, its bytes there, its digest, the check of its bytes)
        waiting: deque[tuple[int, memoryview, memoryview, bytes, Future[bytes]]] = deque()
        # Pieces land in a few buffers used in turn (a fresh one per piece would cost a
        # page fault every 4 KiB): one being read, up to HASH_THREADS being checked.
        spare = [memoryview(bytearray(self.offer.piece_bytes)) for _ in range(HASH_THREADS + 1)]
        try:
            with sock, ThreadPoolExecutor(HASH_THREADS) as hashers:
                sock.sendall(self.offer.token)
                for start, stop in pieces(self.begin, self.end, self.offer.piece_bytes):
                    digest = _read_exactly(sock, DIGEST_BYTES)
                    buffer = spare.pop()
                    data = buffer[:stop - start]
                    self._read_into(sock, data)
                    waiting.append((start, buffer, data, digest,
                                    hashers.submit(lambda d: hashlib.sha256(d).digest(), data)))
                    # Written in order, once checked; a few pieces are checked at once.
                    while waiting and (not spare or waiting[0][4].done()):
                        reached = self._write(waiting.popleft(), spare)
                while waiting:
                    reached = self._write(waiting.popleft(), spare)
        except (OSError, EOFError) as error:
            why = "the stream was cancelled" if self._stopped else _describe(error)
            raise StreamBroken(reached, f"{why} at offset {reached}") from None

    def _connect(self) -> socket.socket:
        address = (self.offer.host, self.offer.port)
        buffer_bytes = paced_buffer_bytes(self._rate)
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
        try:
            if buffer_bytes is not None:  # before connecting: it sets the TCP window
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            sock.settimeout(self._connect_timeout_s)
            sock.connect(address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                sock = self._context.wrap_socket(sock)
        except OSError as error:
            sock.close()
            raise StreamUnavailable(f"cannot connect to {address[0]}:{address[1]}: "
                                    f"{_describe(error)}") from None
        _bound(sock, self._read_timeout_s, plain=self._context is None)
        if self._stopped:
            sock.close()
            raise StreamUnavailable("cancelled")
        return sock

    def _read_into(self, sock: socket.socket, view: memoryview) -> None:
        # Unpaced and plain, a whole piece in one call: the kernel fills it as bytes come
        # (far fewer wake-ups than a read per slice, which tells on a busy machine).
        whole = self._rate is None and self._context is None
        got = 0
        while got < len(view):
            if whole:
                n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            else:
                n = sock.recv_into(view[got:], min(len(view) - got, SLICE_BYTES))
            if n == 0:
                raise EOFError("the holder ended the stream")
            got += n
            self._received += n
            self._pace()

    def _pace(self) -> None:
        """Sleep while ahead of the rate (the holder's sends wait meanwhile)."""
        if self._rate is not None:
            ahead = self._received / self._rate - (time.monotonic() - self._started)
            if ahead > 0:
                time.sleep(ahead)

    def _write(self, piece: tuple[int, memoryview, memoryview, bytes, Future[bytes]],
               spare: list[memoryview]) -> int:
        """Write a checked piece at its offset and hand its buffer back; where it ends."""
        start, buffer, data, digest, checked = piece
        if checked.result() != digest:
            raise OSError(f"the piece at offset {start} does not match its sha256")
        written = 0
        try:
            while written < len(data):
                written += os.pwrite(self._fd, data[written:], start + written)
        except OSError as error:
            raise OSError(f"cannot write the copy: {_describe(error)}") from None
        start_writeback(self._fd, start, len(data))
        spare.append(buffer)
        self._on_piece(start, len(data))
        return start + len(data)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing fd's bytes [offset, offset + length) to disk without waiting for them
    (Linux's sync_file_range; elsewhere nothing): a large copy's fsync then finds little
    left to write, where it would otherwise write the whole file after the last byte came
    (a tenth of a second for 256 MiB here). The pages stay cached for the model's load."""
    sync_file_range = _sync_file_range()
    if sync_file_range is not None:
        sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a failure: fsync's job


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux, or no such call in its C library
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _read_exactly(sock: socket.socket, length: int) -> bytes:
    data = bytearray(length)
    view, got = memoryview(data), 0
    while got < length:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the holder ended the stream")
        got += n
    return bytes(data)


def _bound(sock: socket.socket, seconds: float, plain: bool) -> None:
    """Every send and receive on sock gives up after seconds without progress. A plain
    socket stays blocking, the bound kept by the kernel (SO_RCVTIMEO, SO_SNDTIMEO), so that
    one call can move a whole piece; a TLS socket needs Python's own timeout."""
    if not plain:
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    whole = int(seconds)
    bound = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)


def _send_file(sock: socket.socket, file, offset: int, count: int) -> None:
    """count bytes of file from offset, page cache to socket (sendfile)."""
    sent = 0
    while sent < count:
        n = os.sendfile(sock.fileno(), file.fileno(), offset + sent, count - sent)
        if n == 0:
            raise EOFError("the file ended early")
        sent += n


def _version(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _shut(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
        except OSError:
            pass


def _describe(error: BaseException) -> str:
    if isinstance(error, (TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO
        return "timed out"
    return str(error) or type(error).__name__
