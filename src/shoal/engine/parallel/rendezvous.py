"""The group's rendezvous store, reachable from other machines only by proving the secret.

torch.distributed's TCPStore has no authentication: whoever reaches its port can read and
write the keys the ranks meet by (gloo's addresses, the links' addresses), or stall the
group. So rank 0 runs the real store on 127.0.0.1 only (its listening socket is ours,
handed over with master_listen_fd), and a gateway listens on the rendezvous port: each
connection must prove the cluster secret (proof.py) before its bytes are piped to the store.
The other ranks talk to the store through a tunnel: a listener on their own 127.0.0.1 that
dials the gateway for each connection the store client opens, proves the secret, and pipes.

Processes on rank 0's own machine can still reach the store's loopback port, and those on
another rank's machine its tunnel: the guard keeps out other machines, not other local users.
"""

from __future__ import annotations

import ipaddress
import logging
import select
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from shoal.engine.parallel.proof import ProofError, challenge, prove

log = logging.getLogger("shoal.parallel")

_PURPOSE = b"rendezvous"
_STRANGER_S = 2.0  # a connection must prove the secret this soon after it opens
_POLL_S = 1.0  # how often an idle thread looks whether it should stop
_SEND_S = 30.0  # a store message that cannot be handed on this long ends its connection
_RETRY_S = 0.2  # between dials of a gateway that is not listening yet


class RendezvousError(ConnectionError):
    """The rendezvous could not be reached, or refused this rank's proof."""


class _Guard:
    """A listener whose connections, once let through, are piped to another socket; owns
    every thread and socket it opens. Subclasses say how a connection is let through."""

    def __init__(self, listener: socket.socket, name: str) -> None:
        self._listener = listener
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self.failure: str | None = None  # why the last connection was not let through
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def close(self) -> None:
        """Stop listening and end every connection (each thread closes its own sockets;
        idle ones notice within _POLL_S)."""
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a waiting accept() on Linux
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread that waits on it
            except OSError:
                pass

    def _through(self, sock: socket.socket, origin: tuple) -> socket.socket | None:
        """The socket to pipe sock to, or None (sock is then closed)."""
        raise NotImplementedError

    def _serve(self) -> None:
        self._listener.settimeout(_POLL_S)
        while not self._stop.is_set():
            try:
                sock, origin = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            # Each connection on its own thread: a silent one holds up no other.
            threading.Thread(target=self._connection, args=(sock, origin), daemon=True).start()

    def _connection(self, sock: socket.socket, origin: tuple) -> None:
        opened = [sock]
        try:
            if not self._track(sock):
                return
            other = self._through(sock, origin)
            if other is None:
                return
            opened.append(other)
            if self._track(other):
                _pipe(sock, other, self._stop)
        except OSError:  # a stranger's silence, a store that went away
            pass
        finally:
            with self._lock:
                self._sockets.difference_update(opened)
            for each in opened:
                each.close()

    def _track(self, sock: socket.socket) -> bool:
        """Count sock among those close() ends; False once closing."""
        with self._lock:
            if self._stop.is_set():
                return False
            self._sockets.add(sock)
            return True


class _Gateway(_Guard):
    """Rank 0's rendezvous port: proven connections go on to the store on 127.0.0.1."""

    def __init__(self, listener: socket.socket, key: bytes, store_port: int) -> None:
        self._key = key
        self._store_port = store_port
        super().__init__(listener, "rendezvous-gateway")

    def _through(self, sock: socket.socket, origin: tuple) -> socket.socket | None:
        try:
            challenge(sock, self._key, _PURPOSE, _STRANGER_S)
        except ProofError as error:
            log.warning("rendezvous: a connection from %s was refused: %s", _address(origin),
                        error)
            return None
        return socket.create_connection(("127.0.0.1", self._store_port), _STRANGER_S)


