"""Which side of a partition may write: the one holding a quorum of the cluster's members.

The members are the nodes of the replicated state (the master admits and removes them, so
only a side that holds a quorum can change who they are). A side holds a quorum when it sees
a strict majority of them; on an even split, the side with the master whose session the
state comes from (both sides hold the same state until one writes: a two-node cluster keeps
its master when the other node goes, and stops writing when the master goes). So at most
one side of any partition holds one, and only there does a master index events: a minority
cannot remove the majority's nodes, re-place their instances or take requests, and after the
partition heals it follows the majority's master and takes its state.
"""

from __future__ import annotations

from collections.abc import Collection

from shoal.ids import NodeId


def holds_quorum(members: Collection[NodeId], present: Collection[NodeId],
                 session_master: NodeId | None) -> bool:
    """Whether the present nodes hold a quorum of members (any side does while there are no
    members yet: a cluster forming); session_master breaks an even split."""
    if not members:
        return True
    seen = sum(1 for node in members if node in present)
    if 2 * seen != len(members):
        return 2 * seen > len(members)
    return session_master in present


def describe_quorum(members: Collection[NodeId], present: Collection[NodeId]) -> str:
    seen = sum(1 for node in members if node in present)
    return f"this node reaches {seen} of the cluster's {len(members)} nodes"
