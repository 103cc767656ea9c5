"""The process group of one instance's ranks (torch.distributed), with every wait bounded.

Ranks meet through a TCPStore on rank 0's rendezvous address. On CPU the group is gloo with
its device bound to the interface that reaches rank 0 (gloo's default device follows the
host name, which on some machines routes loopback traffic through a slow path: ~2 ms per
message instead of ~0.1 ms). On CUDA, tensors of the forward pass ride an NCCL group and
the small control messages a gloo group beside it.

A byte message between ranks travels as one fixed-size frame (FRAME_BYTES: an int64 length,
then the payload) and, only when the payload does not fit, a second message with the rest,
so a receiver never guesses a size. A step plan or a sampled answer fits in one frame: each
gloo message costs a hand-off to gloo's I/O thread on both sides (~0.1-0.2 ms on loopback),
and the sampled answer lies on every decoded token's critical path.

A rank that died or fell silent turns any wait into GroupError within collective_timeout_s
(a dead process usually at once: its sockets close).
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.engine.parallel.config import ParallelConfig

log = logging.getLogger("shoal.parallel")

_TAG = 0
FRAME_BYTES = 4096
_LENGTH = struct.Struct("<q")  # a frame's first 8 bytes
_CAPACITY = FRAME_BYTES - _LENGTH.size  # payload bytes one frame carries


class GroupError(RuntimeError):
    """Another rank is gone, or a wait on it ran out; the instance cannot go on."""


def local_address_towards(host: str) -> str:
    """This machine's address on the route to host (no packet is sent: UDP connect only)."""
    if host.startswith("127.") or host in ("localhost", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


class RankGroup:
    """This rank's view of the group; build it with join()."""

    def __init__(self, config: ParallelConfig, control: dist.ProcessGroup,
                 tensors: dist.ProcessGroup, device: torch.device,
                 store: dist.TCPStore) -> None:
        self.config = config
        self.rank = config.rank
        self.world_size = config.world_size
        self.device = device
        self._control = control  # gloo: headers, plans, sampled tokens
        self._tensors = tensors  # hidden states and all-reduces (NCCL on CUDA)
        self._store = store  # kept alive: rank 0 hosts it
        self._timeout = timedelta(seconds=config.collective_timeout_s)
        self.wait_s = 0.0  # time spent blocked on other ranks (bench/distributed.py reads it)

    @classmethod
    def join(cls, config: ParallelConfig, device: torch.device) -> RankGroup:
        """Meet the other ranks; GroupError if they are not all there within
        connect_timeout_s (or rank 0 cannot listen on the rendezvous port)."""
        connect = timedelta(seconds=config.connect_timeout_s)
        try:
            store = dist.TCPStore(config.master_addr, config.master_port, config.world_size,
                                  is_master=config.rank == 0, timeout=connect,
                                  wait_for_workers=True)
            control = _gloo_group(store, config, local_address_towards(config.master_addr))
            tensors = control
            if device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                tensors = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), config.rank,
                                                config.world_size, options)
        except (RuntimeError, OSError, ValueError) as error:  # DistStoreError is a RuntimeError
            raise GroupError(f"rank {config.rank} could not join its group at "
                             f"{config.master_addr}:{config.master_port} within "
                             f"{config.connect_timeout_s:.0f} s: {error}") from error
        log.info("rank %d of %d joined its group at %s:%d", config.rank, config.world_size,
                 config.master_addr, config.master_port)
        return cls(config, control, tensors, device, store)

    # --- point to point ------------------------------------------------------------------------

    def send_bytes(self, payload: bytes, dst: int) -> None:
        frame = bytearray(FRAME_BYTES)
        _LENGTH.pack_into(frame, 0, len(payload))
        frame[_LENGTH.size:_LENGTH.size + min(len(payload), _CAPACITY)] = payload[:_CAPACITY]
        self._wait(self._control.send([torch.frombuffer(frame, dtype=torch.uint8)], dst, _TAG),
                   f"send to rank {dst}")
        if len(payload) > _CAPACITY:
            rest = torch.frombuffer(bytearray(payload[_CAPACITY:]), dtype=torch.uint8)
            self._wait(self._control.send([rest], dst, _TAG), f"send to rank {dst}")

    def recv_bytes(self, src: int, timeout_s: float | None = None) -> bytes:
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        self._wait(self._control.recv([frame], src, _TAG), f"wait for rank {src}", timeout_s)
        data = frame.numpy()
        (size,) = _LENGTH.unpack_from(data, 0)
        head = data[_LENGTH.size:_LENGTH.size + min(size, _CAPACITY)].tobytes()
        if size <= _CAPACITY:
            return head
        rest = torch.empty(size - _CAPACITY, dtype=torch.uint8)
        self._wait(self._control.recv([rest], src, _TAG), f"wait for rank {src}")
        return head + rest.numpy().tobytes()

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        """tensor's values to dst, which knows its shape and dtype (from the step plan)."""
        self._wait(self._tensors.send([tensor.contiguous()], dst, _TAG), f"send to rank {dst}")

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(self._tensors.recv([tensor], src, _TAG), f"wait for rank {src}")
        return tensor

    # --- collectives ---------------------------------------------------------------------------

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum tensor over the ranks, in place. Two ranks swap their parts and add (one
        exchange: a fraction of a ring all-reduce's latency at these sizes)."""
        if self.world_size == 2 and tensor.device.type == "cpu":
            peer = 1 - self.rank
            other = torch.empty_like(tensor)
            sent = self._tensors.send([tensor], peer, _TAG)
            received = self._tensors.recv([other], peer, _TAG)
            self._wait(sent, f"exchange with rank {peer}")
            self._wait(received, f"exchange with rank {peer}")
            # Rank order of the sum is fixed, so both ranks hold the same bits.
            first, second = (tensor, other) if self.rank == 0 else (other, tensor)
            torch.add(first, second, out=tensor)
            return tensor
        self._wait(self._tensors.allreduce([tensor]), "all-reduce")
        return tensor

    def close(self) -> None:
        """Drop the group (the other ranks see their next wait fail)."""
        for group in {id(self._control): self._control, id(self._tensors): self._tensors}.values():
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError:
                    pass

    def _wait(self, work: dist.Work, what: str, timeout_s: float | None = None) -> None:
        timeout = self._timeout if timeout_s is None else timedelta(seconds=timeout_s)
        started = time.perf_counter()
        try:
            work.wait(timeout)
        except RuntimeError as error:
            raise GroupError(f"rank {self.rank}: {what} failed: {_first_line(error)}") from None
        finally:
            self.wait_s += time.perf_counter() - started


def _gloo_group(store: dist.Store, config: ParallelConfig, address: str) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=config.collective_timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), config.rank,
                                 config.world_size, options)


def _first_line(error: BaseException) -> str:
    """The gist of a torch.distributed error: its first sentence, without the source path."""
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    line = line.split(". This is typically")[0]
    if line.startswith("[") and "] " in line:  # "[.../pair.cc:537] Read error ..."
        line = line.split("] ", 1)[1]
    return line[:300]
