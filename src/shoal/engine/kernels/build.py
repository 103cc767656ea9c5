"""Build and load the compiled kernels, once per machine: the decode kernel (decode.cpp) and
the packed GGUF weight matmul (quant_*.cpp).

The extension is compiled for this CPU (-march=native) with torch's C++ extension tool.
`make install` builds it ahead of time (`python -m shoal.engine.kernels`). A model that
keeps its weights packed needs it and waits for the build (about 90 s on 2 cores) when it is
missing; a failed build (no compiler, say) is logged once, and models then load with
dequantized weights and decode on the Python path.

Builds live under SHOAL_KERNEL_DIR (default ~/.cache/shoal/kernels), one folder per source,
flags and torch version, so a new torch or an edited source never loads a stale library.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in ("decode.cpp", "quant_pack.cpp", "quant_matmul.cpp",
                                          "quant_paths.cpp", "quant_groups.cpp", "quant_avx2.cpp",
                                          "quant_estimate.cpp", "quant_head_copy.cpp",
                                          "quant_head_split.cpp", "quant_experts.cpp",
                                          "quant_bindings.cpp"))
HEADERS = tuple(_HERE / name for name in (
    "attention.h", "decode_rows.h", "kv_layout.h", "prompt_attention.h", "vector.h", "vector_avx2.h", "quant.h",
    "quant_amx.h", "quant_avx2.h", "quant_experts.h", "quant_avx512.h", "quant_backend.h", "quant_buffers.h", "quant_formats.h",
    "quant_kernels.h", "quant_prefetch.h", "quant_head_copy.h", "quant_head_split.h", "quant_estimate_avx2.h",
    "quant_simd.h", "quant_strip.h"))
NAME = "shoal_kernels"
# -fopenmp compiles at::parallel_for's OpenMP regions; nothing links an OpenMP runtime here,
# so they bind to the one torch itself loaded (two runtimes would fight over the cores).
# -ffp-contract=off: the compiler must not fuse a multiply and an add into one rounding on
# its own; the packed matmul's results depend on every row taking the same roundings.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")


def _cxx_runtime() -> list[str]:
    """The C++ runtime torch itself loaded (its libstdc++.so.6), named to the linker ahead of
    the compiler's own libraries, so that the extension links that shared library. A compiler
    whose C++ library is static only ($CXX a wrapper whose own lib folder has libstdc++.a
    and no libstdc++.so, as some images have) would otherwise put a second copy of the
    runtime inside the extension: its locale facets carry other ids than the ones torch's
    copy registered, and the first number streamed into a string (a TORCH_CHECK message)
    calls a wrong facet and crashes the process."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and Path(fields[5].strip()).name.startswith("libstdc++.so"):
                    return [fields[5].strip()]
    except OSError:
        pass
    return []


def build_dir() -> Path:
    root = os.environ.get("SHOAL_KERNEL_DIR") or Path.home() / ".cache" / "shoal" / "kernels"
    digest = hashlib.sha256()
    sources = (*SOURCES, *HEADERS)
    for part in (*(path.read_bytes() for path in sources), " ".join(FLAGS).encode(),
                 " ".join(_cxx_runtime()).encode(), torch.__version__.encode(),
                 _cpu_features().encode()):
        digest.update(part)
    return Path(root) / f"{NAME}-{digest.hexdigest()[:16]}"


def _cpu_features() -> str:
    """The CPU's instruction-set flags: -march=native code must not load on another CPU
    that shares the cache folder (a network home directory, say)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor() or platform.machine()


class _Kernel:
    """The process's one copy of the extension: None until built and loaded."""

    def __init__(self) -> None:
        self.module: ModuleType | None = None
        self.failed = False
        self._lock = threading.Lock()

    def load(self) -> ModuleType | None:
        """Build if needed (blocking) and load; None if the build failed."""
        with self._lock:
            if self.module is None and not self.failed:
                directory = build_dir()
                try:
                    self.module = _import_or_rebuild(directory)
                except Exception as exc:  # compiler missing or failing: no packed weights
                    self.failed = True
                    log.warning("compiled kernels unavailable (weights load dequantized, "
                                "decoding runs on the Python path): %s", exc)
            return self.module


def _import_or_rebuild(directory: Path) -> ModuleType:
    """The finished build, or a new one where there is none or it does not load (a build
    killed while linking leaves a truncated library behind)."""
    if _built(directory):
        try:
            return _import(directory)
        except ImportError as exc:
            log.warning("the built kernels do not load (%s); building them again", exc)
            (directory / f"{NAME}.so").unlink(missing_ok=True)
    return _compile(directory)


def _built(directory: Path) -> bool:
    return (directory / f"{NAME}.so").is_file()


def _import(directory: Path) -> ModuleType:
    """Import a finished build directly. torch's load() would also do it, but only after
    taking the build folder's lock file, which a process killed mid-load leaves behind and
    every later load then waits on forever."""
    spec = importlib.util.spec_from_file_location(NAME, directory / f"{NAME}.so")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {directory / NAME}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A build lock older than this was left by a killed build (a build takes ~90 s).
STALE_LOCK_S = 600


def _compile(directory: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass
    _put_ninja_on_path()
    return load(NAME, [str(path) for path in SOURCES], extra_cflags=list(FLAGS),
                extra_ldflags=_cxx_runtime(), build_directory=str(directory), verbose=False)


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip package's binary may not be on it
    (a server started as .venv/bin/shoal without an activated environment)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


KERNEL = _Kernel()
