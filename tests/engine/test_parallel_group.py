"""The ranks' process group: messages, tensors, sums, and bounded waits on a lost rank
(each rank a real process on 127.0.0.1)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from rank_processes import run_ranks

from shoal.engine.errors import GroupError
from shoal.engine.parallel.config import ParallelConfig
from shoal.engine.parallel.group import RankGroup

# payloads on either side of the size up to which a frame goes out in one send, and one
# larger than a loopback socket's buffers
BIG = [bytes(range(256)) * (n // 256) + bytes(n % 256)
       for n in (65536, 65537, 9 * 2**20 + 5)]


def config(rank: int, world: int, port: int, **extra) -> ParallelConfig:
    return ParallelConfig(rank=rank, world_size=world, sharding="tensor", layer_start=0,
                          layer_end=4, master_addr="127.0.0.1", master_port=port,
                          connect_timeout_s=extra.pop("connect", 30.0), **extra)


def exchange(rank: int, world: int, port: int) -> dict:
    group = RankGroup.join(config(rank, world, port), torch.device("cpu"))
    out = {}
    if rank == 0:
        for dst in range(1, world):
            group.send_bytes(f"plan for {dst}".encode(), dst)
            group.send_bytes(b"", dst)
            for payload in BIG:
                group.send_bytes(payload, dst)
            group.send_tensor(torch.arange(6, dtype=torch.bfloat16) * dst, dst)
    else:
        out["bytes"] = (group.recv_bytes(0), group.recv_bytes(0))
        out["big"] = [group.recv_bytes(0) for _ in BIG]
        out["tensor"] = group.recv_tensor((6,), torch.bfloat16, 0).tolist()
    values = torch.full((3,), float(rank + 1))
    out["sum"] = group.all_reduce_(values).tolist()
    # A prefill-sized sum: both ranks send at once, more than their socket buffers hold.
    large = torch.full((4096, 640), float(rank + 1))
    out["large_sum"] = group.all_reduce_(large).unique().tolist()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_exchange_messages_tensors_and_sums(world):
    results = run_ranks(exchange, world)
    total = float(sum(range(1, world + 1)))
    for rank, out in results.items():
        assert out["sum"] == [total] * 3, out
        assert out["large_sum"] == [total]
        if rank:
            assert out["bytes"] == (f"plan for {rank}".encode(), b"")
            assert out["big"] == BIG
            assert out["tensor"] == [float(i * rank) for i in range(6)]


def wait_for_a_dead_peer(rank: int, world: int, port: int) -> tuple[str, float]:
    group = RankGroup.join(config(rank, world, port, collective_timeout_s=3.0, keepalive_s=1.0),
                           torch.device("cpu"))
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed process is
    started = time.monotonic()
    try:
        group.recv_bytes(1)
    except GroupError as error:
        return str(error), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_lost_rank_turns_a_wait_into_an_error_within_the_bound():
    message, waited = run_ranks(wait_for_a_dead_peer, 2, expect=[0], timeout_s=60)[0]
    assert "rank 0: wait for rank 1 failed" in message
    assert waited < 3.5


def join_alone(rank: int, world: int, port: int) -> str:
    started = time.monotonic()
    try:
        RankGroup.join(config(rank, world, port, connect=1.0), torch.device("cpu"))
    except GroupError as error:
        return f"{time.monotonic() - started:.1f} {error}"
    return "joined"


def test_joining_without_the_other_ranks_fails_after_the_deadline():
    result = run_ranks(join_alone, 2, ranks=[0], timeout_s=60)[0]
    waited, message = result.split(" ", 1)
    assert "could not join its group" in message and float(waited) < 10


def join_with_key(rank: int, world: int, port: int, keys: list[str]) -> str:
    started = time.monotonic()
    try:
        group = RankGroup.join(config(rank, world, port, connect=3.0, rank_key=keys[rank]),
                               torch.device("cpu"))
    except GroupError as error:
        return f"{time.monotonic() - started:.1f} {error}"
    group.close()
    return "joined"


def test_a_rank_with_another_key_is_refused_at_the_rendezvous_at_once():
    keys = ["ab" * 32, "cd" * 32]
    results = run_ranks(join_with_key, 2, keys, timeout_s=60)
    waited, message = results[1].split(" ", 1)
    assert "refused this rank" in message and "cluster secret" in message
    assert float(waited) < 2.0
    assert "could not join its group" in results[0]  # rank 0 never got its second rank


def int8_hidden_states(rank: int, world: int, port: int) -> float:
    from shoal.engine.parallel.executor import HiddenWire

    group = RankGroup.join(config(rank, world, port), torch.device("cpu"))
    wire = HiddenWire(group, 576, torch.float32, compress=True)
    torch.manual_seed(0)
    hidden = torch.randn(5, 576) * torch.linspace(0.1, 40.0, 5)[:, None]  # rows of any scale
    if rank == 0:
        wire.send(hidden, 1)
        return 0.0
    got = wire.recv(5, 0)
    # Each value is within half a step of its row's int8 grid: max |row| / 127 / 2.
    return float(((got - hidden).abs() / (hidden.abs().amax(dim=1, keepdim=True) / 254)).max())


def test_int8_hidden_states_stay_within_half_a_step_of_each_row_scale():
    assert run_ranks(int8_hidden_states, 2)[1] <= 1.0001
