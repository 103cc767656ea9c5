"""Typed topic names and the key expressions they map to, inside one cluster's namespace.

Every key lives under `shoal/<ns>/`, where <ns> is derived from the cluster secret by a hash:
nodes with different secrets use disjoint keys, so they neither see each other's messages nor
each other's presence. The secret and the namespace are never logged; logs show only a short
fingerprint that cannot be used to address the cluster.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum

from shoal.ids import NodeId

_ROOT = "shoal"
# A node id becomes one key-expression chunk, so it must not contain Zenoh's
# separators or wildcard characters.
_NODE_ID = re.compile(r"[A-Za-z0-9_.:@+=-]{1,128}")


class Topic(StrEnum):
    """The broadcast topics of the control plane (who sends → who reads)."""

    COMMANDS = "commands"              # api / worker → master
    LOCAL_EVENTS = "local_events"      # worker → master, not yet indexed
    GLOBAL_EVENTS = "global_events"    # master → all, IndexedEvent in index order
    STATE_SYNC = "state_sync"          # follower ↔ master: snapshot + log tail
    ELECTION = "election"              # all ↔ all: candidacies and master heartbeats
    TELEMETRY = "telemetry"            # all → all: last-writer-wins readings
    QUERIES = "queries"                # any → all: questions (traces, diagnostics); the
                                       # answers go to the asker's data key
    PREFIXES = "prefixes"              # serving ranks' nodes → all: prefix KV blocks held


def check_node_id(node: str) -> NodeId:
    """node as a NodeId usable inside a key expression; ValueError otherwise."""
    if not isinstance(node, str) or not _NODE_ID.fullmatch(node):
        raise ValueError(f"invalid node id {node!r}: use 1-128 letters, digits or _.:@+=-")
    return NodeId(node)


class Namespace:
    """The key space of one cluster, derived from its secret (an empty secret is a valid one)."""

    __slots__ = ("_prefix", "fingerprint")

    def __init__(self, secret: str | None) -> None:
        digest = hashlib.sha256(b"shoal-cluster-namespace\0" + (secret or "").encode()).hexdigest()
        self._prefix = f"{_ROOT}/{digest[:16]}"
        # Hashed again so the fingerprint shown in logs does not reveal the namespace itself.
        self.fingerprint = hashlib.sha256(digest.encode()).hexdigest()[:8]

    def __repr__(self) -> str:
        return f"Namespace(fingerprint={self.fingerprint})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other._prefix == self._prefix

    def __hash__(self) -> int:
        return hash(self._prefix)

    def topic_key(self, topic: Topic) -> str:
        return f"{self._prefix}/{Topic(topic).value}"

    def data_key(self, node: NodeId) -> str:
        """Key of the token chunks addressed to node."""
        return f"{self._prefix}/data/{check_node_id(node)}"

    def presence_key(self, node: NodeId) -> str:
        """Key of node's liveliness token."""
        return f"{self._prefix}/presence/{check_node_id(node)}"

    @property
    def presence_pattern(self) -> str:
        return f"{self._prefix}/presence/*"

    def node_from_presence_key(self, key: str) -> NodeId | None:
        """The node a presence key names, or None for a key outside this namespace."""
        return self._node_under(f"{self._prefix}/presence/", key)

    def beacon_key(self, node: NodeId) -> str:
        """Key of node's link beacons (transport/beacons.py)."""
        return f"{self._prefix}/beacon/{check_node_id(node)}"

    @property
    def beacon_pattern(self) -> str:
        return f"{self._prefix}/beacon/*"

    def node_from_beacon_key(self, key: str) -> NodeId | None:
        return self._node_under(f"{self._prefix}/beacon/", key)

    @staticmethod
    def _node_under(head: str, key: str) -> NodeId | None:
        if not key.startswith(head):
            return None
        node = key[len(head):]
        return NodeId(node) if _NODE_ID.fullmatch(node) else None
