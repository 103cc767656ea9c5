"""What the node runs on: versions (shoal, Python, torch, zenoh, ...), the platform, a
summary of the CPU's flags, and memory. Read without importing torch (package metadata)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

import psutil

# The CPU features shoal's kernels and torch's use, reported present or missing.
CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8", "asimd", "sve")
_PACKAGES = {"shoal": "shoal", "torch": "torch", "zenoh": "eclipse-zenoh",
             "fastapi": "fastapi", "uvicorn": "uvicorn", "pydantic": "pydantic",
             "tokenizers": "tokenizers", "gguf": "gguf", "llguidance": "llguidance",
             "opentelemetry-sdk": "opentelemetry-sdk"}


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name, distribution in _PACKAGES.items():
        try:
            found[name] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def platform_summary() -> dict[str, Any]:
    return {"system": platform.system(), "release": platform.release(),
            "machine": platform.machine(), "platform": platform.platform(),
            "python_implementation": platform.python_implementation()}


def cpu_summary(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """{"model", "logical_cores", "physical_cores", "features": present, "missing"} from
    /proc/cpuinfo (features unknown elsewhere: both lists empty, "model" None)."""
    model, flags = None, set()
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as info:
            for line in info:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "Model") and model is None:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "logical_cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "features": [f for f in CPU_FEATURES if f in flags],
            "missing": [f for f in CPU_FEATURES if flags and f not in flags]}


def node_memory() -> dict[str, int]:
    memory = psutil.virtual_memory()
    return {"total_bytes": memory.total, "available_bytes": memory.available,
            "node_process_rss_bytes": psutil.Process().memory_info().rss}
