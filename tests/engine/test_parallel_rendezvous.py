"""The guarded rendezvous store: ranks that prove the key share one TCPStore; a rank with
another key, or a plain store client, never reaches it (in one process, ranks as threads)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from rank_processes import free_port

from shoal.engine.parallel.rendezvous import GuardedStore, RendezvousError

KEY = bytes(range(32))


def open_store(port: int, rank: int, key: bytes = KEY, timeout_s: float = 10.0) -> GuardedStore:
    return GuardedStore.open("127.0.0.1", port, rank, 2, key, timeout_s)


def test_ranks_that_prove_the_key_share_the_store():
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(open_store, port, 0)
        guest = open_store(port, 1)
        rank0 = host.result(timeout=20)
    try:
        guest.store.set("from rank 1", "hello")
        assert rank0.store.get("from rank 1") == b"hello"
        rank0.store.set("from rank 0", "hi")
        assert guest.store.get("from rank 0") == b"hi"
    finally:
        guest.close()
        rank0.close()


def test_a_rank_with_another_key_is_refused_at_once_and_the_right_one_still_gets_in(caplog):
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(open_store, port, 0)
        started = time.monotonic()
        with pytest.raises(RendezvousError, match="refused this rank"):
            open_store(port, 1, key=b"another cluster's key")
        assert time.monotonic() - started < 3.0  # not at the 10 s deadline
        assert not host.done()  # rank 0 still waits for its second rank
        guest = open_store(port, 1)
        rank0 = host.result(timeout=20)
    try:
        guest.store.set("k", "v")
        assert rank0.store.get("k") == b"v"
    finally:
        guest.close()
        rank0.close()
    assert "rendezvous: a connection from 127.0.0.1" in caplog.text
    assert KEY.hex() not in caplog.text


def test_a_plain_store_client_never_reaches_the_store():
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(open_store, port, 0)
        time.sleep(0.3)  # the gateway listens
        # torch's own client on the rendezvous port, as an intruder would dial it
        with pytest.raises((RuntimeError, OSError)):
            dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                          timeout=timedelta(seconds=2))
        assert not host.done()  # the intruder did not count as the second rank
        guest = open_store(port, 1)
        host.result(timeout=20).close()
        guest.close()


def test_nothing_listening_at_the_rendezvous_fails_at_the_deadline():
    started = time.monotonic()
    with pytest.raises(RendezvousError, match="nothing answered"):
        open_store(free_port(), 1, timeout_s=1.0)
    assert time.monotonic() - started < 3.0
