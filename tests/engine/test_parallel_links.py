"""PeerLinks between ranks, in one process: each rank a thread, the store a dict. Links open
only between ranks that prove the same key."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from shoal.engine.parallel.links import LinkError, PeerLinks


class DictStore:
    """The two calls PeerLinks makes of torch.distributed's TCPStore: get waits for set."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value.encode()
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout=10):
                raise RuntimeError(f"no {key} in time")
            return self._values[key]


KEY = bytes(range(32))


def link_up(world_size: int, store=None, timeout_s: float = 10.0) -> list[PeerLinks]:
    store = store or DictStore()
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(PeerLinks.connect, store, rank, world_size, "127.0.0.1",
                               timeout_s, KEY) for rank in range(world_size)]
        return [future.result(timeout=20) for future in futures]


def test_every_pair_of_ranks_trades_frames_both_ways():
    links = link_up(3)
    try:
        for src in range(3):
            for dst in range(3):
                if src != dst:
                    links[src].send(dst, f"{src}->{dst}".encode(), 1.0)
        for dst in range(3):
            for src in range(3):
                if src != dst:
                    assert links[dst].recv(src, 1.0) == f"{src}->{dst}".encode()
    finally:
        for rank_links in links:
            rank_links.close()


def test_an_exchange_larger_than_the_socket_buffers_completes_both_ways():
    first, second = link_up(2)
    size = 16 * 2**20
    outgoing = [bytes([rank + 1]) * size for rank in (0, 1)]
    incoming = [bytearray(size), bytearray(size)]
    try:
        with ThreadPoolExecutor(2) as pool:
            done = [pool.submit(links.exchange, 1 - rank, outgoing[rank], incoming[rank], 10.0,
                                0.001) for rank, links in enumerate((first, second))]
            for future in done:
                future.result(timeout=20)
        assert incoming[0] == outgoing[1] and incoming[1] == outgoing[0]
    finally:
        first.close()
        second.close()


def test_a_frame_of_the_wrong_size_for_the_buffer_is_an_error():
    first, second = link_up(2)
    try:
        first.send(1, b"12345", 1.0)
        with pytest.raises(LinkError, match="5 bytes where 4 were due"):
            second.recv_into(0, bytearray(4), 1.0)
    finally:
        first.close()
        second.close()


def test_a_silent_peer_ends_the_wait_at_its_deadline_and_a_closed_one_at_once():
    first, second = link_up(2)
    started = time.monotonic()
    with pytest.raises(LinkError, match="did not answer in time"):
        first.recv(1, 0.3, spin_s=0.1)
    assert 0.3 <= time.monotonic() - started < 1.0
    second.close()
    started = time.monotonic()
    with pytest.raises(LinkError, match="closed its link"):
        first.recv(1, 5.0)
    assert time.monotonic() - started < 1.0
    first.close()


def test_a_stranger_on_the_listening_port_is_turned_away():
    store = DictStore()
    with ThreadPoolExecutor(2) as pool:
        rank0 = pool.submit(PeerLinks.connect, store, 0, 2, "127.0.0.1", 10.0, KEY)
        host, port = store.get("links/0").decode().split()
        with socket.create_connection((host, int(port)), 5) as stranger:
            stranger.sendall(b"x" * 72)  # an answer's size, but no proof
            # rank 0 reads the stranger's answer and drops it before rank 1 dials
            assert stranger.recv(40) and stranger.recv(1) == b""
            rank1 = pool.submit(PeerLinks.connect, store, 1, 2, "127.0.0.1", 10.0, KEY)
            links = [rank0.result(timeout=20), rank1.result(timeout=20)]
    try:
        links[1].send(0, b"hello", 1.0)
        assert links[0].recv(1, 1.0) == b"hello"
    finally:
        for rank_links in links:
            rank_links.close()


def test_a_missing_rank_fails_the_link_up_at_its_deadline():
    started = time.monotonic()
    with pytest.raises(LinkError, match="could not link up"):
        PeerLinks.connect(DictStore(), 0, 2, "127.0.0.1", 0.5, KEY)
    assert time.monotonic() - started < 2.0


def test_a_rank_with_another_key_is_refused_and_the_listener_waits_for_the_right_one(caplog):
    store = DictStore()
    with ThreadPoolExecutor(2) as pool:
        rank0 = pool.submit(PeerLinks.connect, store, 0, 2, "127.0.0.1", 10.0, KEY)
        started = time.monotonic()
        with pytest.raises(LinkError, match="could not link up with rank 0: it refused"):
            PeerLinks.connect(store, 1, 2, "127.0.0.1", 5.0, b"another cluster's key")
        assert time.monotonic() - started < 2.0  # refused at once, not at the deadline
        assert not rank0.done()
        rank1 = pool.submit(PeerLinks.connect, store, 1, 2, "127.0.0.1", 10.0, KEY)
        links = [rank0.result(timeout=20), rank1.result(timeout=20)]
    try:
        links[0].send(1, b"proven", 1.0)
        assert links[1].recv(0, 1.0) == b"proven"
    finally:
        for rank_links in links:
            rank_links.close()
    refusals = [r.getMessage() for r in caplog.records if "was refused" in r.getMessage()]
    assert len(refusals) == 1 and "does not prove the cluster secret" in refusals[0]
    assert KEY.hex() not in caplog.text


def test_a_listener_that_cannot_prove_the_key_is_not_trusted():
    """The dialing side checks the listener's proof too: a stranger who answers the hello
    but does not know the key gets no link."""
    from shoal.engine.parallel.proof import challenge

    store = DictStore()
    impostor = socket.create_server(("127.0.0.1", 0))
    store.set("links/0", f"127.0.0.1 {impostor.getsockname()[1]}")

    def pose_as_rank0() -> None:
        sock, _ = impostor.accept()
        with sock:
            challenge(sock, b"not the key", b"rank link", 5.0)

    with ThreadPoolExecutor(1) as pool:
        posing = pool.submit(pose_as_rank0)
        with pytest.raises(LinkError, match="rank 1 could not link up with rank 0"):
            PeerLinks.connect(store, 1, 2, "127.0.0.1", 5.0, KEY)
        with pytest.raises(Exception, match="does not prove"):
            posing.result(timeout=10)
    impostor.close()