class _Tunnel(_Guard):
    """A rank's local end of the rendezvous: each connection goes on to the gateway."""

    def __init__(self, key: bytes, gateway: tuple[str, int], rank: int,
                 deadline: float) -> None:
        self._key = key
        self._gateway = gateway
        self._rank = rank
        self._deadline = deadline
        self._spare: socket.socket | None = None
        super().__init__(socket.create_server(("127.0.0.1", 0)), "rendezvous-tunnel")

    def check(self) -> None:
        """Prove the secret to the gateway once now, so a refusal is an error at once rather
        than a store that retries until its timeout; the proven connection serves the store
        client's first one."""
        self._spare = self._proven()
        if self._spare is None:
            raise RendezvousError(self.failure or "the rendezvous refused this rank")

    def close(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()
        super().close()

    def _through(self, sock: socket.socket, origin: tuple) -> socket.socket | None:
        spare, self._spare = self._spare, None
        return spare if spare is not None else self._proven()

    def _proven(self) -> socket.socket | None:
        """A connection to the gateway that proved the secret both ways; None (and why in
        failure) if the gateway refused it or never answered."""
        try:
            remote = self._dial()
        except RendezvousError:
            return None
        try:
            prove(remote, self._key, _PURPOSE, self._rank, _STRANGER_S)
        except (ProofError, OSError) as error:
            remote.close()
            self.failure = (f"the rendezvous at {self._gateway[0]}:{self._gateway[1]} refused "
                            f"this rank: {error}")
            log.warning("rank %d: %s", self._rank, self.failure)
            return None
        return remote

    def _dial(self) -> socket.socket:
        """The gateway, dialed until it answers (rank 0 may not listen yet) or the deadline."""
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0 or self._stop.is_set():
                self.failure = (f"nothing answered at the rendezvous {self._gateway[0]}:"
                                f"{self._gateway[1]} in time")
                raise RendezvousError(self.failure)
            try:
                return socket.create_connection(self._gateway, min(remaining, 5.0))
            except OSError:
                time.sleep(min(_RETRY_S, remaining))


class GuardedStore:
    """The group's TCPStore behind the guard: `store` for torch.distributed, close() for
    the guard's threads (after the store is dropped)."""

    def __init__(self, store: dist.TCPStore, guard: _Guard) -> None:
        self.store = store
        self._guard = guard

    @classmethod
    def open(cls, host: str, port: int, rank: int, world_size: int, key: bytes,
             timeout_s: float) -> GuardedStore:
        """Rank 0 hosts the store and its gateway on port; the others reach it from here.
        RendezvousError if the rendezvous refuses this rank or the store does not form."""
        timeout = timedelta(seconds=timeout_s)
        if rank == 0:
            gateway_listener = _listen_everywhere(port)  # OSError if the port is taken
            local = socket.create_server(("127.0.0.1", 0))
            store_port = local.getsockname()[1]
            guard: _Guard = _Gateway(gateway_listener, key, store_port)
            try:
                # The store closes the descriptor it is handed: detach it from `local`.
                store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=True,
                                      timeout=timeout, wait_for_workers=True,
                                      master_listen_fd=local.detach())
            except BaseException:
                guard.close()
                raise
            return cls(store, guard)
        tunnel = _Tunnel(key, (host, port), rank, time.monotonic() + timeout_s)
        try:
            tunnel.check()
            store = dist.TCPStore("127.0.0.1", tunnel.port, world_size, is_master=False,
                                  timeout=timeout)
        except BaseException as error:
            tunnel.close()
            if tunnel.failure is not None and not isinstance(error, RendezvousError):
                raise RendezvousError(tunnel.failure) from None  # says more than the store
            raise
        return cls(store, tunnel)

    def close(self) -> None:
        self._guard.close()


def _address(origin: tuple) -> str:
    """host:port of a peer, an IPv4 peer of the dual-stack listener shown as IPv4."""
    host = origin[0]
    try:
        host = str(ipaddress.ip_address(host).ipv4_mapped or host)
    except ValueError:
        pass
    return f"{host}:{origin[1]}"


def _listen_everywhere(port: int) -> socket.socket:
    """The rendezvous port on every interface, as TCPStore itself would listen."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _pipe(first: socket.socket, second: socket.socket, stop: threading.Event) -> None:
    """Bytes each way between first and second until either closes or stop is set."""
    other = {first.fileno(): second, second.fileno(): first}
    sockets = {first.fileno(): first, second.fileno(): second}
    for sock in (first, second):
        sock.settimeout(_SEND_S)
    poller = select.poll()
    for descriptor in sockets:
        poller.register(descriptor, select.POLLIN)
    while not stop.is_set():
        for descriptor, _ in poller.poll(_POLL_S * 1e3):
            try:
                data = sockets[descriptor].recv(65536)
                if not data:
                    return
                other[descriptor].sendall(data)
            except OSError:
                return
