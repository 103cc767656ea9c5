"""How nodes talk: typed topics in a secret-derived namespace, over Zenoh or in memory.

The Zenoh implementation lives in transport.zenoh and is imported only where a node opens
its network session, so in-memory users never load zenoh.
"""

from shoal.cluster.transport.base import Inbox, Subscription, Transport, TransportError
from shoal.cluster.transport.memory import MemoryHub, MemoryTransport
from shoal.cluster.transport.topics import Namespace, Topic, check_node_id

__all__ = ["Inbox", "MemoryHub", "MemoryTransport", "Namespace", "Subscription", "Topic",
           "Transport", "TransportError", "check_node_id"]
