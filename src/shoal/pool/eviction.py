"""Which idle models to unload so another one fits: a pure choice over what a node holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    """A model instance served by this node, as eviction sees it."""

    instance_id: str
    model: str
    bytes: int  # what it counts against the node's budget
    pinned: bool = False
    busy: bool = False  # requests in flight on it, or admitted and about to be
    priority: int = 5  # its latest request's priority: 0 most urgent .. 9 least
    last_used: float = 0.0  # when its last request ended (or began), monotonic seconds

    @property
    def evictable(self) -> bool:
        return not self.pinned and not self.busy


def eviction_order(residents: Sequence[Resident]) -> list[Resident]:
    """Evictable residents, first to go first: least urgent priority, then least recently
    used (then the id, so the order is total)."""
    return sorted((r for r in residents if r.evictable),
                  key=lambda r: (-r.priority, r.last_used, r.instance_id))


def choose_victims(residents: Sequence[Resident], bytes_needed: int, free_bytes: int,
                   slots_needed: int = 0) -> tuple[Resident, ...] | None:
    """The idle residents to unload so bytes_needed fits in free_bytes plus what they free,
    and slots_needed model slots open (--max-loaded-models).

    () when it fits already; None when unloading every evictable resident would not do
    (the caller waits for a busy one to go idle, or refuses)."""
    victims: list[Resident] = []
    freed = 0
    for resident in eviction_order(residents):
        if free_bytes + freed >= bytes_needed and len(victims) >= slots_needed:
            break
        victims.append(resident)
        freed += resident.bytes
    if free_bytes + freed >= bytes_needed and len(victims) >= slots_needed:
        return tuple(victims)
    return None
