"""How a node pulls: its registry, its store's bound, when requests pull, the timeouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ON_DEMAND = ("off", "catalog", "all")
OnDemand = Literal["off", "catalog", "all"]


@dataclass(frozen=True)
class PullSettings:
    ollama_registry: str | None = None  # None: $SHOAL_OLLAMA_REGISTRY, else Ollama's own
    # --pull-on-demand: which models a request may pull when they are not on disk
    on_demand: OnDemand = "catalog"
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0  # between bytes, not for a whole file
    models_disk: int | None = None  # --models-disk: the store's bound in bytes
    disk_margin_bytes: int = 64 * 1024 * 1024  # left free beyond the model itself

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("pull timeouts must be positive")
        if self.models_disk is not None and self.models_disk <= 0:
            raise ValueError("--models-disk must be a positive size")
        if self.on_demand not in ON_DEMAND:
            raise ValueError(f"--pull-on-demand must be one of {', '.join(ON_DEMAND)}, not "
                             f"{self.on_demand!r}")
