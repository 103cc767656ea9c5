"""The direct stream of a peer copy, socket to socket on 127.0.0.1: pieces checked by sha256
and written in order, a wrong token or another cluster's certificate served nothing, an
endpoint that cannot be reached is a StreamUnavailable at once."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from shoal.cluster.certs import make_cluster_certs
from shoal.cluster.file_stream import (
    Offer,
    StreamBroken,
    StreamReceiver,
    StreamServer,
    StreamUnavailable,
    client_context,
    pieces,
    server_context,
    start_writeback,
)
from shoal.cluster.tls import read_cluster_tls

PIECE = 4096


def serve(path, begin, end, context=None, digests=None, wait_s=2.0):
    sent = []
    server = StreamServer("127.0.0.1", path, begin, end, chunk_digests=digests,
                          piece_bytes=PIECE, wait_s=wait_s, context=context,
                          on_sent=sent.append)
    thread = threading.Thread(target=server.run)
    thread.start()
    return server, thread, sent


def receive(offer, begin, end, target, context=None, rate=None):
    written = []
    fd = os.open(target, os.O_RDWR | os.O_CREAT)
    try:
        StreamReceiver(offer, begin, end, fd, context=context, connect_timeout_s=2.0,
                       read_timeout_s=2.0, rate=rate,
                       on_piece=lambda start, n: written.append((start, n))).run()
    finally:
        os.close(fd)
    return written


@pytest.fixture
def original(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(10 * PIECE + 123))
    return path


def test_pieces_split_a_range_at_multiples_of_the_piece_size():
    assert list(pieces(100, 3 * PIECE + 5, PIECE)) == [
        (100, PIECE), (PIECE, 2 * PIECE), (2 * PIECE, 3 * PIECE), (3 * PIECE, 3 * PIECE + 5)]


def test_a_range_arrives_in_order_and_cached_digests_are_sent_as_they_are(original, tmp_path):
    data = original.read_bytes()
    digests = b"".join(hashlib.sha256(data[at:at + PIECE]).digest()
                       for at in range(0, len(data), PIECE))
    begin, end = 1000, len(data)
    server, thread, sent = serve(original, begin, end, digests=digests)
    target = tmp_path / "copy"
    written = receive(server.offer, begin, end, target)
    thread.join()
    assert target.read_bytes()[begin:] == data[begin:]
    assert [start for start, _ in written] == [start for start, _ in pieces(begin, end, PIECE)]
    assert sum(sent) == end - begin


def test_a_piece_that_does_not_match_its_digest_stops_the_copy_at_the_last_good_one(
        original, tmp_path):
    data = original.read_bytes()
    digests = bytearray(b"".join(hashlib.sha256(data[at:at + PIECE]).digest()
                                 for at in range(0, len(data), PIECE)))
    digests[3 * 32] ^= 1  # the fourth piece's digest is wrong
    server, thread, _ = serve(original, 0, len(data), digests=bytes(digests))
    with pytest.raises(StreamBroken, match="does not match its sha256") as error:
        receive(server.offer, 0, len(data), tmp_path / "copy")
    thread.join()
    assert error.value.reached == 3 * PIECE
    assert (tmp_path / "copy").read_bytes() == data[:3 * PIECE]


def test_a_wrong_token_gets_nothing_and_the_asker_is_still_served(original, tmp_path):
    server, thread, sent = serve(original, 0, PIECE)
    with socket.create_connection((server.offer.host, server.offer.port)) as stranger:
        stranger.sendall(b"x" * 32)
        stranger.settimeout(2)
        assert stranger.recv(10) == b""  # closed without a byte
    receive(server.offer, 0, PIECE, tmp_path / "copy")
    thread.join()
    assert sent == [PIECE]


def test_an_offer_nobody_listens_on_is_unavailable_at_once(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    offer = Offer("127.0.0.1", port, b"t" * 32, PIECE)
    started = time.monotonic()
    with pytest.raises(StreamUnavailable, match="cannot connect"):
        receive(offer, 0, PIECE, tmp_path / "copy")
    assert time.monotonic() - started < 1


def test_under_tls_only_the_clusters_certificate_is_served(original, tmp_path):
    for name in ("ours", "theirs"):
        make_cluster_certs(tmp_path / name)
    ours, theirs = (read_cluster_tls(tmp_path / name) for name in ("ours", "theirs"))
    server, thread, sent = serve(original, 0, 3 * PIECE, context=server_context(ours))
    with pytest.raises(StreamUnavailable):
        receive(server.offer, 0, 3 * PIECE, tmp_path / "theirs-copy", client_context(theirs))
    with pytest.raises(StreamBroken):  # plain TCP to a TLS endpoint
        receive(server.offer, 0, 3 * PIECE, tmp_path / "plain")
    receive(server.offer, 0, 3 * PIECE, tmp_path / "ours-copy", client_context(ours))
    thread.join()
    assert (tmp_path / "ours-copy").read_bytes() == original.read_bytes()[:3 * PIECE]
    assert sum(sent) == 3 * PIECE


def test_a_paced_stream_takes_as_long_as_its_rate_says(original, tmp_path):
    size = original.stat().st_size
    server, thread, _ = serve(original, 0, size)
    started = time.monotonic()
    receive(server.offer, 0, size, tmp_path / "copy", rate=size / 0.5)
    thread.join()
    assert time.monotonic() - started >= 0.45


def test_a_copy_that_cannot_be_written_stops_with_the_reason_and_nothing_reached(
        original, tmp_path):
    size = original.stat().st_size
    server, thread, _ = serve(original, 0, size)
    target = tmp_path / "copy"
    target.touch()
    fd = os.open(target, os.O_RDONLY)  # every write fails
    try:
        with pytest.raises(StreamBroken, match="cannot write the copy") as error:
            StreamReceiver(server.offer, 0, size, fd, context=None, connect_timeout_s=2.0,
                           read_timeout_s=2.0, rate=None, on_piece=lambda *_: None).run()
    finally:
        os.close(fd)
    server.cancel()
    thread.join()
    assert error.value.reached == 0


def test_starting_writeback_leaves_the_bytes_and_never_raises(tmp_path):
    target = tmp_path / "copy"
    fd = os.open(target, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"x" * PIECE, 0)
        start_writeback(fd, 0, PIECE)
    finally:
        os.close(fd)
    start_writeback(fd, 0, PIECE)  # closed: the copy's fsync reports such failures
    assert target.read_bytes() == b"x" * PIECE
