"""The llama-server binary a node may drive: found on PATH or named (--llama-server), and
asked once for its version and the devices its build drives (`--list-devices`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

BINARY_NAME = "llama-server"
# A probe runs the binary twice; a broken build or a slow driver must not stall `shoal serve`.
_PROBE_TIMEOUT_S = 30.0
# "  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23500 MiB free)" (common/arg.cpp)
_DEVICE_LINE = re.compile(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$")
_MIB = 1024 * 1024


class LlamaServerNotUsable(RuntimeError):
    """The named llama-server cannot be run; the message says why."""


@dataclass(frozen=True)
class Device:
    """A device llama-server's build drives besides the CPU (a GPU, a Metal device)."""

    name: str  # ggml's name: CUDA0, Metal, Vulkan0, ...
    description: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class LlamaServerBinary:
    path: Path
    version: str
    devices: tuple[Device, ...] = ()  # empty: a CPU build
    # Whether it filters its log by --log-verbosity (newer builds; at the default, 3, they
    # leave out the buffer sizes its runner reads its device memory from).
    log_verbosity: bool = False

    def describe(self) -> str:
        drives = ", ".join(f"{d.name} ({d.description}, {d.total_bytes // _MIB} MiB)"
                           for d in self.devices) or "CPU only"
        return f"{self.path} ({self.version}): {drives}"


def parse_devices(listing: str) -> tuple[Device, ...]:
    """The devices of `llama-server --list-devices` output ("(none)" on a CPU build)."""
    devices = []
    for line in listing.splitlines():
        match = _DEVICE_LINE.match(line)
        if match:
            name, description, total, free = match.groups()
            devices.append(Device(name, description, int(total) * _MIB, int(free) * _MIB))
    return tuple(devices)


def _run(path: Path, flag: str) -> str:
    try:
        done = subprocess.run([str(path), flag], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LlamaServerNotUsable(f"{path} {flag} failed: {error}") from error
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise LlamaServerNotUsable(f"{path} {flag} exited with {done.returncode}: {tail[0]}")
    return done.stdout + done.stderr


def probe(path: Path) -> LlamaServerBinary:
    """Ask the binary its version and devices (LlamaServerNotUsable if it cannot answer)."""
    if not path.is_file():
        raise LlamaServerNotUsable(f"{path} is not a file")
    version_text = _run(path, "--version")
    match = re.search(r"version: (\S+(?: \([0-9a-f]+\))?)", version_text)
    version = match.group(1) if match else "unknown version"
    return LlamaServerBinary(path=path, version=version,
                             devices=parse_devices(_run(path, "--list-devices")),
                             log_verbosity="--log-verbosity" in _run(path, "--help"))


def find_llama_server(named: Path | None) -> LlamaServerBinary | None:
    """The named binary (it must work), else llama-server on PATH if there is one that
    works, else None."""
    if named is not None:
        return probe(named.expanduser())
    found = shutil.which(BINARY_NAME)
    if found is None:
        return None
    try:
        return probe(Path(found))
    except LlamaServerNotUsable:
        return None
