"""Per-client caps: which tier each client belongs to, and what a tier may do.

Read from the TOML file given with `--clients FILE`:

    default_tier = "free"   # optional: the tier of clients not listed, and of requests with
                            # no client id; without it those have no caps

    [tiers.free]
    max_concurrent = 2      # requests of one client running at once (default: no limit)
    max_queued = 8          # requests of one client waiting in the queue (default: no limit)
    priority = [5, 9]       # the priorities its requests may have, 0 most urgent .. 9 least
                            # (default [0, 9]); one asked outside it gets the nearest allowed

    [tiers.pro]
    max_concurrent = 16

    [clients]
    alice = "pro"           # client id -> tier name
    bob = "free"

Caps are per client, not per tier: two "free" clients may each run two requests. Any
mistake in the file (a misspelt key, a bool for a count, a client in an unknown tier) is a
ConfigFileError naming the file and line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from shoal.config_file import FieldError, TomlFile, is_int

MOST_URGENT = 0
LEAST_URGENT = 9  # GenerationRequest.priority runs from MOST_URGENT to LEAST_URGENT

_TOP_KEYS = ("default_tier", "tiers", "clients")
_TIER_KEYS = ("max_concurrent", "max_queued", "priority")


@dataclass(frozen=True)
class Tier:
    name: str
    max_concurrent: int | None = None  # None: no limit
    max_queued: int | None = None  # None: no limit
    priority_min: int = MOST_URGENT
    priority_max: int = LEAST_URGENT

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FieldError(("name",), f"a tier name must be a non-empty string, "
                                        f"not {self.name!r}")
        for field in ("max_concurrent", "max_queued"):
            value = getattr(self, field)
            if value is not None and not (is_int(value) and value >= 1):
                raise FieldError((field,), f"{field} must be an integer >= 1, not {value!r}")
        low, high = self.priority_min, self.priority_max
        if not (is_int(low) and is_int(high) and MOST_URGENT <= low <= high <= LEAST_URGENT):
            low_ok = is_int(low) and MOST_URGENT <= low <= LEAST_URGENT
            field = "priority_max" if low_ok else "priority_min"
            raise FieldError((field,), f"priority must be a range [min, max] of integers with "
                                       f"{MOST_URGENT} <= min <= max <= {LEAST_URGENT}, "
                                       f"not [{low!r}, {high!r}]")

    def clamp(self, priority: int) -> int:
        """The allowed priority nearest to the one a request asked for."""
        return min(max(priority, self.priority_min), self.priority_max)


@dataclass(frozen=True)
class ClientTiers:
    tiers: Mapping[str, Tier]  # tier name -> tier
    clients: Mapping[str, str]  # client id -> tier name
    default_tier: str | None = None  # tier of unlisted clients; None: they have no caps

    def __post_init__(self) -> None:
        # Read-only copies: the caller's dicts must not change a frozen config afterwards.
        object.__setattr__(self, "tiers", MappingProxyType(dict(self.tiers)))
        object.__setattr__(self, "clients", MappingProxyType(dict(self.clients)))
        for name, tier in self.tiers.items():
            if tier.name != name:
                raise FieldError(("tiers", name), f"tier {name!r} is named {tier.name!r}")
        for client, tier_name in self.clients.items():
            if tier_name not in self.tiers:
                raise FieldError(("clients", client),
                                 f"client {client!r} is in tier {tier_name!r}, which is not "
                                 f"defined{_defined(self.tiers)}")
        if self.default_tier is not None and self.default_tier not in self.tiers:
            raise FieldError(("default_tier",), f"default_tier {self.default_tier!r} is not "
                                                f"defined{_defined(self.tiers)}")

    def tier_of(self, client_id: str | None) -> Tier | None:
        """The tier of client_id (None: a request with no client id): its own, else the
        default tier, else None (no caps)."""
        name = self.clients.get(client_id) if client_id is not None else None
        if name is None:
            name = self.default_tier
        return None if name is None else self.tiers[name]


def _defined(tiers: Mapping[str, Tier]) -> str:
    return f" (tiers: {', '.join(sorted(tiers))})" if tiers else " (no [tiers.NAME] tables)"


def load_clients(path: Path) -> ClientTiers:
    """The client tiers in a --clients file (format in the module docstring);
    ConfigFileError naming the file and line for anything wrong in it."""
    file = TomlFile.read(path)
    top = file.table((), allowed=_TOP_KEYS)
    tiers = {name: _load_tier(file, name) for name in file.table(("tiers",))}
    clients = file.table(("clients",))
    for client, tier_name in clients.items():
        if not isinstance(tier_name, str):
            raise file.error(("clients", client), f"clients.{client} must be a tier name "
                                                  f"(a string), not {tier_name!r}")
    default_tier = top.get("default_tier")
    if default_tier is not None and not isinstance(default_tier, str):
        raise file.error(("default_tier",), f"default_tier must be a tier name (a string), "
                                            f"not {default_tier!r}")
    try:
        return ClientTiers(tiers=tiers, clients=clients, default_tier=default_tier)
    except FieldError as error:
        raise file.error(error.field, str(error)) from None


def _load_tier(file: TomlFile, name: str) -> Tier:
    key_path = ("tiers", name)
    table = file.table(key_path, allowed=_TIER_KEYS)
    priority = table.get("priority", [MOST_URGENT, LEAST_URGENT])
    if not (isinstance(priority, list) and len(priority) == 2):
        raise file.error((*key_path, "priority"),
                         f"priority must be [min, max] such as [{MOST_URGENT}, "
                         f"{LEAST_URGENT}], not {priority!r}")
    try:
        return Tier(name, max_concurrent=table.get("max_concurrent"),
                    max_queued=table.get("max_queued"),
                    priority_min=priority[0], priority_max=priority[1])
    except FieldError as error:
        # The file sets priority_min and priority_max together, as `priority = [min, max]`.
        key = "priority" if error.field[0].startswith("priority") else error.field[0]
        raise file.error((*key_path, key), f"tiers.{name}: {error}") from None
