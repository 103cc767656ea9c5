"""What a llama-server process holds on its devices, read from the buffer sizes it logs while
loading: "load_tensors:        CUDA0 model buffer size =  1234.56 MiB", "llama_kv_cache:
CUDA0 KV buffer size = ...", "... CUDA0 compute buffer size = ..." (llama.cpp names each
buffer by its ggml backend buffer type; builds that filter their log by verbosity print
these at 4, which the launch asks for where the build knows --log-verbosity). Buffers on a device its build drives (--list-devices:
CUDA0, Vulkan0, MTL0, ...) are device memory; host buffers (CPU, CPU_Mapped, CUDA_Host, ...)
are in its resident memory already. The log is the one account that every build (CUDA,
ROCm, Metal, Vulkan) gives the same way, and it counts this process alone."""

from __future__ import annotations

import re
from collections.abc import Iterable

# "<function>: <buffer name> <what> buffer size = <MiB> MiB", after a timestamp and a level
# letter on builds that prefix their log lines.
_BUFFER_LINE = re.compile(r"\w+:\s+(\S+)\s+([\w ]*?)\s*buffer size\s*=\s*([0-9.]+) MiB")
_MIB = 1024 * 1024


class DeviceBuffers:
    """The device buffers one llama-server process announced, by buffer name and kind."""

    def __init__(self, devices: Iterable[str]) -> None:
        self.devices = tuple(devices)
        self._sizes: dict[tuple[str, str], int] = {}

    def reset(self) -> None:
        """A new process: forget the last one's buffers."""
        self._sizes.clear()

    def read(self, line: str) -> None:
        """Note the buffer a log line announces, if it does and the buffer is on a device.
        A buffer announced again (a context re-reserved) replaces its earlier size."""
        match = _BUFFER_LINE.search(line)
        if match is None:
            return
        name, kind, mib = match.groups()
        if self._on_device(name):
            self._sizes[(name, kind)] = int(float(mib) * _MIB)

    @property
    def total_bytes(self) -> int | None:
        """Bytes on devices, None on a build that drives none (a CPU build)."""
        if not self.devices:
            return None
        return sum(self._sizes.values())

    def _on_device(self, name: str) -> bool:
        # "CUDA0" and a row-split "CUDA0_Split" are the device's; "CUDA_Host" is pinned RAM.
        return not name.endswith("_Host") and any(
            name == device or name.startswith(device + "_") for device in self.devices)
