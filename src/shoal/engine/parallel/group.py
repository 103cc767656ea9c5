"""The process group of one instance's ranks (torch.distributed), with every wait bounded.

Ranks meet through a TCPStore on rank 0's rendezvous address (behind a guard that admits only
connections proving the cluster secret: rendezvous.py) and form a gloo group, its
device bound to the interface that reaches rank 0 (gloo's default device follows the host
name, which on some machines routes loopback traffic through a slow path: ~2 ms per message
instead of ~0.1 ms). On CUDA, tensors of the forward pass ride an NCCL group beside it.

Through the same store every pair of ranks also opens a PeerLinks socket (links.py). Byte
messages (step plans, sampled tokens) ride it, and so do CPU tensors between two ranks:
pipeline hidden states and two-rank all-reduces, which lie on every decoded token's critical
path, where a gloo message costs 0.1-1 ms of hand-offs and a socket ~35 µs. Sums over more
than two ranks, and every CUDA tensor, go through torch.distributed.

A rank that died or fell silent turns any wait into GroupError within collective_timeout_s
(a dead process usually at once: its sockets close).
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.engine.errors import GroupError
from shoal.engine.parallel.config import ParallelConfig
from shoal.engine.parallel.links import LinkError, PeerLinks
from shoal.engine.parallel.rendezvous import GuardedStore, RendezvousError

log = logging.getLogger("shoal.parallel")

_TAG = 0


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

    def __init__(self, config: ParallelConfig, gloo: dist.ProcessGroup,
                 tensors: dist.ProcessGroup, links: PeerLinks, device: torch.device,
                 store: GuardedStore) -> None:
        self.config = config
        self.rank = config.rank
        self.world_size = config.world_size
        self.device = device
        self._gloo = gloo
        self._tensors = tensors  # CUDA tensors and sums over more than two ranks
        self._links = links  # byte messages, CPU tensors between two ranks
        self._spin_s = config.spin_s
        self._store = store  # kept alive: rank 0 hosts it
        self._timeout = timedelta(seconds=config.collective_timeout_s)
        self.wait_s = 0.0  # time spent blocked on other ranks (bench/distributed.py reads it)

    @classmethod
    def join(cls, config: ParallelConfig, device: torch.device) -> RankGroup:
        """Meet the other ranks; GroupError if they are not all there within
        connect_timeout_s (or rank 0 cannot listen on the rendezvous port)."""
        key = bytes.fromhex(config.rank_key)
        guarded = None
        try:
            guarded = GuardedStore.open(config.master_addr, config.master_port, config.rank,
                                        config.world_size, key, config.connect_timeout_s)
            store = guarded.store
            address = local_address_towards(config.master_addr)
            gloo = _gloo_group(store, config, address)
            tensors = gloo
            if device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                tensors = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), config.rank,
                                                config.world_size, options)
            links = PeerLinks.connect(store, config.rank, config.world_size, address,
                                      config.connect_timeout_s, key)
        except RendezvousError as error:  # refused at once: no wait to speak of
            raise GroupError(f"rank {config.rank} could not join its group: {error}") from None
        except (RuntimeError, OSError, ValueError) as error:  # DistStoreError, LinkError too
            if guarded is not None:
                guarded.close()
            raise GroupError(f"rank {config.rank} could not join its group at "
                             f"{config.master_addr}:{config.master_port} within "
                             f"{config.connect_timeout_s:.0f} s: {error}") from error
        log.info("rank %d of %d joined its group at %s:%d", config.rank, config.world_size,
                 config.master_addr, config.master_port)
        return cls(config, gloo, tensors, links, device, guarded)

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The ranks' torch.distributed (gloo) group."""
        return self._gloo

    # --- point to point ------------------------------------------------------------------------

    def send_bytes(self, payload: bytes, dst: int) -> None:
        self._link_wait(lambda timeout: self._links.send(dst, payload, timeout),
                        f"send to rank {dst}")

    def recv_bytes(self, src: int, timeout_s: float | None = None, spin: bool = True) -> bytes:
        """The next message from src; spin=False when it is not expected soon (no polling
        first: see ParallelConfig.spin_s)."""
        spin_s = self._spin_s if spin else 0.0
        return self._link_wait(lambda timeout: self._links.recv(src, timeout, spin_s),
                               f"wait for rank {src}", timeout_s)

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        """tensor's values to dst, which knows its shape and dtype (from the step plan)."""
        tensor = tensor.contiguous()
        if tensor.device.type != "cpu":
            self._wait(self._tensors.send([tensor], dst, _TAG), f"send to rank {dst}")
            return
        self._link_wait(lambda timeout: self._links.send(dst, _bytes_of(tensor), timeout),
                        f"send to rank {dst}")

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        if tensor.device.type != "cpu":
            self._wait(self._tensors.recv([tensor], src, _TAG), f"wait for rank {src}")
            return tensor
        self._link_wait(lambda timeout: self._links.recv_into(src, _bytes_of(tensor), timeout,
                                                              self._spin_s),
                        f"wait for rank {src}")
        return tensor

    # --- collectives ---------------------------------------------------------------------------

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum tensor over the ranks, in place. Two ranks on CPU swap their parts over their
        link and add (one exchange: a fraction of a ring all-reduce's latency at these
        sizes)."""
        if self.world_size == 2 and tensor.device.type == "cpu":
            peer = 1 - self.rank
            tensor = tensor.contiguous()
            other = torch.empty_like(tensor)
            self._link_wait(lambda timeout: self._links.exchange(
                peer, _bytes_of(tensor), _bytes_of(other), timeout, self._spin_s),
                f"exchange with rank {peer}")
            # Rank order of the sum is fixed, so both ranks hold the same bits.
            first, second = (tensor, other) if self.rank == 0 else (other, tensor)
            torch.add(first, second, out=tensor)
            return tensor
        self._wait(self._tensors.allreduce([tensor]), "all-reduce")
        return tensor

    def close(self) -> None:
        """Drop the group (the other ranks see their next wait fail)."""
        self._links.close()
        for group in {id(self._gloo): self._gloo, id(self._tensors): self._tensors}.values():
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError:
                    pass
        self._store.close()

    def _wait(self, work: dist.Work, what: str, timeout_s: float | None = None) -> None:
        timeout = self._timeout if timeout_s is None else timedelta(seconds=timeout_s)
        started = time.perf_counter()
        try:
            work.wait(timeout)
        except RuntimeError as error:
            raise GroupError(f"rank {self.rank}: {what} failed: {_first_line(error)}") from None
        finally:
            self.wait_s += time.perf_counter() - started

    def _link_wait(self, transfer, what: str, timeout_s: float | None = None):
        """transfer(timeout in seconds) on the links, timed and with errors as GroupError."""
        timeout = self.config.collective_timeout_s if timeout_s is None else timeout_s
        started = time.perf_counter()
        try:
            return transfer(timeout)
        except LinkError as error:
            raise GroupError(f"rank {self.rank}: {what} failed: {error}") from None
        finally:
            self.wait_s += time.perf_counter() - started


def _bytes_of(tensor: torch.Tensor):
    """A contiguous CPU tensor's memory as a flat byte array (no copy), for the links."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


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
