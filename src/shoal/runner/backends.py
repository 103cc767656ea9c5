"""The backends one node runs, found once at start: shoal's engine always, llama-server when
its binary is named or on PATH (diffusers, for images, is wired beside them)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from shoal.backend_names import DEFAULT_BACKEND
from shoal.runner.llama_server.binary import LlamaServerBinary, find_llama_server

log = logging.getLogger("shoal.backends")

LLAMA_SERVER = "llama-server"


@dataclass(frozen=True)
class NodeBackends:
    llama_server: LlamaServerBinary | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (DEFAULT_BACKEND, *((LLAMA_SERVER,) if self.llama_server else ()))

    def devices(self) -> dict[str, tuple[str, ...]]:
        """Backend -> the devices it drives, as telemetry advertises them."""
        devices = {DEFAULT_BACKEND: ("cpu",)}
        if self.llama_server is not None:
            devices[LLAMA_SERVER] = tuple(
                f"{d.name}: {d.description} ({d.total_bytes >> 20} MiB)"
                for d in self.llama_server.devices) or ("cpu",)
        return devices

    @property
    def device_backends(self) -> tuple[str, ...]:
        """The backends that keep their models in accelerator memory here: llama-server
        when its build drives a device (a CPU build keeps them in RAM)."""
        if self.llama_server is not None and self.llama_server.devices:
            return (LLAMA_SERVER,)
        return ()

    def describe(self) -> list[str]:
        """One line per backend, for the log at start."""
        lines = ["backend engine: shoal's own, on the CPU"]
        if self.llama_server is not None:
            lines.append(f"backend llama-server: {self.llama_server.describe()}")
        else:
            lines.append("backend llama-server: not found (put it on PATH or pass "
                         "--llama-server PATH)")
        return lines


def detect_backends(llama_server: Path | None) -> NodeBackends:
    """What this node runs; a named llama-server that cannot run is LlamaServerNotUsable."""
    return NodeBackends(llama_server=find_llama_server(llama_server))
