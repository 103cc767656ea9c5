"""How a node joins a cluster: its settings, built once by shoal.config from flags and env."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.cluster.tls import ClusterTls, rank_key

# --peer-fetch-rate: a copy from another node takes at most this many bytes a second by
# default, leaving both nodes' disks, CPUs and link room to serve meanwhile.
DEFAULT_PEER_FETCH_RATE = 256 * 1024 * 1024


@dataclass(frozen=True)
class ClusterSettings:
    """How this node joins a cluster.

    standalone: no network at all, a cluster of this node alone. Otherwise a Zenoh peer
    session: listen on `listen` (Zenoh picks when empty), dial `peers`, and discover nodes
    by multicast scouting when `discovery` is on (by default: unless peers are given).
    `secret` isolates clusters; it is never logged or shown. `tls` (--cluster-tls): Zenoh
    links are mutual TLS under the cluster CA, and its secret file keys the ranks' proofs.
    """

    standalone: bool = False
    listen: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    secret: str = field(default="", repr=False)
    force_master: bool = False
    discovery: bool | None = None
    name: str = ""  # shown in GET /cluster; the host name when empty
    tls: ClusterTls | None = None
    discovery_interface: str = ""  # the interface multicast scouting uses; Zenoh picks
    # --propose-for TARGET[=SOURCE]: (target model id, proposal source) this node guesses
    # tokens for, for verifiers on other nodes (cluster/proposer_service.py).
    propose_for: tuple[tuple[str, str], ...] = ()
    # Capability cards: exchanged with every peer each interval, expired after the TTL.
    card_interval_s: float = 5.0
    card_ttl_s: float = 30.0
    # Bytes a second one copy of model files from another node may take; None: unbounded.
    peer_fetch_rate: int | None = DEFAULT_PEER_FETCH_RATE

    def __post_init__(self) -> None:
        if self.peer_fetch_rate is not None and self.peer_fetch_rate <= 0:
            raise ValueError("--peer-fetch-rate must be a positive size a second, or off")
        if self.card_interval_s <= 0 or self.card_ttl_s <= 2 * self.card_interval_s:
            raise ValueError("a capability card's TTL must exceed two exchange intervals "
                             f"({self.card_ttl_s:g} s, interval {self.card_interval_s:g} s)")
        if self.standalone and (self.listen or self.peers or self.discovery or self.tls):
            raise ValueError("a standalone node neither listens, dials peers, discovers nor "
                             "uses --cluster-tls")
        if self.tls is not None:
            for endpoint in (*self.listen, *self.peers):
                if not endpoint.startswith("tls/"):
                    raise ValueError(f"with --cluster-tls every cluster endpoint is tls/HOST:"
                                     f"PORT, not {endpoint!r}")

    @property
    def rank_key(self) -> str:
        """What the ranks of an instance prove to each other: from the --cluster-tls secret
        file, else from --cluster-secret; "" (no proof) with neither."""
        return rank_key(self.tls.secret if self.tls is not None else self.secret.encode())
